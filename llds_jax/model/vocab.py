"""Embedding lookup on a vocabulary-sharded table: no device ever holds the whole [V, D] table.

Under a mesh (`jax.set_mesh`) the table's V is split over the mesh axes of the logical "vocab" dimension (fsdp and
tensor, `parallel.LOGICAL_AXIS_RULES`), some of which (fsdp) also split the "batch". Each device looks up, for every
row of its group along those shared axes, the ids that fall in its own shard (zeros for the others); a
reduce-scatter over the shared axes along the batch (a sum where the batch is not split) and a sum over the other
vocabulary axes (tensor) bring each row's vectors back to the device that holds the row. Exactly one shard
contributes each id, so the result equals a plain lookup bit for bit, and the gradient is a scatter-add into each
device's own shard.

The group's rows are looked up a time chunk at a time (`LOOKUP_CHUNK` tokens of each row): a device holds the
[fsdp * B, chunk, D] vectors of one chunk, and in the backward pass their gradient, never those of whole rows
(qwen7b_v4's update, 16 rows of 4096 tokens per fsdp group: 0.11 GiB in float32 instead of 0.88 GiB, and again for
the gathered gradient).

Dimension letters: B batch, T tokens, V vocabulary, D hidden, I time chunks of the lookup, C a chunk's tokens.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from llds_jax import parallel

# Tokens of each row looked up at once on a sharded table (see the module docstring).
LOOKUP_CHUNK = 512


def embed_lookup(table_vd: jax.Array, tokens_bt: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """Rows of `table_vd` [V, D] for the int ids `tokens_bt` [B, T], cast to `dtype`: [B, T, D], the batch split
    over the mesh's "batch" axes when it divides (replicated otherwise)."""
    mesh = parallel.current_mesh()
    if mesh is None or parallel.axis_size(mesh, "vocab") == 1:
        return jnp.take(table_vd, tokens_bt, axis=0).astype(dtype)
    vocab_axes = parallel.axes("vocab")
    row_axes = tuple(a for a in parallel.axes("batch") if a in vocab_axes)  # split both the rows and V (fsdp)
    other_axes = tuple(a for a in vocab_axes if a not in row_axes)  # split V alone (tensor)
    batch_axes = parallel.fitted(mesh, tokens_bt.shape[0], "batch")
    gather_rows = batch_axes is not None and math.prod(mesh.shape[a] for a in row_axes) > 1

    def shard_lookup(table_vd, tokens_bt):
        if gather_rows:  # the ids of every row whose vectors this device's shard contributes to
            tokens_bt = lax.all_gather(tokens_bt, row_axes, axis=0, tiled=True)
        # Ids outside this shard become the out-of-range id `local_vocab`, which reads zeros (and drops its
        # gradient): no [B, T, D] mask is kept. (Negative ids would wrap around, as in NumPy.)
        local_vocab = table_vd.shape[0]
        ids_bt = tokens_bt - lax.axis_index(vocab_axes) * local_vocab
        ids_bt = jnp.where((ids_bt >= 0) & (ids_bt < local_vocab), ids_bt, local_vocab)
        x_btd = jnp.take(table_vd, ids_bt, axis=0, mode="fill", fill_value=0).astype(dtype)
        if gather_rows:
            x_btd = lax.psum_scatter(x_btd, row_axes, scatter_dimension=0, tiled=True)
        else:
            x_btd = lax.psum(x_btd, row_axes)
        return lax.psum(x_btd, other_axes)

    def chunked_lookup(table_vd, tokens_bt):
        rows, time = tokens_bt.shape
        num_chunks = -(-time // LOOKUP_CHUNK)
        chunk = -(-time // num_chunks)  # equal chunks of at most LOOKUP_CHUNK
        tokens_ibc = jnp.pad(tokens_bt, ((0, 0), (0, num_chunks * chunk - time))).reshape(
            rows, num_chunks, chunk).swapaxes(0, 1)
        x_ibcd = lax.map(functools.partial(shard_lookup, table_vd), tokens_ibc)
        return x_ibcd.swapaxes(0, 1).reshape(rows, num_chunks * chunk, -1)[:, :time]

    return jax.shard_map(chunked_lookup, in_specs=(parallel.spec("vocab", None), P(batch_axes, None)),
                         out_specs=P(batch_axes, None, None))(table_vd, tokens_bt)
