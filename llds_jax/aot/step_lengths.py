"""The lengths a training step runs at, for the step estimate (`llds_jax.aot.step_estimate`): expected lengths read
from a run's logged metrics (`--estimate_from=RUN_DIR`) or, without a run, this module's defaults, each saying where
it comes from; and a run's logged step-program calls and batch tokens per token bucket, to set beside the
estimate's.

What the lengths change in the estimate:
- the rollout: the paged engine's calls at these lengths (`llds_jax.aot.rollout_schedule`: prompts, turns and their
  sampled tokens, observations), each costed at its tokens; retrieval by the searches;
- the updates: with `optim.pack_trajectories` the trajectories are packed into rows of the compiled length, so
  the forwards and the update follow the mean trajectory's tokens (prompt, sampled and observation tokens), plus
  the packing's padding; without it they run at the batch's longest trajectory (the worst case assumed).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping, Sequence

from llds_jax.config.sections import RunConfig
from llds_jax.errors import InputError

# Defaults without a run. No logged lengths of the paper's or Search-R1's training runs were found published (their
# figures plot response length and search counts over steps without the numbers this needs), so these are
# assumptions, named as such in the estimate's output:
# - 1.5 searches per trajectory: GRPO on Search-R1 settles at 1-2 (Su, "Search-R1, re-examined", 2026,
#   jinyansu1.github.io); the demo's policy searches 1.50 times per question (docs/demo.md);
# - 150 sampled tokens per turn (an assumption: a <think> paragraph and a query or an answer);
# - 400 tokens per observation: 3 passages of wiki-18 (a title and ~100 words each) in Search-R1's format;
# - 250 prompt tokens: Search-R1's instruction with a question (llds_jax/protocol.py's template, Qwen2.5 tokens).
DEFAULT_SEARCHES = 1.5
DEFAULT_TURN_TOKENS = 150.0
DEFAULT_OBSERVATION_TOKENS = 400.0
DEFAULT_PROMPT_TOKENS = 250.0
# - the turns' sampled tokens spread evenly over 0.5 to 1.5 x their mean (a standard deviation of 0.5 / sqrt(3) x
#   the mean); the prompts, observations and the turns per trajectory not spread (an assumption).
DEFAULT_TURN_SPREAD = 0.5
DEFAULTS_SOURCE = ("defaults (assumed, not measured: 1.5 searches and 2.5 turns of 150 tokens per trajectory, "
                   "observations of 400 tokens, prompts of 250)")


@dataclasses.dataclass(frozen=True)
class Lengths:
    """Per trajectory, means over a step (tokens).

    Attributes:
      prompt_tokens: tokens of its prompt.
      turns: turns it takes (each but the last followed by an observation).
      sampled_tokens: tokens it samples over its turns (rolled-back ones included).
      observation_tokens: tokens of one observation.
      trajectory_tokens: tokens it trains on: its prompt, kept sampled tokens and observations.
      searches: searches it sends.
      prompt_tokens_std, turns_std, turn_tokens_std, observation_tokens_std: the spreads (standard deviations,
        within a host's batch as the schedule drives one host's rollout) of a trajectory's prompt tokens and turns,
        of a turn's sampled tokens and of an observation's tokens: a
        barrier's turn round waits for its longest row and a call samples up to its longest sequence's samples, and
        the token buckets the engine's input calls fall in follow the lengths, not their means.
      padding: the share of the update batch's tokens that are padding (`perf/padding`), 0 when unknown.
      source: where the numbers come from, in words.
    """

    prompt_tokens: float
    turns: float
    sampled_tokens: float
    observation_tokens: float
    trajectory_tokens: float
    searches: float
    prompt_tokens_std: float
    turns_std: float
    turn_tokens_std: float
    observation_tokens_std: float
    padding: float
    source: str


def defaults(run: RunConfig) -> Lengths:
    """This module's defaults for the run config `run` (searches capped by `rollout.max_turns`, tokens by its
    caps)."""
    r = run.rollout
    searches = min(DEFAULT_SEARCHES, r.max_turns)
    prompt = min(DEFAULT_PROMPT_TOKENS, r.max_prompt_tokens)
    turn = min(DEFAULT_TURN_TOKENS, r.max_turn_tokens)
    observation = min(DEFAULT_OBSERVATION_TOKENS, r.max_observation_tokens)
    tokens = min(prompt + (searches + 1) * turn + searches * observation, r.max_context_tokens)
    return Lengths(prompt, searches + 1, (searches + 1) * turn, observation, tokens, searches, 0.0, 0.0,
                   DEFAULT_TURN_SPREAD * turn / math.sqrt(3), 0.0, 0.0, DEFAULTS_SOURCE)


def worst_case(run: RunConfig) -> Lengths:
    """The lengths the programs are compiled for: prompts of `rollout.max_prompt_tokens`, `rollout.max_turns` + 1
    turns of `rollout.max_turn_tokens`, observations of `rollout.max_observation_tokens`, every trajectory at
    `rollout.max_context_tokens` in the updates (of the run config `run`)."""
    r = run.rollout
    return Lengths(r.max_prompt_tokens, r.max_turns + 1, (r.max_turns + 1) * r.max_turn_tokens,
                   r.max_observation_tokens, r.max_context_tokens, r.max_turns, 0.0, 0.0, 0.0, 0.0, 0.0,
                   "every turn and every token cap")


RUN_KEYS = ("rollout/prompt_tokens", "rollout/turns", "rollout/sampled_tokens", "rollout/observation_tokens",
            "rollout/searches", "rollout/prompt_tokens_std", "rollout/turns_std", "rollout/turn_tokens_std",
            "rollout/observation_tokens_std", "rollout/trajectories", "perf/tokens_per_s", "perf/step_s")


def _rollout_steps(records: Sequence[Mapping[str, float]], source: str) -> list[Mapping[str, float]]:
    """The records of steps with a rollout (InputError when none)."""
    steps = [r for r in records if "rollout/trajectories" in r]
    if not steps:
        raise InputError(f"{source}: no step logged rollout/trajectories")
    return steps


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def from_metrics(records: Sequence[Mapping[str, float]], source: str) -> Lengths:
    """Mean lengths over a run's per-step metric records (metrics.jsonl's lines; steps without a rollout are
    skipped): per trajectory `rollout/prompt_tokens`, `rollout/sampled_tokens`, `rollout/searches` (the step's
    totals over `rollout/trajectories`), `rollout/turns`, an observation's `rollout/observation_tokens` over the
    trajectories' turns but their last, the spreads (`rollout/prompt_tokens_std`, `rollout/turns_std`,
    `rollout/turn_tokens_std`, `rollout/observation_tokens_std`), `perf/padding`, and the trained tokens from
    `perf/tokens_per_s` x `perf/step_s` (the batch's real tokens) over the trajectories (InputError naming a missing
    key)."""
    steps = _rollout_steps(records, source)
    missing = [k for k in RUN_KEYS if any(r.get(k) is None for r in steps)]
    if missing:
        raise InputError(f"{source}: steps without {', '.join(missing)} (a run of an older version logs fewer "
                         "metrics)")

    def per_trajectory(key):
        return _mean(r[key] / r["rollout/trajectories"] for r in steps)

    turns = _mean(r["rollout/turns"] for r in steps)
    observations = per_trajectory("rollout/observation_tokens")
    return Lengths(per_trajectory("rollout/prompt_tokens"), turns, per_trajectory("rollout/sampled_tokens"),
                   observations / (turns - 1) if turns > 1 else 0.0,
                   _mean(r["perf/tokens_per_s"] * r["perf/step_s"] / r["rollout/trajectories"] for r in steps),
                   per_trajectory("rollout/searches"),
                   *(_mean(r[f"rollout/{key}_std"] for r in steps)
                     for key in ("prompt_tokens", "turns", "turn_tokens", "observation_tokens")),
                   _mean(r.get("perf/padding", 0.0) for r in steps),
                   f"{source}: means over its {len(steps)} steps")


def logged_step_counts(records: Sequence[Mapping[str, float]], source: str) -> dict[int, tuple[float, float]]:
    """Token bucket -> (calls, batch tokens) of the paged engine's step programs per host and step, means over the
    run's steps (`rollout/step_calls_T`, `rollout/step_tokens_T`; InputError when the run logged none: a run of the
    dense engine)."""
    steps = _rollout_steps(records, source)
    buckets = sorted(int(k.rsplit("_", 1)[1]) for k in steps[0] if k.startswith("rollout/step_calls_"))
    if not buckets:
        raise InputError(f"{source}: no rollout/step_calls_T logged (not a run of the paged engine)")
    return {b: (_mean(r[f"rollout/step_calls_{b}"] for r in steps), _mean(r[f"rollout/step_tokens_{b}"] for r in steps))
            for b in buckets}


def read_records(run_dir: str) -> list[dict]:
    """The records of `run_dir`/metrics.jsonl (OSError or InputError naming the file and line)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    records = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise InputError(f"{path}, line {number}: not JSON ({e.msg})") from None
    return records


def update_share(run: RunConfig, lengths: Lengths) -> float:
    """The forwards' and updates' cost at `lengths` as a share of the worst case's (module docstring), at most 1."""
    if not run.optim.pack_trajectories:
        return 1.0
    return min(1.0, lengths.trajectory_tokens / (1 - lengths.padding) / run.rollout.max_context_tokens)
