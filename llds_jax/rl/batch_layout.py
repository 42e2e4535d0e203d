"""A checked rollout batch laid out for the updates: U updates of X micro-batches of `micro` trajectories, on the
device(s), with each update's micro-batches packed into rows when `optim.pack_trajectories` is on.

`RLTrainStep.prepare_batch` (llds_jax/rl/train_step.py) checks a host `RolloutBatch` ([B, T] numpy arrays) and
hands it to `BatchLayout.lay_out`, which reshapes it into a `LaidOutBatch` (the same fields as [U, X, micro, ...]
arrays: trajectory b in update b // (X micro), micro-batch (b // micro) % X, place b % micro), places it on the
device(s) (the micro axis split over the mesh's data axes, so that every micro-batch spans all devices) and, with
packing, packs each update's micro-batches into R_u rows (llds_jax/rl/packing.py). `BatchLayout.spec` is the same
result as ShapeDtypeStructs, for ahead-of-time compilation.

Dimension letters (docs/architecture.md, "Dimension letters"): U updates, X micro-batches per update, B trajectories
(of a micro-batch, `micro`, in a laid-out batch; of the whole batch, U X micro, in a `RolloutBatch`), T tokens.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from llds_jax.bounds import ConfigError
from llds_jax.rl.batch import RolloutBatch, batch_dtype
from llds_jax.config.sections import UpdateConfig
from llds_jax.rl.logprobs import mesh_batch_axes
from llds_jax.rl.packing import PackedRows, pack, rows_needed


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LaidOutBatch:
    """A rollout batch's U X micro trajectories as U updates of X micro-batches of `micro`: `RolloutBatch`'s fields,
    in its order, with [U, X, B] in place of its leading [B] (numpy or jax arrays, or ShapeDtypeStructs).

    Attributes:
      tokens_uxbt, mask_uxbt, loss_mask_uxbt, action_ids_uxbt, answer_mask_uxbt, sampler_logp_uxbt: [U, X, B, T]
        (`RolloutBatch.tokens_bt` ... `sampler_logp_bt`).
      group_uxb, search_count_uxb, rewards_uxb, advantages_uxb: [U, X, B] (`RolloutBatch.group_b` ...
        `advantages_b`).
      segment_first_uxbt: [U, X, B, T] (`RolloutBatch.segment_first_bt`), or None.
    """

    tokens_uxbt: Any
    mask_uxbt: Any
    loss_mask_uxbt: Any
    action_ids_uxbt: Any
    answer_mask_uxbt: Any
    sampler_logp_uxbt: Any
    group_uxb: Any
    search_count_uxb: Any
    rewards_uxb: Any
    advantages_uxb: Any
    segment_first_uxbt: Any = None

    @classmethod
    def of(cls, batch: RolloutBatch, shape: tuple[int, int, int]) -> LaidOutBatch:
        """`batch` (rewards and advantages set) laid out as `shape` (U, X, micro), U X micro its trajectories."""
        return cls(*(None if x is None else x.reshape(shape + x.shape[1:]) for x in _arrays(batch)))

    @property
    def num_updates(self) -> int:
        """U."""
        return self.tokens_uxbt.shape[0]

    @property
    def micro_batch_size(self) -> int:
        """The trajectories of a micro-batch (B of its [U, X, B, T] arrays)."""
        return self.tokens_uxbt.shape[2]

    @property
    def num_trajectories(self) -> int:
        """U X micro, the batch's trajectories."""
        return math.prod(self.tokens_uxbt.shape[:3])

    @property
    def length(self) -> int:
        """T, the tokens of a trajectory."""
        return self.tokens_uxbt.shape[3]

    def flat(self) -> RolloutBatch:
        """The B trajectories in their order, [B, ...] arrays: the batch `of` laid out (also under jit)."""
        return RolloutBatch(*(None if x is None else x.reshape((-1,) + x.shape[3:]) for x in _arrays(self)))

    def micro_batches(self, index: int | jax.Array) -> RolloutBatch:
        """Update `index`'s X micro-batches stacked (`index` may be traced): a RolloutBatch of [X, B, ...] arrays,
        which `jax.lax.scan` walks one micro-batch (a RolloutBatch of B trajectories) at a time."""
        take = functools.partial(jax.lax.dynamic_index_in_dim, index=index, axis=0, keepdims=False)
        return RolloutBatch(*(None if x is None else take(x) for x in _arrays(self)))


def _arrays(batch: RolloutBatch | LaidOutBatch) -> list[Any]:
    """The arrays of a batch in field order (the same order in both types)."""
    return [getattr(batch, field.name) for field in dataclasses.fields(batch)]


class PreparedBatch(NamedTuple):
    """A checked rollout batch on the device(s), laid out for the updates.

    Attributes:
      batch: its trajectories as [U, X, B, ...] arrays (the micro axis split over the mesh's data axes).
      batch_stats: the loss terms' whole-batch statistics (`terms.batch_statistics`), replicated scalars.
      rows: with `optim.pack_trajectories`, per update, each of its micro-batches' trajectories packed into R_u
        rows of T' tokens ([1, X, R_u, T'] and [1, X, B, T] arrays, split like `batch`), which the forwards run on;
        None: the forwards run on `batch`.
    """

    batch: LaidOutBatch
    batch_stats: dict[str, jax.Array]
    rows: tuple[PackedRows, ...] | None = None

    @property
    def num_updates(self) -> int:
        """U, the optimizer updates of this batch."""
        return self.batch.num_updates

    def update_rows(self, index: int) -> PackedRows | None:
        """Update `index`'s packed rows; None when the forwards run on the trajectories."""
        return None if self.rows is None else self.rows[index]


class BatchLayout:
    """Where the trajectories of a rollout batch go for the updates: updates of `optim.mini_batch_size`
    trajectories, micro-batches of `optim.micro_batch_size`, split over the mesh's data axes (with packing: rows).

    Args:
      update: the mini / micro-batch sizes and the packing settings.
      mesh: optional (data, fsdp, tensor) mesh: a micro-batch is split over its data axes (data, fsdp).
      segmented: its batches carry `segment_first_bt` (rollout.context_policy other than none; `spec` then has it).
    """

    def __init__(self, update: UpdateConfig, mesh: Mesh | None = None, segmented: bool = False):
        self.update_cfg = update
        self.mesh = mesh
        self.segmented = segmented

    def shape(self, num: int) -> tuple[int, int, int]:
        """(U, X, micro) of a batch of `num` trajectories; ValueError when `num` is no multiple of the mini-batch size
        or the micro-batch size none of the mesh's data axes size."""
        cfg = self.update_cfg
        if num % cfg.mini_batch_size:
            raise ConfigError(f"batch size {num} is not a multiple of optim.mini_batch_size ({cfg.mini_batch_size})")
        if self.mesh is not None and cfg.micro_batch_size % self.data_shards():
            raise ConfigError(f"optim.micro_batch_size ({cfg.micro_batch_size}) must be a multiple of the mesh's "
                              f"data axes size ({self.data_shards()})")
        return num // cfg.mini_batch_size, cfg.mini_batch_size // cfg.micro_batch_size, cfg.micro_batch_size

    def lay_out(self, batch: RolloutBatch, batch_stats: dict[str, float]) -> PreparedBatch:
        """A checked host batch (`RolloutBatch.checked`) and its loss terms' statistics on the device(s)."""
        if batch.segment_first_bt is not None and not self.update_cfg.pack_trajectories:
            raise ConfigError("a batch of segmented trajectories (rollout.context_policy) trains each segment as a "
                              "sequence of its own in packed rows: set optim.pack_trajectories true")
        laid_out = LaidOutBatch.of(batch, self.shape(batch.num_trajectories))
        return PreparedBatch(batch=jax.tree.map(self.put, laid_out),
                             batch_stats={name: self.put(np.float32(value)) for name, value in batch_stats.items()},
                             rows=self._packed_rows(laid_out) if self.update_cfg.pack_trajectories else None)

    def spec(self, num: int, length: int, stat_names: list[str], num_rows: int | None = None) -> PreparedBatch:
        """The abstract `lay_out` result of a batch of `num` trajectories of `length` tokens and the statistics
        `stat_names`, for ahead-of-time compilation (packed: `num_rows` rows per micro-batch, by default the worst
        case, one row per trajectory)."""
        shape = self.shape(num)

        def spec(dims, dtype) -> jax.ShapeDtypeStruct:
            return jax.ShapeDtypeStruct(dims, dtype, sharding=self.sharding(len(dims)))

        batch = LaidOutBatch(*(spec(shape + ((length,) if field.name.endswith("_bt") else ()),
                                    batch_dtype(field.name)) for field in dataclasses.fields(RolloutBatch)
                               if field.name != "segment_first_bt" or self.segmented))
        rows = None
        if self.update_cfg.pack_trajectories:
            update_rows = (1, shape[1], num_rows or shape[2], self.row_length(length))
            rows = (PackedRows(tokens_rt=spec(update_rows, jnp.int32), mask_rt=spec(update_rows, jnp.float32),
                               segment_first_rt=spec(update_rows, jnp.int32),
                               source_bt=spec((1,) + shape[1:] + (length,), jnp.int32)),) * shape[0]
        return PreparedBatch(batch=batch, batch_stats={name: spec((), jnp.float32) for name in stat_names},
                             rows=rows)

    def data_shards(self) -> int:
        """The size of the mesh's data axes (1 without a mesh)."""
        return math.prod(self.mesh.shape[a] for a in mesh_batch_axes(self.mesh)) if self.mesh is not None else 1

    def row_counts(self, length: int) -> list[int]:
        """Every packed-row count R_u an update of a batch of `length` tokens can need: the multiples of the
        data-axes size up to the worst case's (every trajectory `length` tokens long, T' // length to a row)."""
        shards, per_row = self.data_shards(), self.row_length(length) // length
        worst = -(-self.update_cfg.micro_batch_size // per_row)
        return list(range(shards, -(-worst // shards) * shards + 1, shards))

    def row_length(self, length: int) -> int:
        """T' of the packed rows of a batch of `length` tokens: `optim.pack_row_tokens`, at least `length`."""
        return max(self.update_cfg.pack_row_tokens, length)

    def _packed_rows(self, laid_out: LaidOutBatch) -> tuple[PackedRows, ...]:
        """Per update, its micro-batches of a laid-out host batch packed into R_u rows of T' tokens, placed on the
        device(s) as [1, X, R_u, T'] arrays. R_u: the most rows one of them needs, rounded up to a multiple of the
        data-axes size (so at most micro / shards row counts per batch length, each a compilation of the forwards)."""
        shards = self.data_shards()
        row_length = self.row_length(laid_out.length)
        per_update = []
        firsts = [None] * laid_out.num_updates if laid_out.segment_first_uxbt is None else laid_out.segment_first_uxbt
        for tokens_xbt, mask_xbt, first_xbt in zip(laid_out.tokens_uxbt, laid_out.mask_uxbt, firsts):
            num_rows = -(-rows_needed(mask_xbt, row_length) // shards) * shards
            rows = pack(tokens_xbt, mask_xbt, num_rows, row_length, first_xbt)
            per_update.append(jax.tree.map(lambda x: self.put(x[None]), rows))
        return tuple(per_update)

    def put(self, array: np.ndarray) -> jax.Array:
        """[U, X, B, ...] arrays split on the micro axis over the data axes; scalars replicated."""
        if self.mesh is None:
            return jnp.asarray(array)
        return jax.device_put(array, self.sharding(array.ndim))

    def sharding(self, ndim: int) -> NamedSharding | None:
        """The layout of a laid-out [U, X, B, ...] array (the micro axis over the data axes); of a scalar (ndim 0):
        replicated. None without a mesh."""
        if self.mesh is None:
            return None
        batch_axes = mesh_batch_axes(self.mesh) or None
        return NamedSharding(self.mesh, P(None, None, batch_axes) if ndim >= 3 else P())
