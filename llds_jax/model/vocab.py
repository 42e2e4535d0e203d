"""Embedding lookup on a vocabulary-sharded table: no device ever holds the whole [V, D] table.

Under a mesh (`jax.set_mesh`) the table's V is split over the ("fsdp", "tensor") axes (`parallel.VOCAB`). Each
device looks up, for every row of its fsdp group, the ids that fall in its own shard (zeros for the others); a
reduce-scatter over "fsdp" along the batch (a sum where the batch is not split) and a sum over "tensor" bring each
row's vectors back to the device that holds the row. Exactly one shard contributes each id, so the result equals a
plain lookup bit for bit, and the gradient is a scatter-add into each device's own shard.

Dimension letters: B batch, T tokens, V vocabulary, D hidden.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from llds_jax import parallel


def embed_lookup(table_vd: jax.Array, tokens_bt: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """Rows of `table_vd` [V, D] for the int ids `tokens_bt` [B, T], cast to `dtype`: [B, T, D], the batch split
    over the mesh's ("data", "fsdp") axes when it divides (replicated otherwise)."""
    mesh = parallel.current_mesh()
    if mesh is None or math.prod(mesh.shape[a] for a in parallel.VOCAB) == 1:
        return jnp.take(table_vd, tokens_bt, axis=0).astype(dtype)
    batch_axes = parallel.fitted(mesh, tokens_bt.shape[0], parallel.BATCH)
    gather_rows = batch_axes is not None and mesh.shape["fsdp"] > 1

    def shard_lookup(table_vd, tokens_bt):
        if gather_rows:  # the ids of every row whose vectors this device's shard contributes to
            tokens_bt = lax.all_gather(tokens_bt, "fsdp", axis=0, tiled=True)
        local_vocab = table_vd.shape[0]
        ids_bt = tokens_bt - lax.axis_index(parallel.VOCAB) * local_vocab
        inside_bt = (ids_bt >= 0) & (ids_bt < local_vocab)
        x_btd = jnp.take(table_vd, jnp.clip(ids_bt, 0, local_vocab - 1), axis=0).astype(dtype)
        x_btd = jnp.where(inside_bt[..., None], x_btd, jnp.zeros((), dtype))
        if gather_rows:
            x_btd = lax.psum_scatter(x_btd, "fsdp", scatter_dimension=0, tiled=True)
        else:
            x_btd = lax.psum(x_btd, "fsdp")
        return lax.psum(x_btd, "tensor")

    return jax.shard_map(shard_lookup, in_specs=(P(parallel.VOCAB, None), P(batch_axes, None)),
                         out_specs=P(batch_axes, None, None))(table_vd, tokens_bt)
