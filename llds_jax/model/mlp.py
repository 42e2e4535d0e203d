"""The SwiGLU MLP of a decoder block, whole or a slice of its intermediate features at a time.

down(silu(h gate) * (h up)) is a sum over the F intermediate features, so it can be computed over C slices of
F / C features in turn: one layer then holds [B, T, F / C] activations (and, in the backward, their gradients)
instead of [B, T, F]. At 4096 tokens a 7B model's [T, 18944] bfloat16 buffers are 148 MiB each and about six are
live in a layer's backward, the largest block of the update's temporaries after the gradients themselves
(docs/tpu.md).

The sliced path has its own backward (`jax.custom_vjp`) so that it keeps the whole path's precision: each slice's
weight gradients are that slice's columns of the whole path's (the same sums over tokens), written in place into
full-size buffers, and the input gradient and the output sum their slices in float32 before the one rounding to the
compute dtype.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from llds_jax import parallel


def _swiglu(h_btd: jax.Array, gate_df: jax.Array, up_df: jax.Array, down_fd: jax.Array, out_dtype=None
            ) -> jax.Array:
    """The MLP in the compute dtype: [B, T, D] -> [B, T, D] (in `out_dtype`, default the compute dtype)."""
    act_btf = jax.nn.silu(jnp.einsum("btd,df->btf", h_btd, gate_df)) * jnp.einsum("btd,df->btf", h_btd, up_df)
    act_btf = parallel.constrain(act_btf, "batch", None, "mlp")
    return jnp.einsum("btf,fd->btd", act_btf, down_fd, preferred_element_type=out_dtype)


def swiglu(h_btd: jax.Array, gate_df: jax.Array, up_df: jax.Array, down_fd: jax.Array, chunks: int = 1
           ) -> jax.Array:
    """SwiGLU over `chunks` slices of the intermediate features in turn (1: all at once). [B, T, D] -> [B, T, D].

    gate_df, up_df: [D, F]; down_fd: [F, D]; F must be a multiple of `chunks` (ModelConfig checks it)."""
    if chunks == 1:
        return _swiglu(h_btd, gate_df, up_df, down_fd)
    return _swiglu_sliced(h_btd, gate_df, up_df, down_fd, chunks)


def _slice(w: jax.Array, i: jax.Array, chunks: int, axis: int) -> jax.Array:
    size = w.shape[axis] // chunks
    return jax.lax.dynamic_slice_in_dim(w, i * size, size, axis)


def _slice_weights(gate_df, up_df, down_fd, i, chunks):
    return _slice(gate_df, i, chunks, 1), _slice(up_df, i, chunks, 1), _slice(down_fd, i, chunks, 0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _swiglu_sliced(h_btd, gate_df, up_df, down_fd, chunks):
    return _sliced_forward(h_btd, gate_df, up_df, down_fd, chunks)


def _sliced_forward(h_btd, gate_df, up_df, down_fd, chunks):
    def body(i, out_btd):
        return out_btd + _swiglu(h_btd, *_slice_weights(gate_df, up_df, down_fd, i, chunks), jnp.float32)

    out_btd = jax.lax.fori_loop(0, chunks, body, jnp.zeros(h_btd.shape, jnp.float32))
    return out_btd.astype(h_btd.dtype)


def _sliced_fwd(h_btd, gate_df, up_df, down_fd, chunks):
    return _sliced_forward(h_btd, gate_df, up_df, down_fd, chunks), (h_btd, gate_df, up_df, down_fd)


def _sliced_bwd(chunks, residuals, d_out_btd):
    h_btd, gate_df, up_df, down_fd = residuals
    size = gate_df.shape[1] // chunks

    def body(i, carry):
        d_h_btd, d_gate_df, d_up_df, d_down_fd = carry
        weights = _slice_weights(gate_df, up_df, down_fd, i, chunks)
        _, vjp = jax.vjp(_swiglu, h_btd, *weights)
        d_h_part, d_gate_part, d_up_part, d_down_part = vjp(d_out_btd)
        return (d_h_btd + d_h_part.astype(jnp.float32),
                jax.lax.dynamic_update_slice_in_dim(d_gate_df, d_gate_part, i * size, 1),
                jax.lax.dynamic_update_slice_in_dim(d_up_df, d_up_part, i * size, 1),
                jax.lax.dynamic_update_slice_in_dim(d_down_fd, d_down_part, i * size, 0))

    zeros = (jnp.zeros(h_btd.shape, jnp.float32), jnp.zeros_like(gate_df), jnp.zeros_like(up_df),
             jnp.zeros_like(down_fd))
    d_h_btd, d_gate_df, d_up_df, d_down_fd = jax.lax.fori_loop(0, chunks, body, zeros)
    return d_h_btd.astype(h_btd.dtype), d_gate_df, d_up_df, d_down_fd


_swiglu_sliced.defvjp(_sliced_fwd, _sliced_bwd)
