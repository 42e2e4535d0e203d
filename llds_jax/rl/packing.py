"""Packed trajectories: several trajectories of a micro-batch share one row of the training forward.

The B trajectories of a micro-batch (each at most T tokens) go, first fit by decreasing length, into R rows of
T' >= T tokens (`optim.pack_row_tokens`; by default T' = T). A trajectory's real tokens stay contiguous and in
order; `segment_first_rt` marks where each one starts, so the model restarts positions there and no token attends to
another trajectory (`Transformer.hidden`); `source_bt` records where each token went, so that the per-token
log-probs and entropies come back to the [B, T] layout on which the loss terms, the LLDS gates, the action ids and
the LLD diagnostics work unchanged (`unpack`).

A trajectory of several segments (`RolloutBatch.segment_first_bt`, rollout.context_policy) is packed whole, as any
trajectory (so it needs the rows a trajectory of its length needs), and each of its segments is a sequence of its
own there: `segment_first_rt` restarts at each segment, whose first token has no prediction.

Micro-batch and mini-batch membership stay those of the unpacked batch, counted in trajectories: the objective does
not change, only the rows the forward runs on (R <= B, fewer the more the trajectories are shorter than T).

Dimension letters (docs/architecture.md, "Dimension letters"): X micro-batches, B trajectories of a micro-batch,
R packed rows, T tokens of a trajectory's row (the batch length); a packed row's T' >= T tokens are written t in the
array suffixes too (`tokens_rt` is [R, T']).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedRows:
    """The packed rows of every micro-batch (numpy or jax arrays; leading axes as the batch's, e.g. [U, X]).

    Attributes:
      tokens_rt: int32 [..., R, T'] token ids, 0 on padding.
      mask_rt: float32 [..., R, T'] 1 on real tokens.
      segment_first_rt: int32 [..., R, T'] index in the row of the first token of each token's trajectory (on
        padding: the token's own index).
      source_bt: int32 [..., B, T] for token t of trajectory b of the micro-batch, the flat index r * T' + t' of its
        place in the packed rows; -1 on padding and on each trajectory's first real token (whose log-prob has no
        prediction in the unpacked layout either).
    """

    tokens_rt: Any
    mask_rt: Any
    segment_first_rt: Any
    source_bt: Any

    @property
    def num_rows(self) -> int:
        """R."""
        return self.tokens_rt.shape[-2]


def first_fit_rows(lengths_b: np.ndarray, length: int) -> list[list[int]]:
    """Trajectory indices per row: first fit by decreasing length (ties by index) into rows of `length` tokens."""
    rows: list[list[int]] = []
    free: list[int] = []
    for b in sorted(range(len(lengths_b)), key=lambda i: (-int(lengths_b[i]), i)):
        need = int(lengths_b[b])
        if need > length:
            raise ValueError(f"packing: a trajectory has {need} tokens, more than the row length {length}")
        row = next((r for r, space in enumerate(free) if space >= need), None)
        if row is None:
            rows.append([])
            free.append(length)
            row = len(rows) - 1
        rows[row].append(b)
        free[row] -= need
    return rows


def rows_needed(mask_xbt: np.ndarray, row_length: int | None = None) -> int:
    """The most rows of `row_length` tokens (default T) any of the X micro-batches packs into (mask_xbt: [X, B, T]
    1 on real tokens)."""
    length = row_length or mask_xbt.shape[-1]
    return max(len(first_fit_rows((mask > 0).sum(axis=-1), length)) for mask in mask_xbt)


def pack(tokens_xbt: np.ndarray, mask_xbt: np.ndarray, num_rows: int, row_length: int | None = None,
         segment_first_xbt: np.ndarray | None = None) -> PackedRows:
    """Packs each of X micro-batches of B trajectories ([X, B, T] token ids and real-token mask; their segments'
    first tokens, `RolloutBatch.segment_first_bt`, or None: one sequence a trajectory) into `num_rows` rows of
    `row_length` T' >= T tokens (default T; at least `rows_needed` rows). Returns PackedRows with [X, R, T'] and
    [X, B, T] numpy arrays."""
    num = tokens_xbt.shape[0]
    length = row_length or tokens_xbt.shape[-1]
    if length < tokens_xbt.shape[-1]:
        raise ValueError(f"packing: rows of {length} tokens are shorter than the batch length {tokens_xbt.shape[-1]}")
    tokens_xrt = np.zeros((num, num_rows, length), np.int32)
    mask_xrt = np.zeros((num, num_rows, length), np.float32)
    first_xrt = np.broadcast_to(np.arange(length, dtype=np.int32), (num, num_rows, length)).copy()
    source_xbt = np.full(tokens_xbt.shape, -1, np.int32)
    for n in range(num):
        real_bt = mask_xbt[n] > 0
        rows = first_fit_rows(real_bt.sum(axis=-1), length)
        if len(rows) > num_rows:
            raise ValueError(f"packing: micro-batch {n} needs {len(rows)} rows, more than {num_rows}")
        for r, members in enumerate(rows):
            start = 0
            for b in members:
                positions_t = np.flatnonzero(real_bt[b])
                end = start + len(positions_t)
                # Each token's sequence start in the row: the trajectory's, or its segment's.
                first_t = np.zeros(len(positions_t), np.int64) if segment_first_xbt is None else \
                    np.searchsorted(positions_t, segment_first_xbt[n, b, positions_t])
                tokens_xrt[n, r, start:end] = tokens_xbt[n, b, positions_t]
                mask_xrt[n, r, start:end] = 1.0
                first_xrt[n, r, start:end] = start + first_t
                predicted = first_t != np.arange(len(positions_t))  # not the first token of its sequence
                source_xbt[n, b, positions_t[predicted]] = r * length + start + np.flatnonzero(predicted)
                start = end
    return PackedRows(tokens_rt=tokens_xrt, mask_rt=mask_xrt, segment_first_rt=first_xrt, source_bt=source_xbt)


def unpack(values_rt: jax.Array, source_bt: jax.Array) -> jax.Array:
    """Per-token values of one micro-batch's packed rows [R, T'] in the trajectories' layout [B, T]: the value at
    each token's place, 0 where `source_bt` is -1."""
    flat = values_rt.reshape(-1)
    return jnp.where(source_bt >= 0, flat[jnp.clip(source_bt, 0, flat.shape[0] - 1)], 0.0)
