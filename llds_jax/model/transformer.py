"""The Qwen2/Qwen2.5/Llama-3.x decoder in Flax NNX.

Layer parameters are stacked along a leading layer axis L so the stack runs under `lax.scan` (compile time
independent of depth) or, with `scan_layers=False`, as an unrolled Python loop over the same arrays.

Dimension letters: B batch, T tokens, D hidden, N query heads, K key/value heads,
G = N / K query heads per key/value head, H head size, F MLP width, V vocabulary, L layers. `ragged_step` (one
ragged batch over the paged KV cache) uses the paged cache's letters (`llds_jax.model.paged_kv`);
`batched_ragged_step` reads B as its ragged batches, U as every batch's tokens (or sequences) one batch after the
other, R as the shards of the layers' rows.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from llds_jax import parallel
from llds_jax.model import mlp as mlp_lib
from llds_jax.model import paged_kv
from llds_jax.model.attention import attention
from llds_jax.model.paged_attention import default_implementation, batched_paged_attention
from llds_jax.model import rope as rope_lib
from llds_jax.model.vocab import embed_lookup
from llds_jax.model.config import ModelConfig

# The parameters the model reads only in its compute dtype (each cast at use): the matmul weights and the q/k/v
# biases. The embedding (looked up, then cast) and the norms (read in float32) are not among them.
COMPUTE_DTYPE_PARAMS = frozenset({"q_proj", "k_proj", "v_proj", "q_bias", "k_bias", "v_bias", "o_proj",
                                  "gate_proj", "up_proj", "down_proj", "lm_head"})


def compute_weights(params: nnx.State, dtype: str) -> nnx.State:
    """`params` (the model's nnx.Param state) with the `COMPUTE_DTYPE_PARAMS` cast to the compute `dtype` once.

    A forward on the result computes what it computes on `params` (the model's own casts become no-ops), and the
    gradient with respect to the cast weights is the cotangent those casts pass back, before its conversion to the
    parameter dtype: the same values, held in the compute dtype (in bfloat16, half the bytes of float32).
    """
    def cast(path, x):
        names = {key.key for key in path if isinstance(key, jax.tree_util.DictKey)}
        return x.astype(dtype) if names & COMPUTE_DTYPE_PARAMS else x

    return jax.tree_util.tree_map_with_path(cast, params)


def rms_norm(x_btd: jax.Array, weight_d: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in float32, returned in x's dtype (scaled by weight)."""
    x = x_btd.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    return (weight_d.astype(jnp.float32) * x).astype(x_btd.dtype)


def _init(rngs: nnx.Rngs, shape, dtype, kind: str, std: float = 0.02) -> nnx.Param:
    """Ones, zeros, or ("normal") N(0, std^2) entries (std: the config's initializer_range)."""
    if kind == "ones":
        return nnx.Param(jnp.ones(shape, dtype))
    if kind == "zeros":
        return nnx.Param(jnp.zeros(shape, dtype))
    return nnx.Param(std * jax.random.normal(rngs.params(), shape, dtype))


class DecoderLayers(nnx.Module):
    """All decoder blocks, parameters stacked on a leading layer axis L."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        L, D, N, K, H, F = (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                            cfg.intermediate_size)
        pd = jnp.dtype(cfg.param_dtype)
        self.attn_norm = _init(rngs, (L, D), pd, "ones")
        self.q_proj = _init(rngs, (L, D, N, H), pd, "normal", cfg.initializer_range)
        self.k_proj = _init(rngs, (L, D, K, H), pd, "normal", cfg.initializer_range)
        self.v_proj = _init(rngs, (L, D, K, H), pd, "normal", cfg.initializer_range)
        if cfg.qkv_bias:
            self.q_bias = _init(rngs, (L, N, H), pd, "zeros")
            self.k_bias = _init(rngs, (L, K, H), pd, "zeros")
            self.v_bias = _init(rngs, (L, K, H), pd, "zeros")
        self.o_proj = _init(rngs, (L, N, H, D), pd, "normal", cfg.initializer_range)
        self.mlp_norm = _init(rngs, (L, D), pd, "ones")
        self.gate_proj = _init(rngs, (L, D, F), pd, "normal", cfg.initializer_range)
        self.up_proj = _init(rngs, (L, D, F), pd, "normal", cfg.initializer_range)
        self.down_proj = _init(rngs, (L, F, D), pd, "normal", cfg.initializer_range)

    def arrays(self) -> dict[str, jax.Array]:
        """The stacked layer parameters as a dict of arrays (the scan operand)."""
        return {name: var.get_value() for name, var in vars(self).items() if isinstance(var, nnx.Param)}


def _compute_weights(cfg: ModelConfig, p: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """One layer's parameters cast to the compute dtype."""
    dt = jnp.dtype(cfg.dtype)
    return {name: a.astype(dt) for name, a in p.items()}


def _qkv(cfg: ModelConfig, x_btd, p, w, cos_bth, sin_bth):
    """The attention inputs of a decoder block: queries [B, T, N, H], keys and values [B, T, K, H] of the normed
    x_btd (RoPE applied to queries and keys); p the layer's parameters, w the same cast to the compute dtype."""
    h = rms_norm(x_btd, p["attn_norm"], cfg.rms_norm_eps)
    q = jnp.einsum("btd,dnh->btnh", h, w["q_proj"])
    k = jnp.einsum("btd,dkh->btkh", h, w["k_proj"])
    v = jnp.einsum("btd,dkh->btkh", h, w["v_proj"])
    if cfg.qkv_bias:
        q, k, v = q + w["q_bias"], k + w["k_bias"], v + w["v_bias"]
    q = parallel.constrain(rope_lib.apply_rope(q, cos_bth, sin_bth), "batch", None, "heads", None)
    return q, rope_lib.apply_rope(k, cos_bth, sin_bth), v


def _block(cfg: ModelConfig, x_btd, p, cos_bth, sin_bth, query_slot_bt, key_valid_bt, query_first_bt):
    """One decoder block of a full forward (keys = this chunk's tokens): key s is visible to query t iff
    key_valid_bt[b, s] and query_first_bt[b, t] <= s <= query_slot_bt[b, t] (query_first_bt None: 0). Returns
    x_btd."""
    w = _compute_weights(cfg, p)
    q, k, v = _qkv(cfg, x_btd, p, w, cos_bth, sin_bth)
    out = attention(q, k, v, query_slot_bt, key_valid_bt, query_first_bt, implementation=cfg.attention,
                    query_block=cfg.attention_query_block, key_block=cfg.attention_key_block, full_forward=True,
                    platform=cfg.attention_platform)
    return _block_tail(cfg, x_btd, out, p, w)


def _block_tail(cfg: ModelConfig, x_btd, out_btnh, p, w):
    """The rest of a decoder block after attention: output projection and residual, then the MLP."""
    x_btd = x_btd + jnp.einsum("btnh,nhd->btd", out_btnh, w["o_proj"])
    x_btd = parallel.constrain(x_btd, "batch", None, None)
    h = rms_norm(x_btd, p["mlp_norm"], cfg.rms_norm_eps)
    x_btd = x_btd + mlp_lib.swiglu(h, w["gate_proj"], w["up_proj"], w["down_proj"], cfg.mlp_chunks)
    return parallel.constrain(x_btd, "batch", None, None)


class Transformer(nnx.Module):
    """Decoder-only LM: embeddings, L blocks (RMSNorm, GQA + RoPE, SwiGLU), final norm, unembedding."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        pd = jnp.dtype(cfg.param_dtype)
        self.embed = _init(rngs, (cfg.vocab_size, cfg.hidden_size), pd, "normal", cfg.initializer_range)
        self.layers = DecoderLayers(cfg, rngs=rngs)
        self.final_norm = _init(rngs, (cfg.hidden_size,), pd, "ones")
        if not cfg.tie_word_embeddings:
            self.lm_head = _init(rngs, (cfg.hidden_size, cfg.vocab_size), pd, "normal", cfg.initializer_range)

    def unembedding(self) -> jax.Array:
        """The output projection [D, V] in the compute dtype (the embedding transposed when tied)."""
        w = self.embed.get_value().T if self.cfg.tie_word_embeddings else self.lm_head.get_value()
        return w.astype(jnp.dtype(self.cfg.dtype))

    def _run_layers(self, x_btd, positions_bt, query_slot_bt, key_valid_bt, query_first_bt):
        cfg = self.cfg
        cos, sin = rope_lib.rope_angles(positions_bt, rope_lib.inverse_frequencies(cfg))
        params = self.layers.arrays()

        def body(x, p):
            return _block(cfg, x, p, cos, sin, query_slot_bt, key_valid_bt, query_first_bt), None

        if cfg.remat:
            body = jax.checkpoint(body, prevent_cse=not cfg.scan_layers)
        if cfg.scan_layers:
            x_btd, _ = jax.lax.scan(body, x_btd, params)
        else:
            for i in range(cfg.num_layers):
                x_btd, _ = body(x_btd, jax.tree.map(lambda a: a[i], params))
        return rms_norm(x_btd, self.final_norm.get_value(), cfg.rms_norm_eps)

    def _embed(self, tokens_bt: jax.Array) -> jax.Array:
        return embed_lookup(self.embed.get_value(), tokens_bt, jnp.dtype(self.cfg.dtype))

    def hidden(self, tokens_bt: jax.Array, mask_bt: jax.Array, segment_first_bt: Optional[jax.Array] = None
               ) -> jax.Array:
        """Final-normed hidden states [B, T, D] of a full forward.

        mask_bt is 1 on real tokens and 0 on padding (left or right); RoPE positions count real tokens only,
        attention is causal over real tokens. A row packed with several sequences passes `segment_first_bt`
        (int32 [B, T], the index of the first token of each token's sequence): positions restart at each sequence
        and no token sees another sequence's.
        """
        mask = mask_bt.astype(bool)
        count_bt = jnp.cumsum(mask, axis=1, dtype=jnp.int32)
        if segment_first_bt is None:
            positions_bt = jnp.maximum(count_bt - 1, 0)
        else:  # real tokens before t, less those before its sequence's first token
            before_bt = count_bt - mask
            positions_bt = before_bt - jnp.take_along_axis(before_bt, segment_first_bt.astype(jnp.int32), axis=1)
        query_slot_bt = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1], dtype=jnp.int32), tokens_bt.shape)
        return self._run_layers(self._embed(tokens_bt), positions_bt, query_slot_bt, mask, segment_first_bt)

    def __call__(self, tokens_bt: jax.Array, mask_bt: Optional[jax.Array] = None) -> jax.Array:
        """Float32 logits [B, T, V] of a full forward (mask_bt defaults to all ones)."""
        if mask_bt is None:
            mask_bt = jnp.ones(tokens_bt.shape, jnp.int32)
        return self.logits(self.hidden(tokens_bt, mask_bt))

    def logits(self, hidden_btd: jax.Array, rows: Optional[str] = None) -> jax.Array:
        """Float32 logits [B, T, V] from hidden states, V split as the output projection is (under a mesh): each
        device multiplies its rows by its own vocabulary shard, so the [D, V] projection is never gathered. Its
        rows: B split as the logical dimension `rows` (None: every device all of them)."""
        logits_btv = jnp.einsum("btd,dv->btv", hidden_btd, self.unembedding(), preferred_element_type=jnp.float32)
        return parallel.constrain(logits_btv, rows, None, "vocab")

    def ragged_step(self, tokens_t: jax.Array, kv_pages_lpzkh: jax.Array, kv_lens_s: jax.Array,
                    page_indices_sm: jax.Array, cu_q_lens_s1: jax.Array, num_seqs: jax.Array, *,
                    implementation: Optional[str] = None, kv_pages_per_block: Optional[int] = None,
                    queries_per_block: Optional[int] = None) -> tuple[jax.Array, jax.Array]:
        """Runs one ragged batch over the paged KV cache: prompt chunks, decode tokens and observation chunks of up
        to S sequences in T token slots (layout: `llds_jax.model.paged_kv`). Each layer writes the batch's keys and
        values into their pages, in place in the pool (a scan carry; donate the pool to the jitted call), then
        attends (`llds_jax.model.paged_attention`). RoPE positions and pool slots follow from the batch: new token
        i of sequence s sits at kv_lens_s[s] - q_len_s + i.

        Args:
          tokens_t: int32 [T], the new tokens of sequences 0 .. num_seqs - 1 back to back, then padding.
          kv_pages_lpzkh: the pool [L, P, Z, 2K, H] (`paged_kv.init_pages`).
          kv_lens_s: int32 [S], each sequence's cached tokens after this batch's are written.
          page_indices_sm: int32 [S, M], each sequence's pages in order (pages may be shared between sequences
            for a common prefix; a sequence's new tokens go to pages of its own).
          cu_q_lens_s1: int32 [S + 1], cumulative new-token counts from 0; every real sequence has >= 1.
          num_seqs: int32 [1], the real sequences.
          implementation, kv_pages_per_block, queries_per_block: of `paged_attention`; implementation None: the
            kernel when `cfg.attention_platform` (else JAX's backend) is TPU, the reference otherwise.
        Returns (float32 logits [S, V] of each sequence's last new token, zeros for s >= num_seqs; the pool
        holding the batch's keys and values).
        """
        logits_bsv, pages = self.batched_ragged_step(
            tokens_t[None], kv_pages_lpzkh, kv_lens_s[None], page_indices_sm[None], cu_q_lens_s1[None],
            num_seqs[None], implementation=implementation, kv_pages_per_block=kv_pages_per_block,
            queries_per_block=queries_per_block)
        return logits_bsv[0], pages

    def batched_ragged_step(self, tokens_bt: jax.Array, kv_pages_lpzkh: jax.Array, kv_lens_bs: jax.Array,
                            page_indices_bsm: jax.Array, cu_q_lens_bs1: jax.Array, num_seqs_b1: jax.Array, *,
                            implementation: Optional[str] = None, kv_pages_per_block: Optional[int] = None,
                            queries_per_block: Optional[int] = None) -> tuple[jax.Array, jax.Array]:
        """`ragged_step` of B ragged batches over one pool (B the leading axis of every batch argument, each batch
        laid out as `ragged_step`'s; their sequences distinct). Returns (float32 logits [B, S, V], the pool).

        Under a mesh each row is computed once: the layers' rows (the B x T tokens, then the B x S sequences'
        logits) are split over the "batch" axes where those divide them, and each batch attends on the chips of
        its share of those axes (`paged_attention.batched_paged_attention`, where they divide B). The keys and
        values every chip writes are all the batches' (gathered over "batch": the pool is whole on each of its
        chips), so any chip may attend to any sequence in a later step.
        """
        cfg = self.cfg
        b, t = tokens_bt.shape
        layout = functools.partial(paged_kv.token_layout, num_tokens=t, page_size=kv_pages_lpzkh.shape[2])
        _, position_bt, slot_bt, _ = jax.vmap(layout)(cu_q_lens_bs1, kv_lens_bs, page_indices_bsm, num_seqs_b1)
        rows = _row_shards(b * t, "batch")  # the layers' input: `rows` forward rows of B x T / rows tokens
        cos, sin = rope_lib.rope_angles(position_bt.reshape(rows, -1), rope_lib.inverse_frequencies(cfg))
        slot_u = slot_bt.reshape(-1)
        implementation = implementation or default_implementation(cfg.attention_platform, cfg.head_dim)
        attend = functools.partial(batched_paged_attention, implementation=implementation,
                                   kv_pages_per_block=kv_pages_per_block, queries_per_block=queries_per_block)
        mesh = parallel.current_mesh()
        pool_spec = None if mesh is None else paged_kv.pages_spec(mesh, cfg.num_kv_heads)

        def laid_out(pages):  # the pool split by key/value heads under a mesh
            return pages if mesh is None else parallel.constrain_spec(pages, pool_spec)

        def every_token(a_btkh):  # one layer's keys or values of every batch's tokens, [B x T, K, H], on each chip
            a_ukh = a_btkh.reshape(b * t, *a_btkh.shape[2:])
            return a_ukh if mesh is None else parallel.constrain_spec(a_ukh, P(None, pool_spec[3], None))

        def body(carry, xs):  # the pool (every layer) rides in the carry and is written in place
            x_btd, pages = carry
            p, layer = xs
            w = _compute_weights(cfg, p)
            q, k, v = _qkv(cfg, x_btd, p, w, cos, sin)
            pages = paged_kv.write_kv(pages, layer, every_token(k), every_token(v), slot_u)
            pages_pzch, indices_bsm = paged_kv.layer_view(pages, page_indices_bsm, layer)
            out_btnh = attend(q.reshape(b, t, *q.shape[2:]), pages_pzch, kv_lens_bs, indices_bsm, cu_q_lens_bs1,
                              num_seqs_b1)
            return (_block_tail(cfg, x_btd, out_btnh.reshape(q.shape), p, w), pages), None

        layers = jnp.arange(cfg.num_layers, dtype=jnp.int32)
        (x_btd, pages), _ = jax.lax.scan(body, (self._embed(tokens_bt.reshape(rows, -1)), laid_out(kv_pages_lpzkh)),
                                         (self.layers.arrays(), layers))
        s = kv_lens_bs.shape[1]
        last_bs = jnp.arange(b)[:, None] * t + jnp.clip(cu_q_lens_bs1[:, 1:] - 1, 0, t - 1)
        hidden_ud = rms_norm(x_btd.reshape(b * t, -1)[last_bs.reshape(-1)], self.final_norm.get_value(),
                             cfg.rms_norm_eps)
        row_logits_bsv = self.logits(hidden_ud.reshape(_row_shards(b * s, "logit_rows"), -1, hidden_ud.shape[-1]),
                                 rows="logit_rows")
        real_bs = jnp.arange(s) < num_seqs_b1
        return jnp.where(real_bs[..., None], row_logits_bsv.reshape(b, s, -1), 0.0), laid_out(pages)


def _row_shards(rows: int, logical: str) -> int:
    """How many shards the current mesh splits `rows` rows into along the logical dimension `logical` (1 without
    a mesh, or where its axes do not divide `rows`)."""
    mesh = parallel.current_mesh()
    shards = 1 if mesh is None else parallel.axis_size(mesh, logical)
    return shards if rows % shards == 0 else 1
