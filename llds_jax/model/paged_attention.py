"""Grouped-query attention of a ragged batch over the paged KV cache (`llds_jax.model.paged_kv`).

Token t of sequence s, at cache index position_t, sees the keys of its sequence's cache indices 0 .. position_t: its
cached tokens and its new tokens up to itself (causal within the new tokens). The keys and values of the new tokens
are in the pages already (`paged_kv.write_kv` runs first).

Implementations:
  "kernel": JAX's Pallas ragged paged attention kernel (TPU only; `jax.experimental.pallas.ops.tpu.
    ragged_paged_attention`), called in a `jax.shard_map` over the key/value heads of the current mesh (each chip
    its heads' queries and pages; a Mosaic kernel cannot be partitioned by XLA). Its output at padding tokens is
    unspecified.
  "reference": plain XLA, any backend: each token gathers its sequence's pages through the page table and runs the
    project's dense attention (`attention.dense_attention`, float32 scores and softmax) over them as a batch row of
    one query; padding tokens get zeros. It holds every token's gathered keys and values, [T, M * Z, K, H] each,
    and scores [T, N, M * Z]: for tests and small batches.
Default: the kernel on TPU, the reference elsewhere.

Dimension letters: T ragged batch tokens, S sequences, M pages per sequence, P pool pages (as given: one layer's or
the stacked pool's `paged_kv.layer_view`), Z tokens per page, N query heads, K key/value heads, C = 2K combined
heads, H head size.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as rpa
from jax.sharding import PartitionSpec as P

from llds_jax import parallel
from llds_jax.model import paged_kv
from llds_jax.model.attention import dense_attention

IMPLEMENTATIONS = ("kernel", "reference")
# The kernel's tile when the caller names none: its own untuned default for TPU v4 (JAX's tuned table is read from
# the devices JAX runs on, which a program compiled ahead of time on a CPU does not have).
KERNEL_KV_PAGES_PER_BLOCK = 32
KERNEL_QUERIES_PER_BLOCK = 32


def default_implementation(platform: Optional[str] = None) -> str:
    """"kernel" for TPU programs, else "reference"; platform None: jax.default_backend()."""
    return "kernel" if (platform or jax.default_backend()) == "tpu" else "reference"


def paged_attention(q_tnh: jax.Array, kv_pages_pzch: jax.Array, kv_lens_s: jax.Array, page_indices_sm: jax.Array,
                    cu_q_lens_s1: jax.Array, num_seqs: jax.Array, *, implementation: Optional[str] = None,
                    kv_pages_per_block: Optional[int] = None, queries_per_block: Optional[int] = None
                    ) -> jax.Array:
    """Causal GQA of a ragged batch's queries over their sequences' pages. Returns [T, N, H] in q's dtype.

    Args:
      q_tnh: queries [T, N, H] (RoPE applied), N a multiple of K.
      kv_pages_pzch: pages [P, Z, 2K, H], keys and values interleaved, holding the batch's new keys and values.
      kv_lens_s, page_indices_sm, cu_q_lens_s1, num_seqs: the ragged batch (`paged_kv` module docstring): int32
        [S], [S, M], [S + 1], [1]. Entries of page_indices_sm past a sequence's pages are never attended to.
      implementation: "kernel" or "reference" (module docstring); None: `default_implementation()`.
      kv_pages_per_block, queries_per_block: the kernel's tile (pages of keys, queries) per step; None:
        KERNEL_KV_PAGES_PER_BLOCK and KERNEL_QUERIES_PER_BLOCK, at most M and T. The reference ignores them.
    """
    implementation = implementation or default_implementation()
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"paged attention implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    # JAX's own checks of the shapes and dtypes (ValueError naming the argument), for both implementations.
    rpa.static_validate_inputs(q_tnh, kv_pages_pzch, kv_lens_s, page_indices_sm, cu_q_lens_s1, num_seqs)
    if implementation == "reference":
        return reference_paged_attention(q_tnh, kv_pages_pzch, kv_lens_s, page_indices_sm, cu_q_lens_s1, num_seqs)
    t, m = q_tnh.shape[0], page_indices_sm.shape[1]
    kernel = functools.partial(
        rpa.ragged_paged_attention, sm_scale=q_tnh.shape[-1] ** -0.5,
        num_kv_pages_per_block=min(kv_pages_per_block or KERNEL_KV_PAGES_PER_BLOCK, m),
        num_queries_per_block=min(queries_per_block or KERNEL_QUERIES_PER_BLOCK, t))
    args = (q_tnh, kv_pages_pzch, kv_lens_s, page_indices_sm, cu_q_lens_s1, num_seqs)
    mesh = parallel.current_mesh()
    if mesh is None:
        return kernel(*args)
    heads = parallel.fitted(mesh, kv_pages_pzch.shape[2] // 2, "kv_heads")
    return jax.shard_map(kernel, in_specs=(P(None, heads, None), P(None, None, heads, None), P(), P(), P(), P()),
                         out_specs=P(None, heads, None), check_vma=False)(*args)


def reference_paged_attention(q_tnh: jax.Array, kv_pages_pzch: jax.Array, kv_lens_s: jax.Array,
                              page_indices_sm: jax.Array, cu_q_lens_s1: jax.Array, num_seqs: jax.Array
                              ) -> jax.Array:
    """`paged_attention`'s "reference" implementation (same arguments, without the kernel's tile)."""
    t, n, h = q_tnh.shape
    z, c = kv_pages_pzch.shape[1:3]
    m = page_indices_sm.shape[1]
    seq_t, position_t, _, valid_t = paged_kv.token_layout(cu_q_lens_s1, kv_lens_s, page_indices_sm, num_seqs, t, z)
    # Each token's sequence's pages in order: its cache indices 0 .. M * Z - 1.
    kv_tich = jnp.take(kv_pages_pzch, page_indices_sm[seq_t], axis=0, mode="clip").reshape(t, m * z, c, h)
    query_slot_t1 = jnp.where(valid_t, position_t, -1)[:, None]
    out_t1nh = dense_attention(q_tnh[:, None], kv_tich[:, :, 0::2], kv_tich[:, :, 1::2], query_slot_t1,
                               jnp.ones((t, m * z), bool))
    return jnp.where(valid_t[:, None, None], out_t1nh[:, 0], 0).astype(q_tnh.dtype)
