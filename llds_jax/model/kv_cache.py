"""Key/value cache with per-sequence write offsets, for prefill, decode and multi-turn extend."""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from llds_jax.model.config import ModelConfig


@flax.struct.dataclass
class KVCache:
    """Cache of S slots per sequence.

    Attributes:
      k_lbskh, v_lbskh: keys and values [L, B, S, K, H] (compute dtype).
      valid_bs: bool [B, S], a slot holds a real token (left padding and unused slots are False).
      end_b: int32 [B], the next slot a sequence writes to.
      next_pos_b: int32 [B], the RoPE position of the sequence's next real token (= real tokens so far).
    """

    k_lbskh: jax.Array
    v_lbskh: jax.Array
    valid_bs: jax.Array
    end_b: jax.Array
    next_pos_b: jax.Array

    @property
    def capacity(self) -> int:
        return self.valid_bs.shape[1]


def init_cache(cfg: ModelConfig, batch_size: int, capacity: int, dtype=None) -> KVCache:
    """An empty cache for `batch_size` sequences of up to `capacity` slots each."""
    shape = (cfg.num_layers, batch_size, capacity, cfg.num_kv_heads, cfg.head_dim)
    dtype = jnp.dtype(dtype or cfg.dtype)
    return KVCache(
        k_lbskh=jnp.zeros(shape, dtype), v_lbskh=jnp.zeros(shape, dtype),
        valid_bs=jnp.zeros((batch_size, capacity), bool),
        end_b=jnp.zeros((batch_size,), jnp.int32), next_pos_b=jnp.zeros((batch_size,), jnp.int32))


def write_slots(cache_bs_: jax.Array, new_bt_: jax.Array, start_b: jax.Array) -> jax.Array:
    """Writes each row's T new entries into its slots start_b .. start_b + T - 1."""
    def one(cache_s_, new_t_, start):
        return jax.lax.dynamic_update_slice(cache_s_, new_t_.astype(cache_s_.dtype),
                                            (start,) + (0,) * (cache_s_.ndim - 1))
    return jax.vmap(one)(cache_bs_, new_bt_, start_b)


def write_layer_slots(cache_lbs_: jax.Array, layer: jax.Array, new_bt_: jax.Array, start_b: jax.Array) -> jax.Array:
    """Writes each row's T new entries into layer `layer` (a traced int32) of a stacked [L, B, S, ...] cache, at
    slots start_b .. start_b + T - 1, in place where the cache is a loop carry or donated (the layer's other slots
    do not move). The caller keeps start_b + T <= S.

    One token per row (decode): one scatter of the new entries. Several (prefill, extends): one
    dynamic-update-slice per row in a loop. A scatter of [B, T] entries works on the cache flattened over
    (L, B, S), which on TPU needs the cache row-major, while an extend's attention products want it heads-major
    when a chip holds several key/value heads: the compiler then copied the whole cache to row-major and back in
    every layer (14 GiB of temporaries for Llama-3.2-3B at 64 rows, docs/tpu.md); a slice update takes either
    layout.
    """
    b, t = new_bt_.shape[:2]
    if t > 1:
        def row(i, cache):
            update = jax.lax.dynamic_index_in_dim(new_bt_, i, keepdims=True)[None].astype(cache.dtype)
            return jax.lax.dynamic_update_slice(cache, update, (layer, i, start_b[i]) + (0,) * (cache.ndim - 3))
        return jax.lax.fori_loop(0, b, row, cache_lbs_)
    rows_bt = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, t))
    slots_bt = start_b[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    return cache_lbs_.at[layer, rows_bt, slots_bt].set(new_bt_.astype(cache_lbs_.dtype), mode="drop")


def advance(cache: KVCache, valid_bt: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Bookkeeping of one extend of T tokens.

    Returns (valid_bs after the write, slot of each new token [B, T], new end_b, new next_pos_b). A row's end
    moves past its last valid new token, so right padding inside the chunk is overwritten by the next write
    while left padding (prefill) keeps its slots.
    """
    t = valid_bt.shape[1]
    valid_bs = write_slots(cache.valid_bs, valid_bt, cache.end_b)
    slot_bt = cache.end_b[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    last_valid_b = jnp.max(jnp.where(valid_bt, jnp.arange(1, t + 1, dtype=jnp.int32)[None, :], 0), axis=1)
    new_end_b = cache.end_b + last_valid_b
    new_next_pos_b = cache.next_pos_b + jnp.sum(valid_bt, axis=1, dtype=jnp.int32)
    return valid_bs, slot_bt, new_end_b, new_next_pos_b
