"""Search-R1 QA data files (parquet, or JSONL with the same fields): reader and writers.

A Search-R1 row has `id, question, golden_answers, data_source, prompt, ability, reward_model,
extra_info`. We need `question`, `golden_answers` (falling back to `reward_model.ground_truth.target`)
and `data_source`; `id` is kept when present. Search-R1's `extra_info.index` restarts for every
source, so examples carry their own `uid`, unique within a file, as the GRPO group key.

A row whose golden answers all normalize to nothing (blank, articles or punctuation only: `[""]`, `["The."]`) is
matched by any answer that normalizes to nothing too. With the rule "search_r1" (`reward.empty_answer`, the
paper's code) such rows are kept, as Search-R1 keeps them; with "zero" no answer can earn reward on them, and
they are skipped. Either way one warning per file counts them and names the first ones. A file that is not
parquet/JSONL, or has no usable row, raises ValueError naming it.

A question longer than the prompt can use (`protocol.bounded_question`: 2 x rollout.max_prompt_tokens x 128
characters) is cut to its end as it is read, which changes no token the prompt keeps; one warning per file counts
and names them.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from etils import epath

from llds_jax.data.jsonl import iter_jsonl
from llds_jax.data.rewards import DEFAULT_EMPTY_ANSWER, normalize_answer
from llds_jax.errors import InputError
from llds_jax.protocol import bounded_question, make_prompt, max_question_chars

log = logging.getLogger(__name__)
_NAMED_ROWS = 3  # the rows a warning names

REQUIRED_COLUMNS = ("question", "data_source")
_ANSWERS = "golden_answers"
_ANSWERS_FALLBACK = "reward_model"

_PARQUET_SCHEMA = pa.schema([
    ("id", pa.string()),
    ("question", pa.string()),
    ("golden_answers", pa.list_(pa.string())),
    ("data_source", pa.string()),
    ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
    ("ability", pa.string()),
    ("reward_model", pa.struct([
        ("style", pa.string()),
        ("ground_truth", pa.struct([("target", pa.list_(pa.string()))])),
    ])),
    ("extra_info", pa.struct([("split", pa.string()), ("index", pa.int64())])),
])


@dataclasses.dataclass(frozen=True)
class QAExample:
    """One question: `uid` is `{data_source}-{row}` (unique within its file), `id` the file's own id."""
    uid: str
    question: str
    golden_answers: tuple[str, ...]
    data_source: str
    id: str | None = None


def read_qa(path: str | os.PathLike, empty_answer: str = DEFAULT_EMPTY_ANSWER,
            max_prompt_tokens: int | None = None) -> list[QAExample]:
    """Reads a Search-R1 QA file (local or gs://); `.parquet` or `.jsonl` decides the format. `empty_answer`: the
    reward rule (`reward.empty_answer`), which decides whether rows with only empty gold answers are kept;
    `max_prompt_tokens` (`rollout.max_prompt_tokens`) bounds the questions (`protocol.bounded_question`; None:
    as they are)."""
    path = os.fspath(path)
    if path.endswith(".parquet"):
        rows = _parquet_rows(path)
    elif path.endswith(".jsonl"):
        rows = _jsonl_rows(path)
    else:
        raise InputError(f"{path}: unknown QA file format (expected .parquet or .jsonl)")
    return _examples(path, rows, skip_empty_golds=empty_answer == "zero", max_prompt_tokens=max_prompt_tokens)


def _parquet_rows(path: str) -> Iterator[tuple[str, dict]]:
    with epath.Path(path).open("rb") as f:  # gcsfs for gs:// (pyarrow's own GCS client is not used)
        try:
            parquet = pq.ParquetFile(f)
            names = parquet.schema_arrow.names
            _check_columns(path, names)
            columns = [name for name in ("id", *REQUIRED_COLUMNS, _ANSWERS, _ANSWERS_FALLBACK) if name in names]
            records = parquet.read(columns=columns).to_pylist()
        except pa.ArrowException as e:  # an empty, truncated or non-parquet file
            raise InputError(f"{path}: not a readable parquet file ({e})") from None
    for row, record in enumerate(records):
        yield f"{path}: row {row}", record


def _jsonl_rows(path: str) -> Iterator[tuple[str, dict]]:
    for where, record in iter_jsonl(path):
        _check_columns(where, record.keys())
        yield where, record


def _check_columns(where: str, names: Iterable[str]) -> None:
    names = set(names)
    for column in REQUIRED_COLUMNS:
        if column not in names:
            raise InputError(f"{where}: missing required column '{column}'")
    if _ANSWERS not in names and _ANSWERS_FALLBACK not in names:
        raise InputError(
            f"{where}: missing required column '{_ANSWERS}' (and no '{_ANSWERS_FALLBACK}' to fall back on)")


def _examples(path: str, rows: Iterator[tuple[str, dict]], skip_empty_golds: bool, max_prompt_tokens: int | None
              ) -> list[QAExample]:
    examples, empty_golds, long_questions = [], [], []
    for row, (where, record) in enumerate(rows):
        question = _string(where, "question", record["question"])
        if not question.strip():  # before: "make_prompt: the question is empty" at the first rollout, no row named
            raise InputError(f"{where}: column 'question' is blank ({question!r})")
        data_source = _string(where, "data_source", record["data_source"])
        golden_answers = _golden_answers(where, record)
        if not any(normalize_answer(answer) for answer in golden_answers):
            empty_golds.append(where)
            if skip_empty_golds:
                continue
        bounded = question if max_prompt_tokens is None else bounded_question(question, max_prompt_tokens)
        if bounded != question:
            long_questions.append(where)
        examples.append(QAExample(
            uid=f"{data_source}-{row}",
            question=bounded,
            golden_answers=golden_answers,
            data_source=data_source,
            id=None if record.get("id") is None else str(record["id"]),
        ))
    counted = ""
    if empty_golds:
        named, rows = _named(empty_golds), _rows(empty_golds)
        if skip_empty_golds:
            counted = (f"skipped {rows} whose golden answers are all empty once normalized"
                       f" (blank, articles or punctuation only): {named}")
        else:
            counted = (f"kept {rows} whose golden answers are all empty once normalized (blank, articles or"
                       f" punctuation only), which an empty answer matches (reward.empty_answer='search_r1', as"
                       f" Search-R1; 'zero' skips them): {named}")
    if not examples:
        raise InputError(f"{path}: no examples" + (f"; {counted}" if counted else ""))
    if counted:
        log.warning(counted)
    if long_questions:
        limit = f"{max_question_chars(max_prompt_tokens):,}"
        log.warning(f"the questions of {_rows(long_questions)} are longer than {limit} characters; each keeps its "
                    f"last {limit} (its start cut as the prompt of rollout.max_prompt_tokens = {max_prompt_tokens} "
                    f"would cut it, keeping the same tokens): {_named(long_questions)}")
    return examples


def _named(rows: list[str]) -> str:
    """The first _NAMED_ROWS of `rows` (where each is), "; ..." when there are more."""
    return "; ".join(rows[:_NAMED_ROWS]) + ("; ..." if len(rows) > _NAMED_ROWS else "")


def _rows(rows: list[str]) -> str:
    """'1 row' or 'N rows'."""
    return f"{len(rows)} row" + ("s" if len(rows) > 1 else "")


def _string(where: str, column: str, value: Any) -> str:
    if not isinstance(value, str):
        raise InputError(f"{where}: column '{column}' must be a string, got {value!r}")
    return value


def _golden_answers(where: str, record: Mapping[str, Any]) -> tuple[str, ...]:
    answers = record.get(_ANSWERS)
    column = _ANSWERS
    if answers is None:
        column = "reward_model.ground_truth.target"
        try:
            answers = record[_ANSWERS_FALLBACK]["ground_truth"]["target"]
        except (KeyError, TypeError):
            raise InputError(f"{where}: no '{_ANSWERS}' and no '{column}'") from None
    if isinstance(answers, str):
        answers = [answers]
    if not isinstance(answers, list) or not answers or not all(isinstance(a, str) for a in answers):
        raise InputError(f"{where}: column '{column}' must be a non-empty list of strings, got {answers!r}")
    return tuple(answers)


def search_r1_records(examples: Iterable[QAExample], split: str) -> list[dict]:
    """Rows in Search-R1's full schema; `extra_info.index` counts per data source, as Search-R1's does."""
    counts: dict[str, int] = {}
    records = []
    for ex in examples:
        index = counts.get(ex.data_source, 0)
        counts[ex.data_source] = index + 1
        answers = list(ex.golden_answers)
        records.append({
            "id": ex.id if ex.id is not None else f"{split}_{index}",
            "question": ex.question,
            "golden_answers": answers,
            "data_source": ex.data_source,
            "prompt": [{"role": "user", "content": make_prompt(ex.question)}],
            "ability": "fact-reasoning",
            "reward_model": {"style": "rule", "ground_truth": {"target": answers}},
            "extra_info": {"split": split, "index": index},
        })
    return records


def write_qa_parquet(path: str | os.PathLike, examples: Iterable[QAExample], split: str = "test") -> None:
    """Writes `examples` as a Search-R1 parquet file."""
    pq.write_table(pa.Table.from_pylist(search_r1_records(examples, split), schema=_PARQUET_SCHEMA), path)
