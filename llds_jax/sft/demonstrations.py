"""Demonstrations for the supervised warm start: protocol-format multi-turn transcripts, read from JSONL.

One record per line, the shape of the `transcripts.jsonl` that evaluation writes (so a teacher's or an earlier
run's transcripts can be used as they are):

    {"question": "Where was Tova Ren born?",
     "turns": [{"text": "<think> ... </think>\\n<search> Tova Ren </search>",
                "observation": "\\n\\n<information>Doc 1(Title: ...) ...</information>\\n\\n"},
               {"text": "<think> ... </think>\\n<answer> Veltra </answer>"}],
     "score": 1.0}

"turns" holds the model's turns in order; "observation" (what the environment appended after the turn) is optional
and is context only, never trained. "score" is optional; records below a minimum score can be skipped.

`encode` lays a record out as the rollout would: the prompt (`protocol.chat_prompt_ids`), then each turn's text and
observation, each encoded with add_special_tokens=False; the loss mask is 1 on the turns' tokens only.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Sequence
from typing import Any, Optional

import numpy as np
from etils import epath

from llds_jax import protocol
from llds_jax.data.jsonl import iter_jsonl
from llds_jax.errors import InputError


@dataclasses.dataclass(frozen=True)
class Demonstration:
    """One transcript: the question, its turns as (model text, observation or None), an optional score."""

    question: str
    turns: tuple[tuple[str, Optional[str]], ...]
    score: Optional[float] = None


def _field(where: str, record: dict, key: str, kind: type, optional: bool = False) -> Any:
    if key not in record:
        if optional:
            return None
        raise InputError(f"{where}: missing key '{key}'")
    value = record[key]
    if value is None and optional:
        return None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind):
        raise InputError(f"{where}: key '{key}' must be {kind.__name__}, got {type(value).__name__}")
    return value


def parse_record(where: str, record: Any) -> Demonstration:
    """A JSON record as a Demonstration; errors name `where` and the key."""
    if not isinstance(record, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(record).__name__}")
    question = _field(where, record, "question", str)
    turns_in = _field(where, record, "turns", list)
    if not turns_in:
        raise InputError(f"{where}: key 'turns' is empty")
    turns = []
    for i, turn in enumerate(turns_in):
        at = f"{where}: turns[{i}]"
        if not isinstance(turn, dict):
            raise InputError(f"{at}: expected an object, got {type(turn).__name__}")
        turns.append((_field(at, turn, "text", str), _field(at, turn, "observation", str, optional=True)))
    return Demonstration(question=question, turns=tuple(turns), score=_field(where, record, "score", float, True))


def read_demonstrations(paths: Sequence[str], min_score: Optional[float] = None) -> list[Demonstration]:
    """The records of JSONL files, in order; with `min_score`, records whose score is lower (or absent) are
    skipped. Raises ValueError naming file:line and key for a bad record, or when nothing is left."""
    demos = []
    for path in paths:
        path = epath.Path(path)
        if not path.exists():
            raise FileNotFoundError(f"demonstrations file not found: {path}")
        for where, record in iter_jsonl(path):
            demo = parse_record(where, record)
            if min_score is None or (demo.score is not None and demo.score >= min_score):
                demos.append(demo)
    if not demos:
        raise InputError(f"no demonstrations in {', '.join(map(str, paths))}"
                         + (f" with score >= {min_score}" if min_score is not None else ""))
    return demos


def write_demonstrations(path: str, records: Iterable[dict]) -> str:
    """Writes JSON records (validated by `parse_record`) one per line; returns `path`."""
    lines = []
    for i, record in enumerate(records):
        parse_record(f"record {i}", record)
        lines.append(json.dumps(record, ensure_ascii=False))
    epath.Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def encode(demo: Demonstration, tokenizer, max_prompt_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens_t int32, loss_mask_t float32) of a demonstration: prompt, then each turn and its observation."""
    ids = protocol.chat_prompt_ids(tokenizer, demo.question, max_prompt_tokens)
    mask = [0.0] * len(ids)
    for text, observation in demo.turns:
        turn = tokenizer.encode(text, add_special_tokens=False)
        ids += turn
        mask += [1.0] * len(turn)
        if observation:
            obs = tokenizer.encode(observation, add_special_tokens=False)
            ids += obs
            mask += [0.0] * len(obs)
    return np.asarray(ids, np.int32), np.asarray(mask, np.float32)
