"""Continuous batching's session (`RowSession`): a device batch of rows that sequences enter and leave between any
two decode chunks, each row on its own turn, opened by `llds_jax.rollout.sampler.Sampler.start_rows` and driven by
`llds_jax.rollout.continuous`. Its `extend` rolls back and extends just some rows (observations), or empties them
and encodes new prompts there, in calls of `kernels.extend_rows` (the rows gathered into a smaller batch, extended,
scattered back; the other rows untouched). The host keeps one mirror of every row (`RowState`).

Dimension letters: B rows, K rows of one extend call, C decode steps of one chunk, T tokens.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from llds_jax.rollout import buckets
from llds_jax.rollout.interfaces import SampledTurn
from llds_jax.rollout.session import DeviceBatch, SessionPrograms, with_hit_stop


@dataclasses.dataclass
class RowState:
    """The host's mirror of a continuous batch, one entry per row (int64 [B], `decoding_b` bool [B]).

    Attributes:
      seq_b: the sequence the row holds (-1: free).
      end_b: the cache slot it writes to next.
      pos_b: its next RoPE position.
      turn_end_b: `end_b` when its current turn started (the roll back's origin).
      turn_pos_b: `pos_b` when its current turn started.
      remaining_b: tokens it may still sample in this turn.
      decoding_b: it samples in this turn.
    """

    seq_b: np.ndarray
    end_b: np.ndarray
    pos_b: np.ndarray
    turn_end_b: np.ndarray
    turn_pos_b: np.ndarray
    remaining_b: np.ndarray
    decoding_b: np.ndarray

    @classmethod
    def free(cls, rows: int) -> RowState:
        """`rows` free rows."""
        zeros = lambda: np.zeros(rows, np.int64)  # noqa: E731
        return cls(np.full(rows, -1, np.int64), zeros(), zeros(), zeros(), zeros(), zeros(), np.zeros(rows, bool))

    def take(self, rows_b: np.ndarray) -> RowState:
        """The mirror of rows `rows_b` (int [B'], any rows, repeated or not), every field taken alike."""
        return RowState(*(getattr(self, field.name)[rows_b] for field in dataclasses.fields(self)))


class RowSession(DeviceBatch):
    """Continuous batching: a device batch of `rows` rows that sequences enter and leave between any two decode
    chunks, each row on its own turn. Sequences are indexed 0..n-1 in `prompts` order; sequence i samples its n-th
    token with fold_in(key_i, n), key_i = keys_n[i] (see `Sampler.sequence_keys`), whichever row it
    takes: the tokens a sequence samples do not depend on when or where it runs.

    The caller drives it between chunks: `extend` (observations after rolled-back turns, and new sequences'
    prompts, one device call over just those rows), `finish` (a sequence leaves its row), `begin_turn` (a sequence
    samples its next turn), `decode_chunk` (one chunk of every row on its turn; rows that are not are done in it)
    and `compact` (once no sequence waits for a row: the live rows into a smaller row bucket, a power of two or
    1.5x one: `ShapePlan.compacted_rows`).

    Args:
      sampler: the Sampler that opens it.
      params: the policy parameters.
      prompts: token ids of each sequence.
      keys_n: PRNG keys [n], each sequence's stream.
      rows: sequences at a time (the batch is bucketed as the plan says).
      first_turn: the longest first turn, for the first cache capacity.
    """

    def __init__(self, sampler: SessionPrograms, params, prompts: Sequence[Sequence[int]], keys_n: jax.Array, rows: int,
                 first_turn: int):
        super().__init__(sampler, params, prompts)
        if keys_n.shape != (self.num_sequences,):
            raise ValueError(f"RowSession: need {self.num_sequences} keys, got shape {keys_n.shape}")
        self._rng = keys_n[0]  # the empty batch's placeholder keys
        self._key_data_n = np.asarray(jax.random.key_data(keys_n))
        self._first_turn = first_turn
        self._slot_of = np.full(self.num_sequences, -1, np.int64)  # the row of each sequence (-1: none)
        self._batch = min(rows, self.num_sequences)
        self._host = RowState.free(0)  # the host's mirror of each row, set for every row by `_start`
        self._turn: list[SampledTurn] = []  # each row's current turn, likewise

    @property
    def batch_rows(self) -> int:
        """Rows of the device batch (a bucket), 0 before the first extend."""
        return len(self._host.seq_b)

    @property
    def free_rows(self) -> int:
        """Rows that can take a sequence now (all `rows` before the first extend)."""
        return int((self._host.seq_b < 0).sum()) if self._state is not None else self._batch

    @property
    def decoding(self) -> int:
        """Rows on their turn."""
        return int(self._host.decoding_b.sum())

    def finish(self, seq: int) -> None:
        """Sequence `seq` is over: its row is free."""
        row = self._row(seq)
        self._host.seq_b[row], self._slot_of[seq], self._host.decoding_b[row] = -1, -1, False

    def extend(self, observations: dict[int, tuple[int, Sequence[int]]], admit: Sequence[int]) -> None:
        """Sequence s of `observations` (s -> (keep, observation ids)) keeps the first `keep` tokens of its last
        turn and gets the observation after them (one device call; frozen, a few when they are more rows than
        any such call ran); each sequence of `admit` takes a free row and its prompt is encoded there (likewise,
        a prefill of those rows: prompts and observations have buckets of their own). The other rows are
        untouched."""
        if len(admit) > self.free_rows:
            raise ValueError(f"RowSession.extend: {len(admit)} sequences for {self.free_rows} free rows")
        with self._sampler.mesh_context():
            if self._state is None:
                self._start()
            free = list(np.flatnonzero(self._host.seq_b < 0))
            if observations:
                rows_k = np.array([self._row(seq) for seq in sorted(observations)])
                keep_k = np.array([observations[seq][0] for seq in sorted(observations)])
                tokens_k = [list(observations[seq][1]) for seq in sorted(observations)]
                sampled_k = np.array([len(self._turn[row].token_ids) for row in rows_k])
                if (keep_k < 0).any() or (keep_k > sampled_k).any() or not all(tokens_k):
                    raise ValueError(f"RowSession.extend: keep {keep_k.tolist()} of {sampled_k.tolist()} sampled "
                                     f"tokens, observations of {[len(t) for t in tokens_k]}")
                self._extend(rows_k, self._host.turn_end_b[rows_k] + keep_k, self._host.turn_pos_b[rows_k] + keep_k,
                             tokens_k, prefill=False)
            if admit:
                rows_k = np.array(free[:len(admit)])
                self._host.seq_b[rows_k], self._slot_of[list(admit)] = admit, rows_k
                zeros_k = np.zeros(len(admit), np.int64)
                self._extend(rows_k, zeros_k, zeros_k, [self._prompts[seq] for seq in admit], prefill=True)

    def begin_turn(self, seq: int, budget: int) -> None:
        """Sequence `seq` samples its next turn, at most `budget` (> 0) tokens, from the next decode chunk on."""
        if budget < 1:
            raise ValueError(f"RowSession.begin_turn: budget must be >= 1, got {budget}")
        row = self._row(seq)
        self._host.turn_end_b[row], self._host.turn_pos_b[row] = self._host.end_b[row], self._host.pos_b[row]
        self._host.remaining_b[row], self._host.decoding_b[row] = budget, True
        self._turn[row] = SampledTurn([], [], False)

    def decode_chunk(self, turn_finished: Callable[[list[list[int]]], list[bool]]
                     ) -> list[tuple[int, SampledTurn]]:
        """One decode chunk of the rows on their turn. A row's turn ends at a stop token, at its budget, or once
        `turn_finished` (token lists of the rows still sampling) says so. Returns (sequence, its SampledTurn) of
        each sequence whose turn ended, ascending."""
        with self._sampler.mesh_context():
            put = self._sampler.put
            host = self._host
            self._ensure_capacity(int(np.max(host.end_b + host.remaining_b * host.decoding_b)) + 1)
            self._state = self._state.replace(remaining_b=put(self._host.remaining_b.astype(np.int32)),
                                              done_b=put(~self._host.decoding_b))
            tokens_bc, logp_bc, emitted_bc, done_b = self._decode_chunk(np.zeros(self.batch_rows, bool))
        host_start = time.perf_counter()
        for row in np.flatnonzero(emitted_bc.any(axis=1)):
            emitted = emitted_bc[row]
            self._turn[row].token_ids.extend(tokens_bc[row, emitted].tolist())
            self._turn[row].logps.extend(logp_bc[row, emitted].tolist())
            n = int(emitted.sum())
            self._host.end_b[row] += n
            self._host.pos_b[row] += n
            self._host.remaining_b[row] -= n
        ended_b = self._host.decoding_b & done_b
        check = np.flatnonzero(self._host.decoding_b & ~done_b)
        if check.size:
            finished = turn_finished([self._turn[row].token_ids for row in check])
            ended_b[check[np.asarray(finished, bool)]] = True
        self._host.decoding_b &= ~ended_b
        stop_set = set(self._cfg.stop_ids)
        ended = sorted((int(self._host.seq_b[row]), with_hit_stop(self._turn[row], stop_set))
                       for row in np.flatnonzero(ended_b))
        self.timing["host_s"] += time.perf_counter() - host_start
        return ended

    def compact(self) -> None:
        """Moves the live sequences into a smaller batch bucket (`ShapePlan.compacted_rows`: a power of two or 1.5x
        one) when the plan has one for them (call it once no sequence waits for a row)."""
        live = np.flatnonzero(self._host.seq_b >= 0)
        if self._state is None or not live.size:
            return
        compaction = self._sampler.plan.compaction(self.batch_rows, self.capacity, len(live), continuous=True)
        if compaction is None:
            return
        take = np.concatenate([live, np.full(compaction.rows_out - len(live), live[0])])
        with self._sampler.mesh_context():
            self._state = self._sampler.select_rows(self._state, take.astype(np.int32))
        host = self._host.take(take)
        host.seq_b[len(live):] = -1
        host.decoding_b[len(live):] = False
        self._host = host
        self._slot_of[host.seq_b[:len(live)]] = np.arange(len(live))
        self._turn = [self._turn[row] for row in take]

    # -- internals -------------------------------------------------------------------------------------------

    def _row(self, seq: int) -> int:
        row = int(self._slot_of[seq])
        if row < 0:
            raise ValueError(f"RowSession: sequence {seq} holds no row")
        return row

    def _start(self) -> None:
        """The empty batch, with room for the longest prompt and a first turn."""
        longest = max(map(len, self._prompts))
        prompt = buckets.pow2_bucket(longest, self._cfg.min_observation_bucket)
        shape = self._sampler.plan.empty(self._batch, prompt + self._first_turn + 1)
        self._state = self._sampler.empty(self._params, self._rng, shape.rows, shape.capacity)
        self._host = RowState.free(shape.rows)
        self._turn = [SampledTurn([], [], False) for _ in range(shape.rows)]

    def _extend(self, rows_k: np.ndarray, end_k: np.ndarray, pos_k: np.ndarray, tokens_k: list[list[int]],
                prefill: bool) -> None:
        """The extend of rows rows_k, rolled back to (end_k, pos_k), by tokens_k; with `prefill` the rows start
        their sequences (see `kernels.extend_rows`). In several calls when they are more than the plan's limit
        (`rollout.max_extend_rows`; frozen, the largest call run)."""
        limit = self._sampler.plan.extend_rows_limit(self.batch_rows, prefill)
        if limit is not None and len(rows_k) > limit:
            for first in range(0, len(rows_k), limit):
                part = slice(first, first + limit)
                self._extend(rows_k[part], end_k[part], pos_k[part], tokens_k[part], prefill)
            return
        lengths_k = np.array([len(t) for t in tokens_k])
        shape = self._sampler.plan.extend_rows(self.batch_rows, self.capacity, len(rows_k), int(lengths_k.max()),
                                               int(end_k.max()), prefill)
        self._ensure_capacity(int(end_k.max()) + shape.tokens)
        k, t = shape.rows_in, shape.tokens
        pad = lambda a, fill, dtype: np.concatenate([a, np.full(k - len(a), fill)]).astype(dtype)  # noqa: E731
        tokens_kt = np.zeros((k, t), np.int32)
        valid_kt = np.zeros((k, t), bool)
        valid_kt[len(rows_k):, 0] = True  # padding rows hold one token so that attention never sees an empty row
        for i, tokens in enumerate(tokens_k):
            tokens_kt[i, :len(tokens)] = tokens
            valid_kt[i, :len(tokens)] = True
        seqs = self._host.seq_b[rows_k]
        key_data_k = np.zeros((k,) + self._key_data_n.shape[1:], np.uint32)
        key_data_k[:len(rows_k)] = self._key_data_n[seqs]
        start = time.perf_counter()
        self._state = self._sampler.extend_rows(
            self._params, self._state, pad(rows_k, self.batch_rows, np.int32), pad(end_k, 0, np.int32),
            pad(pos_k, 0, np.int32), tokens_kt, valid_kt, key_data_k, prefill)
        self._state.logits_bv.block_until_ready()  # times the extend apart from decoding
        self.timing["prefill_s"] += time.perf_counter() - start
        self._host.end_b[rows_k] = end_k + lengths_k
        self._host.pos_b[rows_k] = pos_k + lengths_k
        self._host.decoding_b[rows_k] = False
