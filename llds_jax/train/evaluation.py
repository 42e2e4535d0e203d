"""Evaluation: a fixed subset stratified over data_source, exact match and searches per question per data_source,
the unweighted mean over sources, transcripts and printed tables."""
from __future__ import annotations

import json
from collections import defaultdict
from typing import Any, Callable, Mapping, Sequence

import numpy as np
from etils import epath

from llds_jax.data.rewards import DEFAULT_EMPTY_ANSWER
from llds_jax.rollout.trajectory import Trajectory, em_score

MEAN_KEY = "mean"


def stratified_subset(examples: Sequence[Any], size: int, seed: int) -> list[Any]:
    """A fixed subset of `size` examples spread as evenly over `data_source` as the sources allow, in file order.

    Each source gets an equal share of `size` (sources smaller than their share give all they have, the rest is
    shared among the others; the remainder of the division goes to the largest sources); within a source the
    examples are drawn without replacement by a generator seeded with `seed` (same examples, seed and size: same
    subset). `size` 0 or at least the number of examples: every example.
    """
    if size <= 0 or size >= len(examples):
        return list(examples)
    rows_by_source: dict[str, list[int]] = defaultdict(list)
    for row, example in enumerate(examples):
        rows_by_source[example.data_source].append(row)
    sources = sorted(rows_by_source, key=lambda source: (len(rows_by_source[source]), source))
    rng = np.random.default_rng(seed)
    chosen, left = [], size
    for i, source in enumerate(sources):
        rows = rows_by_source[source]
        take = min(len(rows), left // (len(sources) - i))
        chosen += [rows[j] for j in rng.choice(len(rows), take, replace=False)]
        left -= take
    return [examples[row] for row in sorted(chosen)]


def source_table(trajectories: Sequence[Trajectory], value: Callable[[Trajectory], float]) -> dict[str, float]:
    """Mean of `value` per data_source (sorted by name) and the unweighted mean of those under "mean"."""
    by_source: dict[str, list[float]] = defaultdict(list)
    for t in trajectories:
        by_source[t.example.data_source].append(value(t))
    table = {source: sum(v) / len(v) for source, v in sorted(by_source.items())}
    table[MEAN_KEY] = sum(table.values()) / len(table) if table else 0.0
    return table


def em_table(trajectories: Sequence[Trajectory], empty_answer: str = DEFAULT_EMPTY_ANSWER) -> dict[str, float]:
    """Mean EM per data_source and their unweighted mean under "mean" (`empty_answer`: the run's
    `reward.empty_answer`)."""
    return source_table(trajectories, lambda t: em_score(t, empty_answer))


def searches_table(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """Valid searches per question, per data_source and their unweighted mean under "mean"."""
    return source_table(trajectories, lambda t: float(t.num_valid_searches))


def format_columns(columns: Mapping[str, Mapping[str, float]], counts: Mapping[str, int] | None = None) -> str:
    """Tables (EM or searches per question) side by side, one column per name (e.g. "start" and "step 40"), one
    source per line, the mean last; `counts` adds the number of questions per source."""
    sources = list(dict.fromkeys(source for table in columns.values() for source in table))
    sources = [s for s in sources if s != MEAN_KEY] + [MEAN_KEY]
    width = max(len("data_source"), *(len(s) for s in sources))
    widths = [max(6, len(name)) for name in columns]
    lines = ["  ".join(["data_source".ljust(width), *(n.rjust(w) for n, w in zip(columns, widths))])
             + ("  n" if counts else "")]
    for source in sources:
        cells = [(f"{table[source]:.3f}" if source in table else "-").rjust(w)
                 for table, w in zip(columns.values(), widths)]
        n = f"  {counts[source]}" if counts and source in counts else ""
        lines.append("  ".join([source.ljust(width), *cells]) + n)
    return "\n".join(lines)


def read_results(out_dir: epath.Path) -> dict[str, Any] | None:
    """The `results.json` that `write_results` wrote in `out_dir` ({"em", "searches", "counts"}), or None."""
    path = epath.Path(out_dir) / "results.json"
    return json.loads(path.read_text()) if path.exists() else None


def transcript_record(t: Trajectory, tokenizer, empty_answer: str = DEFAULT_EMPTY_ANSWER) -> dict[str, Any]:
    """One trajectory as a JSON-able transcript: prompt, turns with observations, answer, score."""
    return {
        "uid": t.uid, "id": t.example.id, "data_source": t.example.data_source, "question": t.example.question,
        "golden_answers": list(t.example.golden_answers),
        "prompt": tokenizer.decode(list(t.prompt_ids), skip_special_tokens=False),
        "turns": [{"text": turn.text, "action": turn.action.kind, "content": turn.action.content,
                   "observation": turn.observation, "observation_truncated": turn.observation_truncated,
                   "search_error": turn.search_error} for turn in t.turns],
        "final_answer": t.final_answer, "score": em_score(t, empty_answer), "end_reason": t.end_reason,
    }


def transcript_text(t: Trajectory, tokenizer, empty_answer: str = DEFAULT_EMPTY_ANSWER) -> str:
    """A trajectory as readable text: the question, each turn followed by its observation, the score."""
    parts = [f"question: {t.example.question}", f"gold: {list(t.example.golden_answers)}", ""]
    for turn in t.turns:
        parts.append(turn.text)
        if turn.observation:
            parts.append(turn.observation)
    parts.append(f"\nanswer: {t.final_answer!r}  score: {em_score(t, empty_answer)}  end: {t.end_reason}")
    return "\n".join(parts)


def write_results(out_dir: epath.Path, trajectories: Sequence[Trajectory], em: Mapping[str, float],
                  searches: Mapping[str, float], tokenizer, empty_answer: str = DEFAULT_EMPTY_ANSWER) -> None:
    """Writes `transcripts.jsonl` (one record per question) and `results.json` (the tables `em` and `searches`
    of the trajectories, and question counts per data_source)."""
    out_dir = epath.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(transcript_record(t, tokenizer, empty_answer), ensure_ascii=False) for t in trajectories]
    (out_dir / "transcripts.jsonl").write_text("\n".join(lines) + "\n")
    counts: dict[str, int] = defaultdict(int)
    for t in trajectories:
        counts[t.example.data_source] += 1
    results = {"em": dict(em), "searches": dict(searches), "counts": dict(counts)}
    (out_dir / "results.json").write_text(json.dumps(results, indent=2))
