"""What the agent loop needs from the device side.

`Engine` (`llds_jax.rollout.engine.Engine` over a paged KV cache; scripted ones in tests) is what
`llds_jax.rollout.driver` schedules conversations on; an `EngineSource` (`llds_jax.rollout.paged_sampler.
PagedSampler`, which holds a run's page pool and step programs) opens one per rollout.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Optional, Protocol

from llds_jax.rollout.stats import EngineCounts


@dataclasses.dataclass(frozen=True)
class SampledTurn:
    """The tokens one row sampled in a turn, in order, with their log-probs (float32 values).

    `hit_stop` is True when the last token is one of the stop ids (it is included in token_ids).
    """

    token_ids: list[int]
    logps: list[float]
    hit_stop: bool


class Engine(Protocol):
    """Conversations in flight on a device (`llds_jax.rollout.engine` documents each call).

    Sequences are named by the caller (ints); key_data is a sequence's PRNG key data (its n-th sampled token draws
    with fold_in(key, n)); budget is how many tokens the sequence's next turn may sample (>= 1). `counts`: what it
    ran so far (device calls, sampled tokens and slots; a scripted engine may leave them at 0)."""

    counts: EngineCounts

    @property
    def running(self) -> int:
        """Sequences whose turn has not ended."""
        ...

    def can_admit(self, context_tokens: int) -> bool:
        """Whether one more sequence, of `context_tokens` tokens to encode, may enter now."""
        ...

    def add_request(self, seq: int, prompt_ids: Sequence[int], key_data: Any, budget: int, sampled: int = 0) -> None:
        """A new sequence of context `prompt_ids`; `sampled`: tokens it sampled before (its PRNG stream goes on at
        fold_in(key, sampled): a conversation resumed from its tokens, its KV recomputed)."""
        ...

    def extend(self, seq: int, keep: int, observation_ids: Sequence[int], budget: int) -> None:
        """After seq's turn ended: keep its first `keep` tokens, append the observation, start the next turn."""
        ...

    def fork(self, seq: int, source: int, at_turn: int, key_data: Any, budget: int) -> None:
        """A new sequence whose context is `source`'s at the start of its turn `at_turn`."""
        ...

    def finish(self, seq: int) -> None: ...

    def step(self) -> list[tuple[int, SampledTurn]]:
        """One device call; the (sequence, turn) of every turn that ended in it."""
        ...

    def update_params(self, params: Any) -> None: ...


class StopMatcher(Protocol):
    """Whether a turn's text holds a stop string, fed each turn's new tokens only
    (`llds_jax.rollout.stop_strings.StopMatcher`)."""

    def reset(self, seq: int) -> None: ...

    def forget(self, seq: int) -> None: ...

    def push_many(self, seqs: Sequence[int], new_ids: Sequence[Sequence[int]]) -> list[bool]: ...


class EngineSource(Protocol):
    """Opens a rollout's engine.

    Attributes:
      token_budgets: the token buckets of the engine's step programs (the rollout's stats count calls and tokens
        per bucket; () for an engine without them).
    """

    token_budgets: tuple[int, ...]

    def engine(self, params: Any, stop_matcher: Optional[StopMatcher] = None) -> Engine:
        """An empty engine (every slot and page free) that samples with the policy `params` and ends a turn once
        `stop_matcher` finds a stop string in its text."""
        ...
