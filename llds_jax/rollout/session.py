"""A turn-synchronous session: one batch of conversations in the KV cache, every sequence sampling its turn at
once (`Session.decode_turn`), then rolled back and extended by its observation (`Session.end_turn`); and what it
shares with continuous batching's `row_session.RowSession` (`DeviceBatch`: the decode state on device, its growth,
the decode chunk calls and their timing). Opened by `llds_jax.rollout.sampler.Sampler.start`, whose programs it
calls.

`Session.timing` accumulates seconds: `prefill_s` (prompt prefill and observation extends, each waited for once
per turn), `decode_s` (decode chunk calls and the wait for their tokens) and `host_s` (the host callbacks between
chunks). No wait is added inside the decode loop: it fetches each chunk's tokens anyway. `Session.decode_counts`
counts the sampled tokens and the decode steps x batch rows (their ratio: the decode occupancy).
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import ContextManager, Optional, Protocol

import jax
import numpy as np

from llds_jax.rollout.config import SamplingConfig
from llds_jax.rollout.interfaces import SampledTurn
from llds_jax.rollout.kernels import DecodeState
from llds_jax.rollout.shape_plan import ShapePlan


class SessionPrograms(Protocol):
    """What a session calls of the sampler that opened it (`llds_jax.rollout.sampler.Sampler`): its config, the plan
    of its shapes, the placement of host arrays and its device programs (`kernels`, jitted)."""

    config: SamplingConfig
    plan: ShapePlan

    def mesh_context(self) -> ContextManager: ...

    def put(self, array: np.ndarray) -> jax.Array: ...

    def prefill(self, params, tokens_bt: np.ndarray, valid_bt: np.ndarray, rng: jax.Array, seq_ids_b: np.ndarray,
                capacity: int, source_b: Optional[np.ndarray] = None) -> DecodeState: ...

    def decode_chunk(self, params, state: DecodeState, stop_b: np.ndarray
                     ) -> tuple[DecodeState, jax.Array, jax.Array, jax.Array]: ...

    def end_turn(self, params, state: DecodeState, end_b: np.ndarray, next_pos_b: np.ndarray, obs_bt: np.ndarray,
                 obs_valid_bt: np.ndarray) -> DecodeState: ...

    def empty(self, params, rng: jax.Array, rows: int, capacity: int) -> DecodeState: ...

    def extend_rows(self, params, state: DecodeState, rows_k: np.ndarray, end_k: np.ndarray, next_pos_k: np.ndarray,
                    tokens_kt: np.ndarray, valid_kt: np.ndarray, key_data_k: np.ndarray, prefill: bool
                    ) -> DecodeState: ...

    def grow(self, state: DecodeState, capacity: int) -> DecodeState: ...

    def select_rows(self, state: DecodeState, rows_b: np.ndarray) -> DecodeState: ...

    def fork(self, params, state: DecodeState, source_k: np.ndarray, end_k: np.ndarray, next_pos_k: np.ndarray,
             tokens_k: np.ndarray, valid_k: np.ndarray, key_data_k: np.ndarray) -> DecodeState: ...


def left_padded(prompts: Sequence[Sequence[int]], rows: int, slots: int) -> tuple[np.ndarray, np.ndarray]:
    """Prompts left-padded into int32 tokens and bool valid [rows, slots]; rows past the prompts hold one token, so
    that attention never sees an empty row."""
    tokens_bt = np.zeros((rows, slots), np.int32)
    valid_bt = np.zeros((rows, slots), bool)
    valid_bt[len(prompts):, -1] = True
    for i, prompt in enumerate(prompts):
        tokens_bt[i, slots - len(prompt):] = prompt
        valid_bt[i, slots - len(prompt):] = True
    return tokens_bt, valid_bt


class DeviceBatch:
    """What both kinds of session share: the decode state of a batch of rows on device, its growth, the decode
    chunk calls with their timing, and the count of decode-row occupancy.

    Attributes:
      timing: seconds, see the module docstring.
      decode_counts: "sampled_tokens" (tokens the rows sampled) and "row_steps" (decode steps run x batch rows);
        their ratio is the decode occupancy, the share of decode rows doing real work.
    """

    def __init__(self, sampler: SessionPrograms, params, prompts: Sequence[Sequence[int]]):
        if not prompts:
            raise ValueError("Session: no prompts")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("Session: every prompt needs at least one token")
        self._sampler = sampler
        self._cfg = sampler.config
        self._params = params
        self._prompts = [list(map(int, p)) for p in prompts]
        self._state: Optional[DecodeState] = None
        self.timing = {"prefill_s": 0.0, "decode_s": 0.0, "host_s": 0.0}
        self.decode_counts = {"sampled_tokens": 0, "row_steps": 0}

    @property
    def num_sequences(self) -> int:
        return len(self._prompts)

    @property
    def capacity(self) -> int:
        """Cache slots per row, 0 before the first turn."""
        return 0 if self._state is None else self._state.cache.capacity

    def _rows(self) -> int:
        return 0 if self._state is None else self._state.done_b.shape[0]

    def _ensure_capacity(self, needed: int) -> None:
        """Grows the cache, to the capacity the plan gives, when a row needs more than its `capacity` slots."""
        grown = self._sampler.plan.grown_capacity(self._rows(), self.capacity, needed)
        if grown > self.capacity:
            self._state = self._sampler.grow(self._state, grown)

    def _decode_chunk(self, stop_b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """One decode chunk call (stop_b: bool [B], rows the host finished); returns its tokens, log-probs and
        emitted flags [B, C] and the rows done after it [B], on the host. Counts decode_s and decode_counts."""
        start = time.perf_counter()
        self._state, tokens_bc, logp_bc, emitted_bc = self._sampler.decode_chunk(self._params, self._state, stop_b)
        tokens_bc, logp_bc, emitted_bc, done_b = jax.device_get((tokens_bc, logp_bc, emitted_bc, self._state.done_b))
        self.timing["decode_s"] += time.perf_counter() - start
        # Every step that ran emitted a token on some row (the loop stops once all rows are done).
        self.decode_counts["sampled_tokens"] += int(emitted_bc.sum())
        self.decode_counts["row_steps"] += int(emitted_bc.any(axis=0).sum()) * emitted_bc.shape[0]
        return tokens_bc, logp_bc, emitted_bc, done_b



class Session(DeviceBatch):
    """One batch of conversations in the KV cache. Sequences are indexed 0..n-1 in `prompts` order; sequence i
    samples with the global id first_sequence + i, or sequence_ids[i] when given (see `Sampler.start`).

    `compact` False keeps every sequence in its row until the session ends (no compaction), so that `fork` can copy
    any of them. `turn_starts[i]` lists, for each turn sequence i sampled, (cache end, next position, last token) at
    its start: the agent-step boundaries a tree rollout forks from (`fork`).
    """

    def __init__(self, sampler: SessionPrograms, params, prompts: Sequence[Sequence[int]], rng: jax.Array,
                 first_sequence: int = 0, sequence_ids: Optional[Sequence[int]] = None, compact: bool = True):
        super().__init__(sampler, params, prompts)
        if first_sequence < 0:
            raise ValueError(f"Session: first_sequence must be >= 0, got {first_sequence}")
        if not jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key):
            rng = jax.random.wrap_key_data(rng)
        self._rng = rng
        n = len(prompts)
        self._ids = (np.arange(first_sequence, first_sequence + n, dtype=np.uint32) if sequence_ids is None
                     else np.asarray(sequence_ids, np.uint32))
        if self._ids.shape != (n,):
            raise ValueError(f"Session: need {n} sequence ids, got {len(self._ids)}")
        self._compact_rows = compact
        self.turn_starts: list[list[tuple[int, int, int]]] = [[] for _ in range(n)]
        self._last_token = np.array([p[-1] for p in self._prompts], np.int64)  # the token before each one's end
        self._alive = np.ones(n, bool)
        # Host mirrors, per sequence: the cache slot the sequence writes to next and its next RoPE position.
        self._end = np.zeros(n, np.int64)
        self._pos = np.array([len(p) for p in self._prompts], np.int64)
        self._turn_start_end = np.zeros(n, np.int64)
        self._turn_start_pos = np.zeros(n, np.int64)
        self._slot_of = np.full(n, -1, np.int64)  # the batch row holding each sequence (-1: none)
        self._seq_of: np.ndarray = np.zeros(0, np.int64)  # the sequence in each batch row (-1: padding)

    @property
    def batch_rows(self) -> int:
        """Rows of the device batch (a bucket), 0 before the first turn."""
        return len(self._seq_of)

    def decode_turn(self, budgets: Sequence[int],
                    turn_finished: Callable[[list[list[int]]], list[bool]],
                    on_finished: Optional[Callable[[list[int], list[SampledTurn]], None]] = None
                    ) -> list[SampledTurn]:
        """Samples one turn for every sequence with budget > 0 (at most budgets[i] tokens each).

        A row stops at a stop token, at its budget, or once `turn_finished` (called between decode chunks with
        the token lists of the rows still sampling) says its turn is over; tokens of the chunk in which that
        happens come back too (the caller cuts them). Finished sequences must get budget 0.
        `on_finished(sequences, turns)`, when given, is called after each decode chunk in which some sequences'
        turns ended, with those sequences (ascending) and their final SampledTurns, while the other rows go on
        decoding; every sequence with budget > 0 is reported exactly once.
        Returns one SampledTurn per sequence (empty for budget 0).
        """
        budgets_n = np.asarray(budgets, np.int64)
        if budgets_n.shape != (self.num_sequences,) or (budgets_n < 0).any():
            raise ValueError(f"decode_turn: need {self.num_sequences} budgets >= 0, got {list(budgets)}")
        if (budgets_n[~self._alive] > 0).any():
            raise ValueError("decode_turn: a finished sequence was given a budget > 0")
        turns = [SampledTurn([], [], False) for _ in range(self.num_sequences)]
        with self._sampler.mesh_context():
            if budgets_n.any():
                self._start(int(budgets_n.max()))
                self._compact()
                # + 1: a row that is done still writes one (invalid) slot per decode step at its end.
                self._ensure_capacity(int(np.max(self._end + budgets_n + 1)))
            self._turn_start_end, self._turn_start_pos = self._end.copy(), self._pos.copy()
            for seq in np.flatnonzero(budgets_n):
                self.turn_starts[seq].append((int(self._end[seq]), int(self._pos[seq]), int(self._last_token[seq])))
            if budgets_n.any():
                self._run_turn(budgets_n, turn_finished, on_finished, turns)
        return turns

    def end_turn(self, keep: Sequence[int], observations: Sequence[Optional[Sequence[int]]]) -> None:
        """Keeps the first keep[i] tokens of sequence i's last turn and appends observations[i] after them.

        Sampled tokens after the kept ones are rolled back (their cache slots become invalid and are
        rewritten). observations[i] None finishes sequence i (it leaves the batch); otherwise it must hold at
        least one token, whose logits give the next turn's first token.
        """
        n = self.num_sequences
        keep_n = np.asarray(keep, np.int64)
        sampled_n = self._end - self._turn_start_end
        if keep_n.shape != (n,) or len(observations) != n:
            raise ValueError(f"end_turn: need {n} keep counts and {n} observations")
        if (keep_n < 0).any() or (keep_n > sampled_n).any():
            raise ValueError(f"end_turn: keep must be in [0, sampled tokens]; keep={keep_n.tolist()}, sampled="
                             f"{sampled_n.tolist()}")
        for i, obs in enumerate(observations):
            if obs is None:
                self._alive[i] = False
            elif not self._alive[i]:
                raise ValueError(f"end_turn: sequence {i} is finished and cannot take an observation")
            elif not len(obs):
                raise ValueError(f"end_turn: sequence {i} continues with an empty observation (give None to "
                                 "finish it)")
        self._end, self._pos = self._turn_start_end + keep_n, self._turn_start_pos + keep_n
        obs_len = np.array([len(o) if o is not None else 0 for o in observations], np.int64)
        if not obs_len.any():
            return
        with self._sampler.mesh_context():
            self._start(0)
            rows, end = self.batch_rows, int(self._end[obs_len > 0].max())
            t = self._sampler.plan.end_turn(rows, self.capacity, int(obs_len.max()), end).observation
            self._ensure_capacity(end + t)
            obs_bt = np.zeros((rows, t), np.int32)
            valid_bt = np.zeros((rows, t), bool)
            end_b = np.zeros(rows, np.int32)
            pos_b = np.zeros(rows, np.int32)
            for row, seq in enumerate(self._seq_of):
                if seq < 0:
                    continue
                end_b[row], pos_b[row] = self._end[seq], self._pos[seq]
                if obs_len[seq]:
                    obs_bt[row, :obs_len[seq]] = observations[seq]
                    valid_bt[row, :obs_len[seq]] = True
            start = time.perf_counter()
            self._state = self._sampler.end_turn(self._params, self._state, end_b, pos_b, obs_bt, valid_bt)
            self._state.logits_bv.block_until_ready()  # once per turn: times the extend apart from decoding
            self.timing["prefill_s"] += time.perf_counter() - start
        self._end += obs_len
        self._pos += obs_len
        for seq in np.flatnonzero(obs_len):
            self._last_token[seq] = observations[seq][-1]

    def fork(self, nodes: Sequence[tuple[int, int]], keys_k: jax.Array, carry: bool = False,
             compact: bool = True) -> "Session":
        """A session of new sequences, one per node (s, k): a copy of sequence s as it stood at the start of its
        turn k (k < len(turn_starts[s])), taken from its cache rows on device (`kernels.fork_rows`: never a
        re-encode), which samples turn k afresh from the PRNG key keys_k[j] (its count from 0).

        With `carry`, this session's sequences come first in the new one, as they are (every one must be finished):
        a tree rollout keeps them for later forks. The sequences forked must still hold their rows: open the
        session with compact=False. `compact`: the new session's (see the class docstring).
        """
        if self._state is None:
            raise ValueError("fork: the session has not started")
        if carry and self._alive.any():
            raise ValueError(f"fork: sequences {np.flatnonzero(self._alive).tolist()} are unfinished and cannot be "
                             "carried")
        for s, k in nodes:
            if not 0 <= k < len(self.turn_starts[s]):
                raise ValueError(f"fork: sequence {s} sampled {len(self.turn_starts[s])} turns; no turn {k} to fork")
            if self._slot_of[s] < 0:
                raise ValueError(f"fork: sequence {s} left the batch (compaction): open the session with "
                                 "compact=False")
        carried = list(range(self.num_sequences)) if carry else []
        seqs = carried + [s for s, _ in nodes]
        n, rows = len(seqs), self._sampler.plan.batch_rows(len(seqs))
        source_k = np.full(rows, self._slot_of[seqs[0]], np.int32)
        end_k = np.full(rows, self._end[seqs[0]], np.int32)
        pos_k = np.full(rows, self._pos[seqs[0]], np.int32)
        tokens_k, valid_k = np.zeros(rows, np.int32), np.zeros(rows, bool)
        source_k[:n] = self._slot_of[seqs]
        end_k[:len(carried)], pos_k[:len(carried)] = self._end[carried], self._pos[carried]
        for j, (s, k) in enumerate(nodes, start=len(carried)):
            end_k[j], pos_k[j], tokens_k[j] = self.turn_starts[s][k]
            valid_k[j] = True
        key_data = np.asarray(jax.random.key_data(keys_k))
        key_data_k = np.zeros((rows, *key_data.shape[1:]), key_data.dtype)
        key_data_k[len(carried):n] = key_data
        child = Session(self._sampler, self._params, [self._prompts[s] for s in seqs], self._rng, compact=compact)
        with self._sampler.mesh_context():
            start = time.perf_counter()
            child._state = self._sampler.fork(self._params, self._state, source_k, end_k, pos_k, tokens_k, valid_k,
                                              key_data_k)
            child._state.logits_bv.block_until_ready()  # once per fork: times it apart from decoding
            child.timing["prefill_s"] += time.perf_counter() - start
        child._seq_of = np.concatenate([np.arange(n), np.full(rows - n, -1)])
        child._slot_of = np.arange(n)
        child._end, child._pos = end_k[:n].astype(np.int64), pos_k[:n].astype(np.int64)
        child._alive[:len(carried)] = False
        child.turn_starts = ([list(self.turn_starts[s]) for s in carried]
                             + [self.turn_starts[s][:k] for s, k in nodes])
        child._last_token = np.concatenate([self._last_token[carried], tokens_k[len(carried):n]]).astype(np.int64)
        return child

    # -- internals -------------------------------------------------------------------------------------------

    def _start(self, max_budget: int) -> None:
        """Encodes the prompts (once), into a cache with room for a first turn of `max_budget` tokens."""
        if self._state is not None:
            return
        n = self.num_sequences
        distinct: dict[tuple[int, ...], int] = {}  # prompt -> its index among the distinct ones
        source = ([distinct.setdefault(tuple(prompt), len(distinct)) for prompt in self._prompts]
                  if self._cfg.shared_prompt_prefill else [])
        shape = self._sampler.plan.prefill(n, max(len(x) for x in self._prompts), max_budget, len(distinct))
        rows, p = shape.rows, shape.prompt
        # padding rows: ids past the largest (their samples are never read)
        seq_ids_b = np.concatenate([self._ids, self._ids.max() + 1 + np.arange(rows - n, dtype=np.uint32)])
        if shape.distinct:  # padding rows take the first prompt
            tokens_bt, valid_bt = left_padded(list(distinct), shape.distinct, p)
            source_b = np.zeros(rows, np.int32)
            source_b[:n] = source
        else:
            tokens_bt, valid_bt = left_padded(self._prompts, rows, p)
            source_b = None
        start = time.perf_counter()
        self._state = self._sampler.prefill(self._params, tokens_bt, valid_bt, self._rng, seq_ids_b, shape.capacity,
                                            source_b)
        self._state.logits_bv.block_until_ready()  # once per session: times the prefill apart from decoding
        self.timing["prefill_s"] += time.perf_counter() - start
        self._seq_of = np.concatenate([np.arange(n), np.full(rows - n, -1)])
        self._slot_of = np.arange(n)
        self._end[:] = p

    def _compact(self) -> None:
        """Moves the unfinished sequences into a smaller batch bucket when the plan has one for them."""
        live = np.flatnonzero(self._alive)
        compaction = (self._sampler.plan.compaction(self.batch_rows, self.capacity, len(live)) if self._compact_rows
                      else None)
        if compaction is None:
            return
        rows = compaction.rows_out
        take = np.concatenate([self._slot_of[live], np.full(rows - len(live), self._slot_of[live[0]])])
        self._state = self._sampler.select_rows(self._state, take.astype(np.int32))
        self._seq_of = np.concatenate([live, np.full(rows - len(live), -1)])
        self._slot_of[:] = -1
        self._slot_of[live] = np.arange(len(live))

    def _row_array(self, per_sequence: np.ndarray, dtype) -> np.ndarray:
        out = np.zeros(len(self._seq_of), dtype)
        real = self._seq_of >= 0
        out[real] = per_sequence[self._seq_of[real]]
        return out

    def _run_turn(self, budgets_n: np.ndarray, turn_finished, on_finished, turns: list[SampledTurn]) -> None:
        put = self._sampler.put
        stop_set = set(self._cfg.stop_ids)
        remaining_b = self._row_array(budgets_n, np.int32)
        self._state = self._state.replace(remaining_b=put(remaining_b), done_b=put(remaining_b <= 0))
        rows = len(self._seq_of)
        running_b = remaining_b > 0  # host view: rows still sampling this turn
        stop_b = np.zeros(rows, bool)
        while running_b.any():
            tokens_bc, logp_bc, emitted_bc, done_b = self._decode_chunk(stop_b)
            host_start = time.perf_counter()
            for row in np.flatnonzero(emitted_bc.any(axis=1)):
                turn = turns[self._seq_of[row]]
                emitted = emitted_bc[row]
                turn.token_ids.extend(tokens_bc[row, emitted].tolist())
                turn.logps.extend(logp_bc[row, emitted].tolist())
            ended_b = running_b & done_b
            running_b &= ~done_b
            check = np.flatnonzero(running_b)
            stop_b = np.zeros(rows, bool)
            if check.size:
                finished = turn_finished([turns[self._seq_of[row]].token_ids for row in check])
                stop_b[check[np.asarray(finished, bool)]] = True
                running_b &= ~stop_b
            ended = np.sort(self._seq_of[ended_b | stop_b])
            for seq in ended:
                turns[seq] = with_hit_stop(turns[seq], stop_set)
            if on_finished is not None and ended.size:
                on_finished(ended.tolist(), [turns[seq] for seq in ended])
            self.timing["host_s"] += time.perf_counter() - host_start
        for seq, turn in enumerate(turns):
            n_tok = len(turn.token_ids)
            self._end[seq] += n_tok
            self._pos[seq] += n_tok
            turns[seq] = with_hit_stop(turn, stop_set)



def with_hit_stop(turn: SampledTurn, stop_ids: set[int]) -> SampledTurn:
    """The turn with `hit_stop` set when its last token is a stop id."""
    if turn.token_ids and turn.token_ids[-1] in stop_ids and not turn.hit_stop:
        return dataclasses.replace(turn, hit_stop=True)
    return turn
