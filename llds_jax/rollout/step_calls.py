"""What the rollout engine (`llds_jax.rollout.engine`) and its device side exchange: a step's ragged batch and what
it sampled, the runner protocols (one call at a time, or a call dispatched while the one before runs) and the
engine's static shapes. The runner of the model is `llds_jax.rollout.runner.DeviceRunner`; tests and the step
estimate's schedule run scripted ones (`Immediate`).

The host beside the device (the engine overlaps where the runner is an `OverlappingRunner`, e.g.
`runner.DeviceRunner`). Each `Engine.step()` schedules and dispatches call n + 1 while call n runs, then fetches and
absorbs n, and returns n's ended turns; the caller's work on them (closing turns, searches, extends, admissions) runs
while n + 1 does. Call n + 1 is scheduled as if every sequence sampling in n samples all its tokens and goes on
(`Engine._commit`: its samples PENDING on the host; its next batch token is the last of them, which the step program
takes from n's outputs on the device, `StepBatch.source_s`); a sequence whose turn reaches its budget in n is not
scheduled in n + 1. When n is absorbed, a turn that ended in it (a stop id, or a stop string) gets its host state back
as of its end, its pages past its context back, and its row of n + 1 dropped: its samples there are never taken, and
what n + 1 writes in those pages lies past every context that reads them (the device runs the calls in order: a page
given back is written by a later call only after n + 1). Sequences enter, are extended or finish between the calls (an
ended turn has no row in flight; a finished sequence's row is dropped) and join the next call scheduled. With a call
in flight nothing is preempted: where a decoding sequence lacks pages, no call is dispatched until n is absorbed. The
first step only dispatches (returns []). A runner of `run` only (scripted ones; `overlap=False`) runs one call at a
time.

Dimension letters (docs/architecture.md, "Dimension letters"): S sequence slots of a step, T tokens of a step's
ragged batch, C samples of one call, M pages per sequence.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Protocol

import numpy as np

from llds_jax.config.sections import pool_pages

@dataclasses.dataclass(frozen=True)
class StepBatch:
    """The host arrays of one step (padding: token slot -1, sequence rows past `num_seqs`).

    Attributes:
      tokens_t: int32 [T] the ragged batch's tokens, sequence by sequence (a sequence's are its last ones: token i
        of a sequence with q tokens sits at position kv_len - q + i, its RoPE position and its slot in its pages).
      cu_q_lens_s: int32 [S + 1] where each sequence's tokens start in the batch (and end: cu_q_lens[S]).
      kv_lens_s: int32 [S] each sequence's length once its tokens are written.
      page_table_sm: int32 [S, M] each sequence's pages.
      num_seqs: sequences in the batch (the rest of the S rows is padding).
      samples_s: int32 [S] tokens each sequence samples in this call (0: its input is not all in, or padding);
        at most C, the first from the logits of its last batch token, the others each from the logits of the
        token sampled before it.
      key_data_s: uint32 [S, 2] each sequence's PRNG key data.
      count_s: int32 [S] tokens each sequence sampled before this call (the n of fold_in(key, n)).
      page_copies: int32 [max_copies, 2] (source, target) pages to copy before the batch is written ([0, 0]: none).
      decode_chunk: C.
      source_s: int32 [S] where each sequence's batch token is known (-1: tokens_t holds it; r >= 0: it is the last
        token row r sampled in the call before, still on the device: tokens_t holds 0 there, and the sequence's
        only batch token is that one).
    """

    tokens_t: np.ndarray
    cu_q_lens_s: np.ndarray
    kv_lens_s: np.ndarray
    page_table_sm: np.ndarray
    num_seqs: int
    samples_s: np.ndarray
    key_data_s: np.ndarray
    count_s: np.ndarray
    page_copies: np.ndarray
    decode_chunk: int
    source_s: np.ndarray

    def resolved(self, previous: Optional[StepResult]) -> StepBatch:
        """The batch with every token in tokens_t: those of `source_s` taken from `previous` (the call before's
        result; None: the batch has none of them)."""
        rows = np.flatnonzero(self.source_s[:self.num_seqs] >= 0)
        if not len(rows):
            return self
        tokens_t, source = self.tokens_t.copy(), self.source_s[rows]
        tokens_t[self.cu_q_lens_s[rows]] = previous.tokens_sc[source, previous.n_s[source] - 1]
        return dataclasses.replace(self, tokens_t=tokens_t, source_s=np.full_like(self.source_s, -1))


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What one step sampled: tokens_sc int32 [S, C] and logps_sc float32 [S, C] (the first n_s[s] of row s are
    real), n_s int32 [S] (fewer than samples_s where a stop id was sampled: it is the last one); ready_s: when the
    device had them (`time.perf_counter` seconds; None: when the runner returned them)."""

    tokens_sc: np.ndarray
    logps_sc: np.ndarray
    n_s: np.ndarray
    ready_s: Optional[float] = None


class StepRunner(Protocol):
    """The device side of the engine, one call at a time."""

    def run(self, params: Any, batch: StepBatch) -> StepResult:
        """Writes the batch's K/V into the pool, attends over each sequence's pages and samples (`batch.source_s`
        is all -1)."""
        ...


class OverlappingRunner(Protocol):
    """The device side of the engine, a call dispatched while the one before runs (the engine overlaps)."""

    def dispatch(self, params: Any, batch: StepBatch, previous: Any) -> Any:
        """Starts the step (after every call dispatched before it); returns its handle. `previous`: the handle of
        the call dispatched just before (None: none), whose samples `batch.source_s` names."""
        ...

    def fetch(self, handle: Any) -> StepResult:
        """The call's samples (waits for the device)."""
        ...


class Immediate:
    """An `OverlappingRunner` of a `run` that answers at once (scripted runners): dispatch resolves the batch's
    tokens from the previous result (`StepBatch.resolved`) and runs it."""

    def dispatch(self, params: Any, batch: StepBatch, previous: Optional[StepResult]) -> StepResult:
        return self.run(params, batch.resolved(previous))

    def fetch(self, handle: StepResult) -> StepResult:
        return handle


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """The engine's static shapes and decoding rules.

    Attributes:
      max_seqs: sequence slots of a step (S): the most sequences in flight.
      token_budgets: the token buckets of a step's ragged batch (T), ascending; the largest bounds a step, and is
        at least max_seqs (every decoding sequence's pending token fits).
      decode_chunk: samples per call of a decoding sequence (C).
      page_size: token slots per page.
      num_pages: pages in the pool, the padding page included; at least one sequence's at max_context.
      max_context: the most tokens one sequence holds (its page table's P = max_context / page_size).
      stop_ids: token ids that end a turn (sampled, returned with the turn, never written to the cache).
    """

    max_seqs: int
    token_budgets: tuple[int, ...]
    decode_chunk: int
    page_size: int
    num_pages: int
    max_context: int
    stop_ids: tuple[int, ...] = ()

    @property
    def pages_per_seq(self) -> int:
        return -(-self.max_context // self.page_size)

    @property
    def max_copies(self) -> int:
        """Page copies one step can make: one per sequence (the page its write starts in)."""
        return self.max_seqs

    def __post_init__(self):
        if list(self.token_budgets) != sorted(set(self.token_budgets)) or self.token_budgets[-1] < self.max_seqs:
            raise ValueError(f"EngineConfig: token_budgets {self.token_budgets} must ascend and reach max_seqs "
                             f"{self.max_seqs}")
        if pool_pages(1, self.max_context, self.page_size) > self.num_pages:
            raise ValueError(f"EngineConfig: num_pages {self.num_pages} cannot hold one sequence of max_context "
                             f"{self.max_context}: it needs {self.pages_per_seq + 1} ({self.pages_per_seq} pages of "
                             f"{self.page_size} slots and the padding page)")
