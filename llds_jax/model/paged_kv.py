"""The paged KV cache: a pool of fixed-size pages shared by every sequence, in the layout of JAX's TPU ragged paged
attention kernel, and where the tokens of a ragged batch sit in it.

A ragged batch is T token slots (the token budget, static) holding the new tokens of up to S sequences (static)
back to back: sequence s owns tokens cu_q_lens_s1[s] .. cu_q_lens_s1[s + 1] - 1, for s < num_seqs; the tokens from
cu_q_lens_s1[num_seqs] on are padding. Its keys and values live in pages: page_indices_sm[s, m] is the pool page that
holds its tokens m * Z .. m * Z + Z - 1 (Z the page size), and kv_lens_s[s] counts its tokens in the cache after this
batch's are written (its cached ones plus its new ones). A sequence's new tokens are its last ones: new token i of
sequence s sits at cache index (and RoPE position) kv_lens_s[s] - q_len_s + i, q_len_s = cu_q_lens_s1[s + 1] -
cu_q_lens_s1[s]. Two sequences may share full pages (a common prompt prefix: both page tables name them); a sequence
writes only into pages of its own.

The pool, `kv_pages_lpzkh` [L, P, Z, K', H], holds every layer's pages: K' = 2K heads with keys and values
interleaved (head 2k of K' the keys of key/value head k, 2k + 1 its values), as the kernel reads them. Layer l of
the pool seen as [L * P, Z, K', H] with page p at row l * P + p is a reshape (`layer_view`), so attention reads a
layer's pages straight out of the stacked pool and no layer is copied. Split over chips: by key/value heads only
(`pages_spec`), each chip holding its heads' keys and values of every page.

Dimension letters: T ragged batch tokens, S sequences, M pages per sequence (the page table's width), L layers, P
pool pages, Z tokens per page, K key/value heads (K' = 2K: keys and values interleaved, written k), H head size.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from llds_jax import parallel
from llds_jax.model.config import ModelConfig


def init_pages(cfg: ModelConfig, num_pages: int, page_size: int, dtype=None) -> jax.Array:
    """An empty (zero) pool [L, num_pages, page_size, 2K, H] in `dtype` (default the compute dtype)."""
    shape = (cfg.num_layers, num_pages, page_size, 2 * cfg.num_kv_heads, cfg.head_dim)
    return jnp.zeros(shape, jnp.dtype(dtype or cfg.dtype))


def pages_spec(mesh: Any, num_kv_heads: int) -> P:
    """The PartitionSpec of a pool [L, P, Z, K', H] on `mesh`: its K' heads split as "kv_heads" where those axes
    divide the K key/value heads (each chip then holds whole heads: the keys and the values of each), else
    replicated; layers, pages and page slots never split."""
    return P(None, None, None, parallel.fitted(mesh, num_kv_heads, "kv_heads"), None)


def token_layout(cu_q_lens_s1: jax.Array, kv_lens_s: jax.Array, page_indices_sm: jax.Array, num_seqs: jax.Array,
                 num_tokens: int, page_size: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Where each token of a ragged batch of `num_tokens` slots sits (module docstring).

    Args:
      cu_q_lens_s1: int32 [S + 1], cumulative new-token counts (entries past num_seqs are ignored).
      kv_lens_s: int32 [S], each sequence's tokens in the cache including its new ones.
      page_indices_sm: int32 [S, M], each sequence's pages in order.
      num_seqs: int32 [1], the sequences of the batch.
      num_tokens, page_size: T and Z (static).
    Returns (seq_t, position_t, slot_t, valid_t), each [T]: the token's sequence (int32), its cache index = RoPE
    position (int32), its flat pool slot page * Z + offset (int32; -1 for padding) and whether it is a real token
    (bool). Padding tokens have sequence 0 and position 0.
    """
    s = page_indices_sm.shape[0]
    t_t = jnp.arange(num_tokens, dtype=jnp.int32)
    real_s = jnp.arange(s, dtype=jnp.int32) < num_seqs[0]
    end_s = cu_q_lens_s1[1:]
    valid_t = t_t < cu_q_lens_s1[num_seqs[0]]
    # A real token's sequence: the real sequences that end at or before it.
    seq_t = jnp.sum(real_s[None, :] & (end_s[None, :] <= t_t[:, None]), axis=1, dtype=jnp.int32)
    seq_t = jnp.where(valid_t, seq_t, 0)
    position_t = jnp.where(valid_t, kv_lens_s[seq_t] - end_s[seq_t] + t_t, 0)
    page_t = jnp.take_along_axis(page_indices_sm[seq_t], (position_t // page_size)[:, None], axis=1,
                                 mode="clip")[:, 0]
    slot_t = jnp.where(valid_t, page_t * page_size + position_t % page_size, -1)
    return seq_t, position_t, slot_t, valid_t


def write_kv(kv_pages_lpzkh: jax.Array, layer: jax.Array, k_tkh: jax.Array, v_tkh: jax.Array, slot_t: jax.Array
             ) -> jax.Array:
    """Writes the keys and values of T tokens into layer `layer` (int32 scalar, may be traced) of the pool, token t
    at flat slot slot_t[t] = page * Z + offset (-1: padding, dropped). One scatter of [T, K', H] rows, in place where
    the pool is donated or a loop carry; every other entry keeps its value. Slots of real tokens are distinct.

    k_tkh, v_tkh: [T, K, H] (cast to the pool's dtype). Returns the pool.
    """
    _, p, z, c, h = kv_pages_lpzkh.shape
    t = slot_t.shape[0]
    kv_tkh = jnp.stack([k_tkh, v_tkh], axis=2).reshape(t, c, h).astype(kv_pages_lpzkh.dtype)
    page_t = jnp.where(slot_t >= 0, slot_t // z, p)  # padding: a page past the pool, which the scatter drops
    return kv_pages_lpzkh.at[layer, page_t, slot_t % z].set(kv_tkh, mode="drop")


def layer_view(kv_pages_lpzkh: jax.Array, page_indices_sm: jax.Array, layer: jax.Array
               ) -> tuple[jax.Array, jax.Array]:
    """Layer `layer` of the pool as attention reads it: (the pool as [L * P, Z, K', H], a reshape, and the page
    table with each entry moved to that layer's rows, int32 [S, M])."""
    l, p = kv_pages_lpzkh.shape[:2]
    return kv_pages_lpzkh.reshape(l * p, *kv_pages_lpzkh.shape[2:]), page_indices_sm + layer * p
