"""Grouped-query attention: the dense reference, a blockwise (online-softmax) path that never holds [T, T'] scores,
and the fused kernels of TPU (Pallas splash attention) and GPU (cuDNN flash attention) for full forwards.

Which keys a query sees is given by vectors, never by a [B, T, T'] mask: key slot s is visible to query t of row b
iff `key_valid_bt[b, s]` and `query_first_bt[b, t] <= s <= query_slot_bt[b, t]`. A full forward passes query_slot = t
and key_valid = the padding mask (causal over real tokens); a row packed with several trajectories passes
query_first = the first slot of the query's trajectory (its segment), so that no token sees another trajectory's
(query_first defaults to 0). The model calls it for full forwards alone (`Transformer.hidden`); its ragged steps
over the paged KV cache attend through `llds_jax.model.paged_attention`. Both use the online softmax of
`llds_jax.model.online_softmax`.

Dimension letters: B batch, T queries, T' key slots (tokens of the row too, so written t), N query heads, K key/value
heads, G = N / K query heads per key/value head, H head size, J key tiles (of T'k slots) of the blockwise path.

Implementations (`ModelConfig.attention`):
  "xla": dense float32 scores [B, K, G, T, T'] and a softmax over them (the reference).
  "blockwise": flash-style in plain XLA: a scan over query blocks and, inside, over key blocks with a float32
    running max / sum / accumulator; its own backward (recomputing each tile from q, k, v and the row's
    log-sum-exp) so neither pass holds more than one [B, K, G, Tq_block, T'k_block] tile of scores. Tiles that no
    query of the batch can see (above the causal diagonal, before the segments of a packed row, all padding) are
    skipped.
  "splash": JAX's Pallas splash attention kernel (TPU; float32 softmax statistics, its own backward kernels):
    causal mask, padding and the trajectories of a packed row as segment ids (0 padding; a real token's segment:
    its query_first + 1), GQA by the kernel's grouped form, one kernel call per row of each shard (`shard_map` over
    the batch axes and, when they divide the key/value heads, the tensor axis). Off TPU it runs in Pallas
    interpret mode (tests only: slow).
  "cudnn": `jax.nn.dot_product_attention(implementation="cudnn")` (GPU, bfloat16 or float16): each row's real
    tokens are gathered to the front in order (any padding pattern), then causal attention with
    `query_seq_lengths` / `key_value_seq_lengths` = the row's real tokens, scattered back; no mask or bias array.
    It has no segments: a packed row (query_first given) runs blockwise instead.
  "auto": on TPU splash, on GPU with a bfloat16 / float16 model cudnn, for full forwards; everything else (and
    any other platform) blockwise when the dense scores [T, T'] would be larger than one tile
    (T * T' > query_block * key_block), else xla.
Routing (`resolve`): splash and cudnn serve full forwards only (`full_forward`: query t at key slot t of the same
chunk, which `Transformer.hidden` promises); a call that is not one (keys beyond the queries' chunk) takes blockwise
or xla by the tile rule above. A single query runs dense: its scores are one row.

A query that sees no key (a padding row) gets, from xla and blockwise, the dense path's answer: the uniform average
of the values of all T' slots (float32 softmax over T' equal masked scores), with that average's gradient flowing to
v only. Splash and cudnn give every padding query row (key_valid false at its own slot) zeros, with no gradient;
their outputs at real query rows match the dense path's.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as splash
from jax.sharding import PartitionSpec as P

from llds_jax import parallel
from llds_jax.bounds import ConfigError
from llds_jax.config.sections import ATTENTION_CHOICES as CHOICES  # "auto" and IMPLEMENTATIONS
from llds_jax.model.online_softmax import online_softmax_step, tile_scores

IMPLEMENTATIONS = ("xla", "blockwise", "splash", "cudnn")
HALF_DTYPES = ("bfloat16", "float16")  # what cuDNN's flash attention takes

_MASKED = float(jnp.finfo(jnp.float32).min)
_LANES = 128  # splash's block sizes are multiples of the TPU lane width


def resolve(choice: str, num_queries: int, num_keys: int, query_block: int, key_block: int, *,
            full_forward: bool = False, platform: str = "cpu", dtype: str = "float32", segmented: bool = False
            ) -> str:
    """The implementation a call with `num_queries` queries over `num_keys` keys runs under the configured `choice`.

    `full_forward`: query t sits at key slot t of the same chunk (splash and cudnn serve only those); `platform`:
    the backend the program is compiled for ("cpu", "gpu", "tpu"); `dtype`: the compute dtype of q, k, v;
    `segmented`: a packed row (per-query windows), which cudnn cannot express.
    Raises ValueError naming model.attention for cudnn off GPU or in another dtype than bfloat16 / float16.
    """
    if choice not in CHOICES:
        raise ValueError(f"attention implementation must be one of {CHOICES}, got {choice!r}")
    if choice == "cudnn" and platform != "gpu":
        raise ConfigError(f"model.attention='cudnn' needs a GPU (cuDNN flash attention); this program is for "
                          f"platform {platform!r}: use 'auto', 'splash' (TPU), 'blockwise' or 'xla'")
    if choice == "cudnn" and dtype not in HALF_DTYPES:
        raise ConfigError(f"model.attention='cudnn' needs model.dtype in {HALF_DTYPES}, got {dtype!r}")
    if num_queries == 1:
        return "xla"
    if full_forward:
        if choice == "splash" or (choice == "cudnn" and not segmented):
            return choice
        if choice == "auto" and platform == "tpu":
            return "splash"
        if choice == "auto" and platform == "gpu" and dtype in HALF_DTYPES and not segmented:
            return "cudnn"
    if choice in ("xla", "blockwise"):
        return choice
    return "blockwise" if num_queries * num_keys > query_block * key_block else "xla"


def attention(q_btnh: jax.Array, k_btkh: jax.Array, v_btkh: jax.Array, query_slot_bt: jax.Array,
              key_valid_bt: jax.Array, query_first_bt: jax.Array | None = None, *, implementation: str = "xla",
              query_block: int = 512, key_block: int = 512, full_forward: bool = False,
              platform: Optional[str] = None) -> jax.Array:
    """Grouped-query attention with float32 scores and softmax. Returns [B, T, N, H] in q's dtype.

    Args:
      q_btnh: queries [B, T, N, H] (RoPE applied); k_btkh, v_btkh: keys and values [B, T', K, H], N a multiple of K.
      query_slot_bt: int32 [B, T], the key slot of each query: it sees the valid slots up to and including this one
        (-1: sees nothing).
      key_valid_bt: bool [B, T'], the slot holds a real key.
      query_first_bt: int32 [B, T], the first key slot each query may see (its segment's start in a packed row);
        None: 0.
      implementation: "xla" (dense reference), "blockwise", "splash", "cudnn" or "auto" (see `resolve`).
      query_block, key_block: the largest tile (blockwise): T and T' are cut into ceil(T / query_block) and
        ceil(T' / key_block) equal blocks (padded by less than one row per block); splash's blocks (see
        `splash_attention`).
      full_forward: the caller promises T' == T and query_slot_bt[b, t] == t (keys are this chunk's tokens):
        splash and cudnn may run.
      platform: "cpu" / "gpu" / "tpu", the backend the program is compiled for; None: jax.default_backend().
    """
    platform = platform or jax.default_backend()
    impl = resolve(implementation, q_btnh.shape[1], k_btkh.shape[1], query_block, key_block,
                   full_forward=full_forward, platform=platform, dtype=jnp.dtype(q_btnh.dtype).name,
                   segmented=query_first_bt is not None)
    if impl == "xla":
        return dense_attention(q_btnh, k_btkh, v_btkh, query_slot_bt, key_valid_bt, query_first_bt)
    if impl == "splash":
        return splash_attention(q_btnh, k_btkh, v_btkh, key_valid_bt, query_first_bt, query_block=query_block,
                                key_block=key_block, interpret=platform != "tpu")
    if impl == "cudnn":
        return fused_attention(q_btnh, k_btkh, v_btkh, key_valid_bt, implementation="cudnn")
    return blockwise_attention(q_btnh, k_btkh, v_btkh, query_slot_bt, key_valid_bt, query_first_bt,
                               query_block=query_block, key_block=key_block)


def _first_or_zero(query_first_bt, query_slot_bt):
    return jnp.zeros_like(query_slot_bt) if query_first_bt is None else query_first_bt.astype(jnp.int32)


def dense_attention(q_btnh, k_btkh, v_btkh, query_slot_bt, key_valid_bt, query_first_bt=None) -> jax.Array:
    """The reference: full float32 scores [B, K, G, T, T'], masked to float32's lowest value, softmax over T'."""
    b, t, n, h = q_btnh.shape
    s, k = k_btkh.shape[1], k_btkh.shape[2]
    index_s = jnp.arange(s, dtype=jnp.int32)[None, None, :]
    first_bt = _first_or_zero(query_first_bt, query_slot_bt)
    visible_btt = (key_valid_bt[:, None, :] & (index_s <= query_slot_bt[:, :, None])
                   & (index_s >= first_bt[:, :, None]))
    q_btkgh = q_btnh.reshape(b, t, k, n // k, h)
    scores = jnp.einsum("btkgh,bskh->bkgts", q_btkgh, k_btkh, preferred_element_type=jnp.float32)
    scores = scores * (h ** -0.5)
    scores = jnp.where(visible_btt[:, None, None, :, :], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgts,bskh->btkgh", probs.astype(v_btkh.dtype), v_btkh)
    return out.reshape(b, t, n, h)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def splash_block(block: int, length: int) -> int:
    """Splash's block along a sequence of `length` tokens: `block` (attention_query_block / attention_key_block)
    rounded up to a multiple of 128 (the TPU lane width, which the kernel requires), at most `length` rounded up
    to 128."""
    if block < 1:
        raise ValueError(f"attention block size must be >= 1, got {block}")
    return min(_round_up(block, _LANES), _round_up(length, _LANES))


def splash_attention(q_btnh, k_btkh, v_btkh, key_valid_bt, query_first_bt=None, *, query_block: int = 512,
                     key_block: int = 512, interpret: bool = False) -> jax.Array:
    """Causal self-attention over one chunk (query t at key slot t, sees the real keys query_first <= s <= t)
    through the Pallas splash kernel. Returns [B, T, N, H] in q's dtype; a padding query row (key_valid_bt false)
    is zeros.

    Args:
      q_btnh: [B, T, N, H]; k_btkh, v_btkh: [B, T, K, H]; key_valid_bt: bool [B, T], the token is real.
      query_first_bt: int32 [B, T] the first token of each token's segment in a packed row (None: one segment).
      query_block, key_block: see `splash_block` (the forward, dq and dkv kernels all use these); T is padded
        inside, as padding, to a multiple of both.
      interpret: run the kernel in Pallas interpret mode (any backend; for tests).
    """
    b, t, n, h = q_btnh.shape
    if k_btkh.shape[:2] != (b, t) or v_btkh.shape != k_btkh.shape or key_valid_bt.shape != (b, t):
        raise ValueError(f"splash attention is self-attention over one chunk: q {q_btnh.shape}, k {k_btkh.shape}, "
                         f"v {v_btkh.shape}, key_valid {key_valid_bt.shape}")
    bq, bk = splash_block(query_block, t), splash_block(key_block, t)
    length = _round_up(t, math.lcm(bq, bk))
    pad_btnh = ((0, 0), (0, length - t), (0, 0), (0, 0))
    # 0 padding; a real token: its segment's first index + 1 (one segment, 1, without query_first_bt).
    segment_bt = jnp.where(key_valid_bt, 1 + _first_or_zero(query_first_bt, jnp.zeros((b, t), jnp.int32)), 0)
    segment_bt = jnp.pad(segment_bt, ((0, 0), (0, length - t)))
    scaled_q_btnh = (q_btnh.astype(jnp.float32) * h ** -0.5).astype(q_btnh.dtype)  # the kernel does not scale
    q_bnth, k_bkth, v_bkth = (jnp.pad(x, pad_btnh).transpose(0, 2, 1, 3) for x in (scaled_q_btnh, k_btkh, v_btkh))
    sizes = splash.BlockSizes(block_q=bq, block_kv=bk, block_kv_compute=bk, block_q_dkv=bq, block_kv_dkv=bk,
                              block_kv_dkv_compute=bk, block_q_dq=bq, block_kv_dq=bk)
    out_bnth = _per_shard(functools.partial(_splash_rows, block_sizes=sizes, interpret=interpret),
                          q_bnth, k_bkth, v_bkth, segment_bt)
    out_btnh = out_bnth.transpose(0, 2, 1, 3)[:, :t]
    return jnp.where(key_valid_bt[:, :, None, None], out_btnh, 0).astype(q_btnh.dtype)


def _splash_rows(q_bnth, k_bkth, v_bkth, segment_bt, *, block_sizes, interpret):
    """The splash kernel (causal, GQA) on each row of (one shard's) [B, N | K, T, H] arrays."""
    n, length = q_bnth.shape[1], q_bnth.shape[2]
    mask = splash.MultiHeadMask([splash.CausalMask((length, length))] * n)
    kernel = splash.make_splash_mha_single_device(mask, block_sizes=block_sizes, interpret=interpret)

    def row(q_nth, k_kth, v_kth, segment_t):
        return kernel(q_nth, k_kth, v_kth, segment_ids=splash.SegmentIds(q=segment_t, kv=segment_t))

    return jax.vmap(row)(q_bnth, k_bkth, v_bkth, segment_bt)


def _per_shard(fn, q_bnth, k_bkth, v_bkth, segment_bt):
    """fn on each shard under the current mesh (jax.set_mesh): rows split as "batch" and heads as "kv_heads" (the
    query heads with their key/value heads), each where it divides (else whole); fn alone without a mesh. A Pallas
    kernel is opaque to XLA's partitioner, which would otherwise gather every operand onto each chip."""
    mesh = parallel.current_mesh()
    if mesh is None:
        return fn(q_bnth, k_bkth, v_bkth, segment_bt)
    rows = parallel.fitted(mesh, q_bnth.shape[0], "batch")
    heads = parallel.fitted(mesh, k_bkth.shape[1], "kv_heads")
    return jax.shard_map(fn, in_specs=(P(rows, heads), P(rows, heads), P(rows, heads), P(rows)),
                         out_specs=P(rows, heads), check_vma=False)(q_bnth, k_bkth, v_bkth, segment_bt)


def fused_attention(q_btnh, k_btkh, v_btkh, key_valid_bt, *, implementation: str = "cudnn") -> jax.Array:
    """Causal self-attention over one chunk (query t at key slot t, sees the real keys s <= t) through
    `jax.nn.dot_product_attention`. Returns [B, T, N, H] in q's dtype; a padding query row is zeros.

    Each row's real tokens are gathered to its front in order (any padding pattern: left, right, inside), so that
    causal attention limited by `query_seq_lengths` = `key_value_seq_lengths` = the row's real tokens is exactly
    "real keys s <= t"; no [T, T'] mask or bias is built. The outputs are scattered back to their slots.

    Args:
      q_btnh: [B, T, N, H]; k_btkh, v_btkh: [B, T, K, H]; key_valid_bt: bool [B, T], the token is real.
      implementation: "cudnn" (GPU, bfloat16 / float16); "xla" runs the same arguments through JAX's reference
        (tests of the plumbing on CPU).
    """
    h = q_btnh.shape[-1]
    order_bt = jnp.argsort(~key_valid_bt, axis=1, stable=True)  # real tokens first, in their order
    real_b = jnp.sum(key_valid_bt, axis=1, dtype=jnp.int32)

    def gather(x_bt__, index_bt):
        return jnp.take_along_axis(x_bt__, index_bt[:, :, None, None], axis=1)

    out_btnh = jax.nn.dot_product_attention(
        gather(q_btnh, order_bt), gather(k_btkh, order_bt), gather(v_btkh, order_bt), scale=h ** -0.5,
        is_causal=True, query_seq_lengths=real_b, key_value_seq_lengths=real_b, implementation=implementation)
    out_btnh = gather(out_btnh, jnp.argsort(order_bt, axis=1))
    return jnp.where(key_valid_bt[:, :, None, None], out_btnh, 0).astype(q_btnh.dtype)


def blocks(length: int, block: int) -> tuple[int, int]:
    """(number of blocks, block size): `length` cut into ceil(length / block) equal blocks of at most `block`."""
    if block < 1:
        raise ValueError(f"attention block size must be >= 1, got {block}")
    count = -(-length // block)
    return count, -(-length // count)


def blockwise_attention(q_btnh, k_btkh, v_btkh, query_slot_bt, key_valid_bt, query_first_bt=None, *,
                        query_block: int = 512, key_block: int = 512) -> jax.Array:
    """Online-softmax attention over [query block, key block] tiles; same arguments and result as `attention`."""
    b, t, n, h = q_btnh.shape
    s, k = k_btkh.shape[1], k_btkh.shape[2]
    if v_btkh.shape != k_btkh.shape or n % k or query_slot_bt.shape != (b, t) or key_valid_bt.shape != (b, s):
        raise ValueError(f"attention shapes: q {q_btnh.shape}, k {k_btkh.shape}, v {v_btkh.shape}, "
                         f"query_slot {query_slot_bt.shape}, key_valid {key_valid_bt.shape}")
    query_first_bt = _first_or_zero(query_first_bt, query_slot_bt)
    if query_first_bt.shape != (b, t):
        raise ValueError(f"attention shapes: query_first {query_first_bt.shape}, expected {(b, t)}")
    # The window [first, slot] of each query as one int32 array [2, B, T].
    window_wbt = jnp.stack([query_first_bt, query_slot_bt.astype(jnp.int32)])
    return _blockwise(q_btnh, k_btkh, v_btkh, window_wbt, key_valid_bt.astype(bool), blocks(t, query_block),
                      blocks(s, key_block))


# Internal layout: queries [nq, B, Tq, K, G, H], their windows [nq, 2, B, Tq] (first, slot), keys / values
# [nk, B, T'k, K, H], per-row statistics [nq, B, K, G, Tq].

def _query_blocks(q_btnh, dout_btnh, window_wbt, k: int, qb: tuple[int, int]):
    nq, tq = qb
    b, t, n, h = q_btnh.shape
    pad = nq * tq - t

    def split(x):  # [B, T, N, H] -> [nq, B, Tq, K, G, H]
        x = jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0)))
        return x.reshape(b, nq, tq, k, n // k, h).swapaxes(0, 1)

    window = jnp.pad(window_wbt, ((0, 0), (0, 0), (0, pad)), constant_values=-1)  # padding queries see nothing
    return split(q_btnh), None if dout_btnh is None else split(dout_btnh), window.reshape(2, b, nq, tq).transpose(
        2, 0, 1, 3)


def _key_blocks(k_btkh, v_btkh, key_valid_bt, kb: tuple[int, int]):
    nk, sk = kb
    b, s, k, h = k_btkh.shape
    pad = nk * sk - s

    def split(x):  # [B, T', K, H] -> [nk, B, T'k, K, H]
        return jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(b, nk, sk, k, h).swapaxes(0, 1)

    valid = jnp.pad(key_valid_bt, ((0, 0), (0, pad))).reshape(b, nk, sk).swapaxes(0, 1)
    return split(k_btkh), split(v_btkh), valid


def _active_tiles(window_qwbt, valid_jbt) -> jax.Array:
    """bool [nq, nk]: in some row of the batch, key block j holds a valid key inside the span of query block i's
    windows (a superset of the tiles where some query sees some key)."""
    nk, _, sk = valid_jbt.shape
    index_j1t = jnp.arange(nk * sk, dtype=jnp.int32).reshape(nk, 1, sk)
    first_valid_jb = jnp.min(jnp.where(valid_jbt, index_j1t, jnp.iinfo(jnp.int32).max), axis=-1)
    last_valid_jb = jnp.max(jnp.where(valid_jbt, index_j1t, -1), axis=-1)
    seeing_qwbt = window_qwbt[:, 1:] >= window_qwbt[:, :1]  # queries with a non-empty window
    first_qb = jnp.min(jnp.where(seeing_qwbt[:, 0], window_qwbt[:, 0], jnp.iinfo(jnp.int32).max), axis=-1)
    last_slot_qb = jnp.max(jnp.where(seeing_qwbt[:, 0], window_qwbt[:, 1], -1), axis=-1)
    return jnp.any((first_valid_jb[None, :, :] <= last_slot_qb[:, None, :])
                   & (last_valid_jb[None, :, :] >= first_qb[:, None, :]), axis=-1)


def _forward(q_btnh, k_btkh, v_btkh, window_wbt, key_valid_bt, qb, kb):
    """Returns (out [B, T, N, H] in q's dtype, log-sum-exp [nq, B, K, G, Tq] float32: +inf on rows with no key)."""
    b, t, n, h = q_btnh.shape
    k = k_btkh.shape[2]
    scale = h ** -0.5
    # Inside a scan (the layer stack) whose gradient is taken, JAX hoists what depends only on the scan's
    # invariants (here the mask vectors) out of the loop and stacks it over every tile: [nq, nk, B, K, G, Tq, T'k]
    # masks and -inf fills, the very [T, T'] buffers this path avoids. Tying the vectors to q keeps them in the loop.
    q_btnh, k_btkh, v_btkh, window_wbt, key_valid_bt = jax.lax.optimization_barrier(
        (q_btnh, k_btkh, v_btkh, window_wbt, key_valid_bt))
    q_blocks, _, window_blocks = _query_blocks(q_btnh, None, window_wbt, k, qb)
    k_blocks, v_blocks, valid_blocks = _key_blocks(k_btkh, v_btkh, key_valid_bt, kb)
    active = _active_tiles(window_blocks, valid_blocks)
    sk = kb[1]
    # A query that sees no key: the dense path's uniform softmax over all T' slots.
    uniform_bkh = jnp.mean(v_btkh.astype(jnp.float32), axis=1)

    def query_block(_, xs):
        q_i, window_i, active_i = xs
        stats = jnp.full((b, k, n // k, q_i.shape[1]), -jnp.inf, jnp.float32)
        init = (stats, jnp.zeros_like(stats), jnp.zeros(stats.shape + (h,), jnp.float32))

        def key_block(carry, ys):
            k_j, v_j, valid_j, j, active_ij = ys

            def update(carry):
                return online_softmax_step(carry, tile_scores(q_i, k_j, window_i, valid_j, j * sk, scale), v_j)

            return jax.lax.cond(active_ij, update, lambda c: c, carry), None

        (m, l, acc), _ = jax.lax.scan(key_block, init, (k_blocks, v_blocks, valid_blocks, jnp.arange(kb[0]),
                                                         active_i))
        seen = l > 0
        out = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None], uniform_bkh[:, :, None, None, :])
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), jnp.inf)
        return None, (out.astype(q_btnh.dtype).transpose(0, 3, 1, 2, 4), lse)  # out [B, Tq, K, G, H]

    _, (out, lse) = jax.lax.scan(query_block, None, (q_blocks, window_blocks, active))
    out = out.swapaxes(0, 1).reshape(b, qb[0] * qb[1], n, h)[:, :t]
    return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _blockwise(q_btnh, k_btkh, v_btkh, window_wbt, key_valid_bt, qb, kb):
    return _forward(q_btnh, k_btkh, v_btkh, window_wbt, key_valid_bt, qb, kb)[0]


def _blockwise_fwd(q_btnh, k_btkh, v_btkh, window_wbt, key_valid_bt, qb, kb):
    out, lse = _forward(q_btnh, k_btkh, v_btkh, window_wbt, key_valid_bt, qb, kb)
    return out, (q_btnh, k_btkh, v_btkh, window_wbt, key_valid_bt, out, lse)


def _blockwise_bwd(qb, kb, residuals, dout_btnh):
    """Flash-attention backward: per tile p = exp(scores - lse), dv += p^T dO, ds = p (dO v^T - rowsum(dO O)),
    dq += ds k, dk += ds^T q; an outer scan over key blocks (dk, dv of the block accumulate inside), an inner one
    over query blocks (dq, float32, carried whole)."""
    q_btnh, k_btkh, v_btkh, window_wbt, key_valid_bt, out_btnh, lse = residuals
    b, t, n, h = q_btnh.shape
    s, k = k_btkh.shape[1], k_btkh.shape[2]
    scale = h ** -0.5
    q_blocks, dout_blocks, window_blocks = _query_blocks(q_btnh, dout_btnh, window_wbt, k, qb)
    _, o_blocks, _ = _query_blocks(q_btnh, out_btnh, window_wbt, k, qb)
    k_blocks, v_blocks, valid_blocks = _key_blocks(k_btkh, v_btkh, key_valid_bt, kb)
    active = _active_tiles(window_blocks, valid_blocks)
    sk = kb[1]
    # rowsum(dO * O) per query row [nq, B, K, G, Tq].
    delta = jnp.einsum("qbtkgh,qbtkgh->qbkgt", dout_blocks.astype(jnp.float32), o_blocks.astype(jnp.float32))

    def key_block(dq, xs):
        k_j, v_j, valid_j, j, active_j = xs
        zeros = jnp.zeros(k_j.shape, jnp.float32)

        def query_block(carry, ys):
            q_i, do_i, window_i, lse_i, delta_i, dq_i, active_ij = ys

            def update(args):
                (dk_j, dv_j), dq_i = args
                scores = tile_scores(q_i, k_j, window_i, valid_j, j * sk, scale)
                p = jnp.exp(scores - lse_i[..., None])
                dv_j = dv_j + jnp.einsum("bkgts,btkgh->bskh", p.astype(do_i.dtype), do_i,
                                         preferred_element_type=jnp.float32)
                dp = jnp.einsum("btkgh,bskh->bkgts", do_i, v_j, preferred_element_type=jnp.float32)
                ds = p * (dp - delta_i[..., None]) * scale
                dq_i = dq_i + jnp.einsum("bkgts,bskh->btkgh", ds.astype(k_j.dtype), k_j,
                                         preferred_element_type=jnp.float32)
                dk_j = dk_j + jnp.einsum("bkgts,btkgh->bskh", ds.astype(q_i.dtype), q_i,
                                         preferred_element_type=jnp.float32)
                return (dk_j, dv_j), dq_i

            carry, dq_i = jax.lax.cond(active_ij, update, lambda a: a, (carry, dq_i))
            return carry, dq_i

        (dk_j, dv_j), dq = jax.lax.scan(query_block, (zeros, zeros), (
            q_blocks, dout_blocks, window_blocks, lse, delta, dq, active_j))
        return dq, (dk_j, dv_j)

    dq0 = jnp.zeros(q_blocks.shape, jnp.float32)
    dq, (dk, dv) = jax.lax.scan(key_block, dq0, (k_blocks, v_blocks, valid_blocks, jnp.arange(kb[0]), active.T))
    dq = dq.swapaxes(0, 1).reshape(b, qb[0] * qb[1], n, h)[:, :t]
    dk = dk.swapaxes(0, 1).reshape(b, kb[0] * kb[1], k, h)[:, :s]
    dv = dv.swapaxes(0, 1).reshape(b, kb[0] * kb[1], k, h)[:, :s]
    # Rows with no key took the uniform average of all T' values: their cotangent reaches every v by 1 / T'.
    no_key = jnp.isinf(lse)
    d_uniform_bkh = jnp.einsum("qbkgt,qbtkgh->bkh", no_key.astype(jnp.float32), dout_blocks.astype(jnp.float32)) / s
    dv = dv + d_uniform_bkh[:, None]
    return (dq.astype(q_btnh.dtype), dk.astype(k_btkh.dtype), dv.astype(v_btkh.dtype), None, None)


_blockwise.defvjp(_blockwise_fwd, _blockwise_bwd)
