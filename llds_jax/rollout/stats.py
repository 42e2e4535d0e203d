"""What one rollout spent and ran (`RolloutStats`), counted while it runs and logged as `rollout/<name>` metrics.

The steps of the protocol (`rollout.steps.AgentSteps`) count prompts, observations and searches, the driver
(`rollout.driver`) sampled tokens, forks and the wait for searches, and the engine (`EngineCounts`) its
device calls; `RolloutStats.metrics` flattens them under the names the trainer has always logged.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional


@dataclasses.dataclass
class Spread:
    """Lengths counted one at a time (their count, sum and sum of squares), for their standard deviation."""

    count: int = 0
    total: float = 0.0
    squares: float = 0.0

    def add(self, length: int) -> None:
        self.count += 1
        self.total += length
        self.squares += length * length

    @property
    def std(self) -> float:
        """The lengths' (population) standard deviation; 0 before any."""
        if not self.count:
            return 0.0
        mean = self.total / self.count
        return math.sqrt(max(self.squares / self.count - mean * mean, 0.0))


@dataclasses.dataclass
class EngineCounts:
    """What the engine ran, per step program and in all (for the rollout's stats and the estimate's check).

    Attributes:
      calls: device calls per token bucket.
      batch_tokens: real (unpadded) tokens of the ragged batches, per token bucket (not those of dropped rows).
      sampled_tokens: tokens sampled.
      sample_slots: sequence slots x samples of every call (the decode occupancy's denominator).
      page_copies: pages copied on write.
      shared_prompt_tokens: prompt tokens a sequence took from another's pages instead of encoding them.
      device_s: seconds the device ran the engine's calls (each from its dispatch, or the end of the call before,
        to its results).
      wait_s: seconds the host waited for the device's results (one call at a time: device_s).
      preemptions: sequences whose pages were taken back for another's (re-encoded when scheduled again).
      dropped_rows: rows of a call whose samples were discarded: the turn had ended in the call before (overlap).
    """

    calls: dict[int, int] = dataclasses.field(default_factory=dict)
    batch_tokens: dict[int, int] = dataclasses.field(default_factory=dict)
    sampled_tokens: int = 0
    sample_slots: int = 0
    page_copies: int = 0
    shared_prompt_tokens: int = 0
    device_s: float = 0.0
    wait_s: float = 0.0
    preemptions: int = 0
    dropped_rows: int = 0


@dataclasses.dataclass
class RolloutStats:
    """One rollout's seconds and counts.

    Seconds: `rollout_s` (the whole rollout) = the host's wait for the engine's device calls (`counts.wait_s`)
    + `search_s` (waiting for search results with nothing to decode: retrieval on the critical path) + `host_s`
    (the rest: cutting and parsing turns, tokenizing observations, scheduling, building trajectories), while the
    device runs the calls for `decode_s` (their dispatch included; the engine overlaps the next call's dispatch
    with the host's work, so the device's seconds and the host's overlap).
    `search_calls_s` sums the retriever calls' own durations, most of them hidden behind decoding.

    Counts (tokens unless named otherwise): `sampled_tokens` (generated, rolled-back ones included), `prompt_tokens`
    (the conversations' prompts, each counted once per conversation), `prompts_cut` (prompts whose question lost its
    start to rollout.max_prompt_tokens; conversations), `observation_tokens` (appended to contexts), `searches`
    (queries sent), `bad_documents` (hits the retriever dropped: `search.types.received`), `forked_prefix_tokens`
    (tree rollouts only, else None: the turn and observation tokens each fork shares with its parent up to its node,
    sampled once and trained again in every leaf that holds them), `context_edits` and `context_reencoded_tokens`
    (edits of a context policy, `rollout.context`, and the edited contexts' tokens encoded again), the spreads
    (`Spread`: standard deviations) of a conversation's prompt tokens (`prompt_tokens_std`), a turn's sampled tokens
    (`turn_tokens_std`) and an observation's tokens (`observation_tokens_std`) within the host's batch (averaged
    over the hosts when logged), which the step estimate's schedule of one host's rollout takes
    (`llds_jax.aot.rollout_schedule`), and the engine's `counts` (device calls and batch tokens per token bucket,
    sample slots, shared prompt tokens, page copies, preemptions; `EngineCounts`).
    """

    rollout_s: float = 0.0
    search_s: float = 0.0
    search_calls_s: float = 0.0
    sampled_tokens: int = 0
    prompt_tokens: int = 0
    prompts_cut: int = 0
    observation_tokens: int = 0
    searches: int = 0
    bad_documents: int = 0
    forked_prefix_tokens: Optional[int] = None
    context_edits: int = 0
    context_reencoded_tokens: int = 0
    prompt_spread: Spread = dataclasses.field(default_factory=Spread)
    turn_spread: Spread = dataclasses.field(default_factory=Spread)
    observation_spread: Spread = dataclasses.field(default_factory=Spread)
    counts: EngineCounts = dataclasses.field(default_factory=EngineCounts)

    @property
    def decode_s(self) -> float:
        """Seconds in the engine's device calls."""
        return self.counts.device_s

    @property
    def host_s(self) -> float:
        """Seconds neither waiting for the device nor for a search (never below 0)."""
        return max(self.rollout_s - self.counts.wait_s - self.search_s, 0.0)

    @property
    def decode_occupancy(self) -> float:
        """Tokens sampled / (sequence slots x samples of every device call): the share of the step programs'
        sample slots doing real work (0 before any call)."""
        slots = self.counts.sample_slots
        return self.counts.sampled_tokens / slots if slots else 0.0

    def metrics(self, token_budgets: tuple[int, ...] = ()) -> dict[str, float]:
        """The stats as the rollout's metrics (floats): seconds, counts, the spreads' standard deviations
        (`prompt_tokens_std`, `turn_tokens_std`, `observation_tokens_std`), `sampled_tokens_per_s` (per decode
        second), `decode_occupancy`, and `step_calls_T` / `step_tokens_T` for every bucket T of `token_budgets`
        (run or not: the same keys on every host)."""
        c = self.counts
        out = {"rollout_s": self.rollout_s, "decode_s": self.decode_s, "search_s": self.search_s,
               "search_calls_s": self.search_calls_s, "host_s": self.host_s,
               "sampled_tokens": float(self.sampled_tokens), "prompt_tokens": float(self.prompt_tokens),
               "prompts_cut": float(self.prompts_cut), "observation_tokens": float(self.observation_tokens),
               "searches": float(self.searches), "prompt_tokens_std": self.prompt_spread.std,
               "turn_tokens_std": self.turn_spread.std, "observation_tokens_std": self.observation_spread.std,
               "bad_documents": float(self.bad_documents),
               "sampled_tokens_per_s": self.sampled_tokens / max(self.decode_s, 1e-9),
               "decode_occupancy": self.decode_occupancy,
               "shared_prompt_tokens": float(c.shared_prompt_tokens), "page_copies": float(c.page_copies),
               "preemptions": float(c.preemptions), "context_edits": float(self.context_edits),
               "context_reencoded_tokens": float(self.context_reencoded_tokens)}
        if self.forked_prefix_tokens is not None:
            out["forked_prefix_tokens"] = float(self.forked_prefix_tokens)
        for bucket in token_budgets:
            out[f"step_calls_{bucket}"] = float(c.calls.get(bucket, 0))
            out[f"step_tokens_{bucket}"] = float(c.batch_tokens.get(bucket, 0))
        return out
