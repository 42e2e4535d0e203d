"""What the agent loop needs from the device side.

`Engine` (`llds_jax.rollout.engine.Engine` over a paged KV cache; scripted ones in tests) is what
`llds_jax.rollout.driver` schedules conversations on. The older sampler protocol: `TurnSampler.start` opens a `SamplerSession` over a batch of prompts,
which samples one turn of every unfinished sequence at a time (`decode_turn`) and appends what the agent decided
(`end_turn`). `llds_jax.rollout.sampler.Sampler` implements them with a KV cache under jit; test doubles and
benchmark wrappers implement them in full.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Optional, Protocol


@dataclasses.dataclass(frozen=True)
class SampledTurn:
    """The tokens one row sampled in a turn, in order, with their log-probs (float32 values).

    `hit_stop` is True when the last token is one of the stop ids (it is included in token_ids).
    """

    token_ids: list[int]
    logps: list[float]
    hit_stop: bool


class SamplerSession(Protocol):
    """One batch of conversations, sequences indexed 0..n-1 in prompt order.

    Attributes:
      timing: seconds spent so far on the device: "prefill_s" (prompts and observation extends) and "decode_s"
        (decode chunks, and their dispatch).
      decode_counts: "sampled_tokens" and "row_steps" (decode steps x batch rows) so far, for the rollout's
        decode occupancy (a session without a device batch keeps both at 0).
    """

    timing: dict[str, float]
    decode_counts: dict[str, int]

    def decode_turn(self, budgets: Sequence[int], turn_finished: Callable[[list[list[int]]], list[bool]],
                    on_finished: Optional[Callable[[list[int], list[SampledTurn]], None]] = None
                    ) -> list[SampledTurn]:
        """Samples one turn of every sequence with budget > 0 (at most budgets[i] tokens; budget 0: an empty turn).

        A row stops at a stop token, at its budget, or once `turn_finished(token lists) -> flags` says its text
        holds a complete action (asked between decode chunks). `on_finished(sequences, turns)` may be called
        (on the calling thread) with rows whose turn ended while others still decode; a session may never call it.
        Returns one SampledTurn per sequence."""
        ...

    def end_turn(self, keep: Sequence[int], observations: Sequence[Optional[Sequence[int]]]) -> None:
        """Keeps the first keep[i] tokens of sequence i's last turn (the rest is rolled back) and appends
        observations[i] (token ids; None: nothing) after them."""
        ...


class TurnSampler(Protocol):
    """Opens sessions."""

    def start(self, params: Any, prompts: Sequence[Sequence[int]], rng: Any, first_sequence: int = 0
              ) -> SamplerSession:
        """A session over `prompts` (token ids each) with the policy `params`; sequence i samples from the random
        stream of global sequence id first_sequence + i (a PRNG key `rng`)."""
        ...


class Engine(Protocol):
    """Conversations in flight on a device (`llds_jax.rollout.engine` documents each call).

    Sequences are named by the caller (ints); key_data is a sequence's PRNG key data (its n-th sampled token draws
    with fold_in(key, n)); budget is how many tokens the sequence's next turn may sample (>= 1)."""

    @property
    def running(self) -> int:
        """Sequences whose turn has not ended."""
        ...

    def can_admit(self) -> bool:
        """Whether one more sequence fits now."""
        ...

    def add_request(self, seq: int, prompt_ids: Sequence[int], key_data: Any, budget: int) -> None: ...

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
