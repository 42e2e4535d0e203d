"""Rotary position embeddings (HF "rotate half" layout), angles in float32, with Llama-3 frequency scaling."""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from llds_jax.model.config import ModelConfig


def inverse_frequencies(cfg: ModelConfig) -> np.ndarray:
    """Per-pair inverse frequencies [H/2] (float32), Llama-3 scaled when `cfg.rope_scaling` is set."""
    h = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, h, 2, dtype=np.float32) / h))
    s = cfg.rope_scaling
    if s is None:
        return inv_freq.astype(np.float32)
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_angles(positions_bt: jnp.ndarray, inv_freq_h: np.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """cos and sin [B, T, H] (float32) for integer positions [B, T]."""
    freqs = positions_bt.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq_h)[None, None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x_btnh: jnp.ndarray, cos_bth: jnp.ndarray, sin_bth: jnp.ndarray) -> jnp.ndarray:
    """Rotates query or key heads [B, T, N, H]; computed in float32, returned in x's dtype."""
    x = x_btnh.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    out = x * cos_bth[:, :, None, :] + rotated * sin_bth[:, :, None, :]
    return out.astype(x_btnh.dtype)
