"""Grouped-query attention of a ragged batch over the paged KV cache (`llds_jax.model.paged_kv`).

Token t of sequence s, at cache index position_t, sees the keys of its sequence's cache indices 0 .. position_t: its
cached tokens and its new tokens up to itself (causal within the new tokens). The keys and values of the new tokens
are in the pages already (`paged_kv.write_kv` runs first).

Implementations:
  "kernel": JAX's Pallas ragged paged attention kernel (TPU only; `jax.experimental.pallas.ops.tpu.
    ragged_paged_attention`), called in a `jax.shard_map` over the key/value heads of the current mesh (each chip
    its heads' queries and pages; a Mosaic kernel cannot be partitioned by XLA). Its output at padding tokens is
    unspecified.
  "reference": plain XLA, any backend (the engine's path on CPU): the tokens in chunks of `queries_per_block`, and for
    each chunk its tokens' pages in blocks of `kv_pages_per_block` with a float32 online softmax (running max, sum and
    accumulator; `llds_jax.model.online_softmax`, as in `attention.blockwise_attention`). Each block gathers, per token,
    only that block's pages of its sequence ([Tq, pages * Z, K', H]); GQA groups the query heads over their key/value
    head, never repeating it. The block loop's trip count is known only at run time: the blocks up to the chunk's
    furthest cache index, so a batch of short sequences reads few pages whatever the page table's width (M * Z slots).
    What it computes is the dense attention of each token over its sequence's cache indices 0 .. position_t
    (`attention.dense_attention`, float32 scores and softmax), up to float rounding; padding tokens get zeros.
Default: the kernel on TPU, the reference elsewhere.

Dimension letters: T ragged batch tokens, S sequences, M pages per sequence, P pool pages (as given: one layer's or
the stacked pool's `paged_kv.layer_view`), Z tokens per page, N query heads, K key/value heads (K' = 2K: keys and
values interleaved, written k), H head size; in the reference, Q query chunks of Tq tokens and key blocks of T'k
cache slots (tokens, written t).
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
from llds_jax.model.online_softmax import online_softmax_step, tile_scores

IMPLEMENTATIONS = ("kernel", "reference")
# The kernel's tile when the caller names none: its own untuned default for TPU v4 (JAX's tuned table is read from
# the devices JAX runs on, which a program compiled ahead of time on a CPU does not have).
KERNEL_KV_PAGES_PER_BLOCK = 32
KERNEL_QUERIES_PER_BLOCK = 32
# The reference's tile when the caller names none: key blocks of about 64 cache slots (at least one page) and
# chunks of 32 query tokens, so that a tile's gathered keys and values ([32, 64, K', H], 1 MiB at K' = 4, H = 32 in
# float32) stay in a CPU core's L2 cache (bench/paged_reference.py measured 16 to 256 slots, 16 to 64 tokens).
REFERENCE_BLOCK_SLOTS = 64
KERNEL_HEAD_LANES = 128  # the kernel takes heads of a multiple of this many lanes
REFERENCE_QUERIES_PER_BLOCK = 32


def default_implementation(platform: Optional[str] = None, head_dim: int = KERNEL_HEAD_LANES) -> str:
    """"kernel" for TPU programs whose heads the kernel's tiles take (a multiple of 128 lanes: Qwen2.5's and
    Llama-3's 128), else "reference" (other platforms, and tiny test architectures on TPU); platform None:
    jax.default_backend()."""
    tpu = (platform or jax.default_backend()) == "tpu"
    return "kernel" if tpu and head_dim % KERNEL_HEAD_LANES == 0 else "reference"


def paged_attention(q_tnh: jax.Array, kv_pages_pzkh: jax.Array, kv_lens_s: jax.Array, page_indices_sm: jax.Array,
                    cu_q_lens_s1: jax.Array, num_seqs: jax.Array, *, implementation: Optional[str] = None,
                    kv_pages_per_block: Optional[int] = None, queries_per_block: Optional[int] = None
                    ) -> jax.Array:
    """Causal GQA of a ragged batch's queries over their sequences' pages. Returns [T, N, H] in q's dtype.

    Args:
      q_tnh: queries [T, N, H] (RoPE applied), N a multiple of K.
      kv_pages_pzkh: pages [P, Z, 2K, H], keys and values interleaved, holding the batch's new keys and values.
      kv_lens_s, page_indices_sm, cu_q_lens_s1, num_seqs: the ragged batch (`paged_kv` module docstring): int32
        [S], [S, M], [S + 1], [1]. Entries of page_indices_sm past a sequence's pages are never attended to.
      implementation: "kernel" or "reference" (module docstring); None: `default_implementation()`.
      kv_pages_per_block, queries_per_block: the tile (pages of keys, queries) per step; None: for the kernel
        KERNEL_KV_PAGES_PER_BLOCK and KERNEL_QUERIES_PER_BLOCK, for the reference REFERENCE_BLOCK_SLOTS // Z
        pages (at least 1) and REFERENCE_QUERIES_PER_BLOCK; at most M and T.
    """
    return batched_paged_attention(q_tnh[None], kv_pages_pzkh, kv_lens_s[None], page_indices_sm[None],
                                   cu_q_lens_s1[None], num_seqs[None], implementation=implementation,
                                   kv_pages_per_block=kv_pages_per_block, queries_per_block=queries_per_block)[0]


def batched_paged_attention(q_btnh: jax.Array, kv_pages_pzkh: jax.Array, kv_lens_bs: jax.Array,
                            page_indices_bsm: jax.Array, cu_q_lens_bs1: jax.Array, num_seqs_b1: jax.Array, *,
                            implementation: Optional[str] = None, kv_pages_per_block: Optional[int] = None,
                            queries_per_block: Optional[int] = None) -> jax.Array:
    """`paged_attention` of B ragged batches over one pool (B the leading axis of every batch argument; each
    batch's page table names pages anywhere in the pool): one kernel call per batch. Returns [B, T, N, H].

    Under a mesh the kernel runs in a `jax.shard_map` over the key/value heads and, where they divide B, the
    "batch" axes: each chip makes the calls of its own batches over its own heads, so tensor-parallel groups split
    over data attend each to its own sequences (`Transformer.batched_ragged_step`).
    """
    implementation = implementation or default_implementation(head_dim=q_btnh.shape[-1])
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"paged attention implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    batches = (kv_lens_bs, page_indices_bsm, cu_q_lens_bs1, num_seqs_b1)
    # JAX's own checks of one batch's shapes and dtypes (ValueError naming the argument), for both implementations.
    rpa.static_validate_inputs(_one_batch(q_btnh), kv_pages_pzkh, *map(_one_batch, batches))
    if implementation == "reference":
        return jnp.stack([reference_paged_attention(q_btnh[g], kv_pages_pzkh, *(a[g] for a in batches),
                                                    kv_pages_per_block=kv_pages_per_block,
                                                    queries_per_block=queries_per_block)
                          for g in range(q_btnh.shape[0])])
    t, m = q_btnh.shape[1], page_indices_bsm.shape[2]
    kernel = functools.partial(
        rpa.ragged_paged_attention, sm_scale=q_btnh.shape[-1] ** -0.5,
        num_kv_pages_per_block=min(kv_pages_per_block or KERNEL_KV_PAGES_PER_BLOCK, m),
        num_queries_per_block=min(queries_per_block or KERNEL_QUERIES_PER_BLOCK, t))

    def each(q_btnh, pages, *batches):  # the kernel call of every batch given, in order
        return jnp.stack([kernel(q_btnh[g], pages, *(a[g] for a in batches)) for g in range(q_btnh.shape[0])])

    mesh = parallel.current_mesh()
    if mesh is None:
        return each(q_btnh, kv_pages_pzkh, *batches)
    heads = parallel.fitted(mesh, kv_pages_pzkh.shape[2] // 2, "kv_heads")
    rows = parallel.fitted(mesh, q_btnh.shape[0], "batch")
    return jax.shard_map(each, in_specs=(P(rows, None, heads, None), P(None, None, heads, None), *[P(rows)] * 4),
                         out_specs=P(rows, None, heads, None), check_vma=False)(q_btnh, kv_pages_pzkh, *batches)


def _one_batch(a_b: jax.Array) -> jax.ShapeDtypeStruct:
    """The shape and dtype of one batch of a batched argument (its leading B axis dropped)."""
    return jax.ShapeDtypeStruct(a_b.shape[1:], a_b.dtype)


def reference_paged_attention(q_tnh: jax.Array, kv_pages_pzkh: jax.Array, kv_lens_s: jax.Array,
                              page_indices_sm: jax.Array, cu_q_lens_s1: jax.Array, num_seqs: jax.Array, *,
                              kv_pages_per_block: Optional[int] = None, queries_per_block: Optional[int] = None
                              ) -> jax.Array:
    """`paged_attention`'s "reference" implementation (same arguments; the tile's defaults: REFERENCE_BLOCK_SLOTS
    and REFERENCE_QUERIES_PER_BLOCK). Blocks past a chunk's furthest cache index are never read; inside a block,
    slots past a token's own index (and so past its sequence's kv_len, and page table entries past its pages) get
    probability 0."""
    t, n, h = q_tnh.shape
    z, c = kv_pages_pzkh.shape[1:3]
    k, m = c // 2, page_indices_sm.shape[1]
    pages_per_block = min(kv_pages_per_block or max(1, REFERENCE_BLOCK_SLOTS // z), m)
    tq = min(queries_per_block or REFERENCE_QUERIES_PER_BLOCK, t)
    num_blocks, num_chunks, sk = -(-m // pages_per_block), -(-t // tq), pages_per_block * z
    seq_t, position_t, _, valid_t = paged_kv.token_layout(cu_q_lens_s1, kv_lens_s, page_indices_sm, num_seqs, t, z)
    pad = num_chunks * tq - t  # padding tokens to whole chunks: they see nothing
    last_t = jnp.pad(jnp.where(valid_t, position_t, -1), (0, pad), constant_values=-1)  # the last index it sees
    # Each token's sequence's page table, padded to whole blocks (page 0: its slots lie past every token's index).
    table_tm = jnp.pad(page_indices_sm, ((0, 0), (0, num_blocks * pages_per_block - m)))[seq_t]
    table_qtm = jnp.pad(table_tm, ((0, pad), (0, 0))).reshape(num_chunks, tq, -1)
    q_qt1kgh = jnp.pad(q_tnh, ((0, pad), (0, 0), (0, 0))).reshape(num_chunks, tq, 1, k, n // k, h)

    def query_chunk(xs):
        # One chunk as a batch of tq rows of one query each, in the layout of attention's online-softmax helpers.
        q_t1kgh, last_t, table_tm = xs
        window_wt1 = jnp.stack([jnp.zeros_like(last_t), last_t])[:, :, None]  # sees cache indices 0 .. last
        all_slots_tt = jnp.ones((tq, sk), bool)

        def key_block(j, carry):
            pages_tm = jax.lax.dynamic_slice_in_dim(table_tm, j * pages_per_block, pages_per_block, axis=1)
            kv_pages = jnp.take(kv_pages_pzkh, pages_tm, axis=0, mode="clip").reshape(tq, sk, k, 2, h)
            k_ttkh, v_ttkh = jnp.moveaxis(kv_pages, 3, 0)  # interleaved: each head's key, then its value
            scores = tile_scores(q_t1kgh, k_ttkh, window_wt1, all_slots_tt, j * sk, h ** -0.5)
            return online_softmax_step(carry, scores, v_ttkh)

        count = jnp.minimum(jnp.max(last_t) // sk + 1, num_blocks)  # 0 for a chunk of padding
        stats = jnp.full((tq, k, n // k, 1), -jnp.inf, jnp.float32)
        _, l, acc = jax.lax.fori_loop(0, count, key_block, (stats, jnp.zeros_like(stats),
                                                            jnp.zeros(stats.shape + (h,), jnp.float32)))
        return (acc / jnp.where(l > 0, l, 1.0)[..., None]).reshape(tq, n, h)

    out_tnh = jax.lax.map(query_chunk, (q_qt1kgh, last_t.reshape(num_chunks, tq), table_qtm))
    out_tnh = out_tnh.reshape(num_chunks * tq, n, h)[:t]
    return jnp.where(valid_t[:, None, None], out_tnh, 0).astype(q_tnh.dtype)
