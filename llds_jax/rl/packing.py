"""Packed trajectories: several trajectories of a micro-batch share one row of the training forward.

The m trajectories of a micro-batch (each at most L tokens) go, first fit by decreasing length, into R rows of
L' >= L tokens (`optim.pack_row_tokens`; by default L' = L). A trajectory's real tokens stay contiguous and in
order; `segment_first_rl` marks where each one starts, so the model restarts positions there and no token attends to
another trajectory (`Transformer.hidden`); `source_ml` records where each token went, so that the per-token
log-probs and entropies come back to the [m, L] layout on which the loss terms, the LLDS gates, the action ids and
the LLD diagnostics work unchanged (`unpack`).

Micro-batch and mini-batch membership stay those of the unpacked batch, counted in trajectories: the objective does
not change, only the rows the forward runs on (R <= m, fewer the more the trajectories are shorter than L).

Dimension letters: N micro-batches, m trajectories per micro-batch, R packed rows, L tokens per trajectory row
(the batch length); a packed row's length L' is written l in the array suffixes (`tokens_rl` is [R, L']).
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
    """The packed rows of every micro-batch (numpy or jax arrays; leading axes as the batch's, e.g. [U, K]).

    Attributes:
      tokens_rl: int32 [..., R, L'] token ids, 0 on padding.
      mask_rl: float32 [..., R, L'] 1 on real tokens.
      segment_first_rl: int32 [..., R, L'] index in the row of the first token of each token's trajectory (on
        padding: the token's own index).
      source_ml: int32 [..., m, L] for token t of trajectory b of the micro-batch, the flat index r * L' + l of its
        place in the packed rows; -1 on padding and on each trajectory's first real token (whose log-prob has no
        prediction in the unpacked layout either).
    """

    tokens_rl: Any
    mask_rl: Any
    segment_first_rl: Any
    source_ml: Any

    @property
    def num_rows(self) -> int:
        """R."""
        return self.tokens_rl.shape[-2]


def first_fit_rows(lengths_m: np.ndarray, length: int) -> list[list[int]]:
    """Trajectory indices per row: first fit by decreasing length (ties by index) into rows of `length` tokens."""
    rows: list[list[int]] = []
    free: list[int] = []
    for b in sorted(range(len(lengths_m)), key=lambda i: (-int(lengths_m[i]), i)):
        need = int(lengths_m[b])
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


def rows_needed(mask_nml: np.ndarray, row_length: int | None = None) -> int:
    """The most rows of `row_length` tokens (default L) any of the N micro-batches packs into (mask_nml: [N, m, L]
    1 on real tokens)."""
    length = row_length or mask_nml.shape[-1]
    return max(len(first_fit_rows((mask > 0).sum(axis=-1), length)) for mask in mask_nml)


def pack(tokens_nml: np.ndarray, mask_nml: np.ndarray, num_rows: int, row_length: int | None = None) -> PackedRows:
    """Packs each of N micro-batches of m trajectories ([N, m, L] token ids and real-token mask) into `num_rows`
    rows of `row_length` L' >= L tokens (default L; at least `rows_needed` rows). Returns PackedRows with
    [N, R, L'] and [N, m, L] numpy arrays."""
    num = tokens_nml.shape[0]
    length = row_length or tokens_nml.shape[-1]
    if length < tokens_nml.shape[-1]:
        raise ValueError(f"packing: rows of {length} tokens are shorter than the batch length {tokens_nml.shape[-1]}")
    tokens_nrl = np.zeros((num, num_rows, length), np.int32)
    mask_nrl = np.zeros((num, num_rows, length), np.float32)
    first_nrl = np.broadcast_to(np.arange(length, dtype=np.int32), (num, num_rows, length)).copy()
    source_nml = np.full(tokens_nml.shape, -1, np.int32)
    for n in range(num):
        real_ml = mask_nml[n] > 0
        rows = first_fit_rows(real_ml.sum(axis=-1), length)
        if len(rows) > num_rows:
            raise ValueError(f"packing: micro-batch {n} needs {len(rows)} rows, more than {num_rows}")
        for r, members in enumerate(rows):
            start = 0
            for b in members:
                positions_t = np.flatnonzero(real_ml[b])
                end = start + len(positions_t)
                tokens_nrl[n, r, start:end] = tokens_nml[n, b, positions_t]
                mask_nrl[n, r, start:end] = 1.0
                first_nrl[n, r, start:end] = start
                source_nml[n, b, positions_t[1:]] = r * length + np.arange(start + 1, end, dtype=np.int32)
                start = end
    return PackedRows(tokens_rl=tokens_nrl, mask_rl=mask_nrl, segment_first_rl=first_nrl, source_ml=source_nml)


def unpack(values_rl: jax.Array, source_ml: jax.Array) -> jax.Array:
    """Per-token values of one micro-batch's packed rows [R, L'] in the trajectories' layout [m, L]: the value at
    each token's place, 0 where `source_ml` is -1."""
    flat = values_rl.reshape(-1)
    return jnp.where(source_ml >= 0, flat[jnp.clip(source_ml, 0, flat.shape[0] - 1)], 0.0)
