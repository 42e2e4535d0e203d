"""The online softmax shared by the blockwise attention (`llds_jax.model.attention`) and the paged attention's
reference (`llds_jax.model.paged_attention`): one tile's visible scores, and the running (max, sum, accumulator)
that a key tile updates, in float32.

Dimension letters: B batch, T queries (Tq of a tile), T' key slots (T'k of a tile; written t or s), K key/value
heads, G query heads per key/value head, H head size; a window [2, B, T] holds each query's first and last visible
key slot.
"""
from __future__ import annotations

import jax.numpy as jnp


def tile_scores(q_btkgh, k_btkh, window_wbt, valid_bt, key_start, scale):
    """Scaled float32 scores [B, K, G, Tq, T'k] of one tile, -inf where not visible."""
    scores = jnp.einsum("btkgh,bskh->bkgts", q_btkgh, k_btkh, preferred_element_type=jnp.float32) * scale
    index_s = key_start + jnp.arange(k_btkh.shape[1], dtype=jnp.int32)[None, None, :]
    visible = (valid_bt[:, None, :] & (index_s >= window_wbt[0][:, :, None])
               & (index_s <= window_wbt[1][:, :, None]))
    return jnp.where(visible[:, None, None], scores, -jnp.inf)


def online_softmax_step(carry, scores_bkgtt, v_btkh):
    """One key tile of the online softmax: the running (max, sum, accumulator) [B, K, G, T] x2 and
    [B, K, G, T, H] (float32) updated by the tile's scores [B, K, G, T, T'k] (-inf: not visible) and values
    [B, T'k, K, H]."""
    m, l, acc = carry
    m_new = jnp.maximum(m, jnp.max(scores_bkgtt, axis=-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # -inf: nothing seen yet
    p = jnp.exp(scores_bkgtt - m_safe[..., None])
    alpha = jnp.exp(m - m_safe)
    l = alpha * l + jnp.sum(p, axis=-1)
    pv = jnp.einsum("bkgts,bskh->bkgth", p.astype(v_btkh.dtype), v_btkh, preferred_element_type=jnp.float32)
    return m_new, l, alpha[..., None] * acc + pv
