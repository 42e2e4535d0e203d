"""The lengths a training step runs at, for the step estimate (`llds_jax.step_estimate`): the worst case the
programs are compiled for, and expected lengths read from a run's logged metrics (`--estimate_from=RUN_DIR`) or,
without a run, this module's defaults, each saying where it comes from.

What the lengths change in the estimate:
- the decode: a turn-synchronous session decodes until its last row ends each turn and until its longest
  conversation ends, so its decode steps are its rows' mean sampled tokens divided by the decode occupancy (the
  share of row-steps that sample: `rollout/decode_occupancy`); with `rollout.continuous_batching` a freed row takes
  the next conversation, so the decode follows the host's sampled tokens over its rows (occupancy 1 assumed);
- the updates: with `optim.pack_trajectories` the trajectories are packed into rows of the compiled length, so
  the forwards and the update follow the mean trajectory's tokens (prompt, sampled and observation tokens), plus
  the packing's padding; without it they run at the batch's longest trajectory (the worst case assumed);
- retrieval: the calls that hold a session, each of up to the step's searches over those calls, at the retriever's
  cost per call (`step_estimate.retrieval_seconds`).
Prefills, extends, cache growth and compaction keep their worst-case counts (an upper bound: 17% of qwen7b_v4's
worst-case rollout).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping, Sequence

from llds_jax.errors import InputError

# Defaults without a run. No logged lengths of the paper's or Search-R1's training runs were found published (their
# figures plot response length and search counts over steps without the numbers this needs), so these are
# assumptions, named as such in the estimate's output:
# - 1.5 searches per trajectory: GRPO on Search-R1 settles at 1-2 (Su, "Search-R1, re-examined", 2026,
#   jinyansu1.github.io); the demo's policy searches 1.50 times per question (docs/demo.md);
# - 150 sampled tokens per turn (an assumption: a <think> paragraph and a query or an answer);
# - 400 tokens per observation: 3 passages of wiki-18 (a title and ~100 words each) in Search-R1's format;
# - 250 prompt tokens: Search-R1's instruction with a question (llds_jax/protocol.py's template, Qwen2.5 tokens);
# - the decode of a session at its worst case: with 128 rows, some row is assumed to reach each turn's token cap
#   and some conversation to use every turn.
DEFAULT_SEARCHES = 1.5
DEFAULT_TURN_TOKENS = 150.0
DEFAULT_OBSERVATION_TOKENS = 400.0
DEFAULT_PROMPT_TOKENS = 250.0
DEFAULTS_SOURCE = ("defaults (assumed, not measured: 1.5 searches and 2.5 turns of 150 tokens per trajectory, "
                   "observations of 400 tokens, prompts of 250; sessions decode at the worst case)")


@dataclasses.dataclass(frozen=True)
class Lengths:
    """Per trajectory, means over a step (tokens), and what a session's decode runs.

    Attributes:
      sampled_tokens: tokens a trajectory samples over its turns.
      trajectory_tokens: tokens a trajectory trains on: its prompt, sampled and observation tokens.
      searches: searches a trajectory sends.
      decode_occupancy: the share of a session's row-steps that sample (1: every row samples every step); None:
        the session decodes at its worst case.
      padding: the share of the update batch's tokens that are padding (`perf/padding`), 0 when unknown.
      source: where the numbers come from, in words.
    """

    sampled_tokens: float
    trajectory_tokens: float
    searches: float
    decode_occupancy: float | None
    padding: float
    source: str


def defaults(cfg) -> Lengths:
    """This module's defaults for `cfg` (searches capped by `rollout.max_turns`, tokens by its caps)."""
    r = cfg.rollout
    searches = min(DEFAULT_SEARCHES, r.max_turns)
    sampled = (searches + 1) * min(DEFAULT_TURN_TOKENS, r.max_turn_tokens)
    observations = searches * min(DEFAULT_OBSERVATION_TOKENS, r.max_observation_tokens)
    tokens = min(DEFAULT_PROMPT_TOKENS + sampled + observations, r.max_context_tokens)
    return Lengths(sampled, tokens, searches, None, 0.0, DEFAULTS_SOURCE)


def from_metrics(records: Sequence[Mapping[str, float]], source: str) -> Lengths:
    """Mean lengths over a run's per-step metric records (metrics.jsonl's lines; steps without a rollout are
    skipped): `rollout/response_length` (sampled tokens per trajectory), `rollout/valid_searches`,
    `rollout/decode_occupancy`, `perf/padding`, and the trained tokens per trajectory from `perf/tokens_per_s` x
    `perf/step_s` (the batch's real tokens) over `rollout/trajectories` (else the batch size the run's records imply
    is unknown: ValueError naming the missing key)."""
    steps = [r for r in records if "rollout/response_length" in r]
    if not steps:
        raise InputError(f"{source}: no step logged rollout/response_length")
    missing = [k for k in ("rollout/valid_searches", "rollout/decode_occupancy", "perf/tokens_per_s", "perf/step_s",
                           "rollout/trajectories") if any(r.get(k) is None for r in steps)]
    if missing:
        raise InputError(f"{source}: steps without {', '.join(missing)} (a run of an older version logs fewer "
                         "metrics)")

    def mean(values):
        return sum(values) / len(values)

    trained = [r["perf/tokens_per_s"] * r["perf/step_s"] / r["rollout/trajectories"] for r in steps]
    return Lengths(mean([r["rollout/response_length"] for r in steps]), mean(trained),
                   mean([r["rollout/valid_searches"] for r in steps]),
                   mean([r["rollout/decode_occupancy"] for r in steps]), mean([r.get("perf/padding", 0.0) for r in steps]),
                   f"{source}: means over its {len(steps)} steps")


def from_run(run_dir: str) -> Lengths:
    """`from_metrics` of `run_dir`/metrics.jsonl (OSError or ValueError naming the file and line)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    records = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise InputError(f"{path}, line {number}: not JSON ({e.msg})") from None
    return from_metrics(records, f"the run {run_dir}")


def decode_share(cfg, lengths: Lengths, sequences: int, rows: int) -> float:
    """A step's decode-chunk calls at `lengths` as a share of the worst case's, for one host's `sequences` in
    sessions of `rows` rows (module docstring), at most 1."""
    r = cfg.rollout
    worst = (r.max_turns + 1) * r.max_turn_tokens  # decode steps per session (or per row of a continuous batch)
    if r.continuous_batching:
        steps = sequences * lengths.sampled_tokens / rows / math.ceil(sequences / rows)
    elif lengths.decode_occupancy is None:
        return 1.0
    else:
        steps = lengths.sampled_tokens / lengths.decode_occupancy
    return min(1.0, steps / worst)


def update_share(cfg, lengths: Lengths) -> float:
    """The forwards' and updates' cost at `lengths` as a share of the worst case's (module docstring), at most 1."""
    if not cfg.optim.pack_trajectories:
        return 1.0
    return min(1.0, lengths.trajectory_tokens / (1 - lengths.padding) / cfg.rollout.max_context_tokens)
