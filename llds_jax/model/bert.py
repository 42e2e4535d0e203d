"""A BERT encoder in Flax NNX (the architecture of e5-base-v2), loaded from a Hugging Face folder (local or gs://).

BERT: learned absolute position embeddings, token-type embeddings, post-LayerNorm blocks (attention, add, norm;
MLP with exact (erf) GELU, add, norm), bidirectional attention over the tokens the mask keeps. The layer
parameters are stacked on a leading axis L and run under `lax.scan`. LayerNorm statistics and the attention softmax
are computed in float32 whatever the compute dtype.

Dimension letters: B batch, T tokens, D hidden, N heads, H head size, F MLP width, V vocabulary, P positions,
Y token types, L layers.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from llds_jax.errors import InputError
from llds_jax.model.hf_io import CheckpointFolder

_ACTIVATIONS = ("gelu",)  # exact GELU, what e5 and BERT checkpoints name "gelu"


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """The shape of a BERT encoder (from a Hugging Face config.json: `from_hf`)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_positions: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    dtype: str = "float32"  # compute dtype; parameters stay float32

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_hf(cls, hf: dict[str, Any], where: str, dtype: str = "float32") -> BertConfig:
        """The config of an HF BERT config.json (the file `where`); raises ValueError naming the file and key for
        an architecture this encoder does not implement."""
        if hf.get("model_type") != "bert":
            raise InputError(f"{where}: model_type {hf.get('model_type')!r} is not 'bert' (the e5 encoder is BERT)")
        if hf.get("hidden_act", "gelu") not in _ACTIVATIONS:
            raise InputError(f"{where}: hidden_act {hf.get('hidden_act')!r} is not supported (only 'gelu')")
        if hf.get("position_embedding_type", "absolute") != "absolute":
            raise InputError(f"{where}: position_embedding_type {hf['position_embedding_type']!r} is not supported"
                             " (only 'absolute')")
        if hf["hidden_size"] % hf["num_attention_heads"]:
            raise InputError(f"{where}: hidden_size {hf['hidden_size']} is not a multiple of num_attention_heads"
                             f" {hf['num_attention_heads']}")
        return cls(vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
                   num_heads=hf["num_attention_heads"], intermediate_size=hf["intermediate_size"],
                   max_positions=hf["max_position_embeddings"], type_vocab_size=hf.get("type_vocab_size", 2),
                   layer_norm_eps=hf.get("layer_norm_eps", 1e-12), dtype=dtype)


def layer_norm(x_btd: jax.Array, scale_d: jax.Array, bias_d: jax.Array, eps: float) -> jax.Array:
    """LayerNorm over the last axis in float32, returned in x's dtype."""
    x = x_btd.astype(jnp.float32)
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    y = (x - mean) * jax.lax.rsqrt(var + eps) * scale_d.astype(jnp.float32) + bias_d.astype(jnp.float32)
    return y.astype(x_btd.dtype)


def _zeros(shape) -> nnx.Param:
    return nnx.Param(jnp.zeros(shape, jnp.float32))


class BertEncoder(nnx.Module):
    """Embeddings and L post-LayerNorm blocks; `__call__` gives the last hidden states [B, T, D].

    Built with zero parameters (`load_bert` fills them from a checkpoint)."""

    def __init__(self, cfg: BertConfig):
        self.cfg = cfg
        L, D, N, H, F = cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.intermediate_size
        self.word_embed = _zeros((cfg.vocab_size, D))
        self.position_embed = _zeros((cfg.max_positions, D))
        self.type_embed = _zeros((cfg.type_vocab_size, D))
        self.embed_norm_scale, self.embed_norm_bias = _zeros((D,)), _zeros((D,))
        self.layers = nnx.Dict({
            "q_proj": _zeros((L, D, N, H)), "q_bias": _zeros((L, N, H)),
            "k_proj": _zeros((L, D, N, H)), "k_bias": _zeros((L, N, H)),
            "v_proj": _zeros((L, D, N, H)), "v_bias": _zeros((L, N, H)),
            "o_proj": _zeros((L, N, H, D)), "o_bias": _zeros((L, D)),
            "attn_norm_scale": _zeros((L, D)), "attn_norm_bias": _zeros((L, D)),
            "up_proj": _zeros((L, D, F)), "up_bias": _zeros((L, F)),
            "down_proj": _zeros((L, F, D)), "down_bias": _zeros((L, D)),
            "mlp_norm_scale": _zeros((L, D)), "mlp_norm_bias": _zeros((L, D)),
        })

    def __call__(self, token_ids_bt: jax.Array, mask_bt: jax.Array,
                 type_ids_bt: jax.Array | None = None) -> jax.Array:
        """Last hidden states [B, T, D] (compute dtype) of token ids [B, T]; `mask_bt` (1 = token, 0 = padding)
        hides padded keys; `type_ids_bt` defaults to zeros (one segment)."""
        cfg = self.cfg
        dt = jnp.dtype(cfg.dtype)
        T = token_ids_bt.shape[1]
        if type_ids_bt is None:
            type_ids_bt = jnp.zeros_like(token_ids_bt)
        x_btd = (self.word_embed[...][token_ids_bt] + self.position_embed[...][:T][None]
                 + self.type_embed[...][type_ids_bt])
        x_btd = layer_norm(x_btd, self.embed_norm_scale[...], self.embed_norm_bias[...], cfg.layer_norm_eps).astype(dt)
        # Additive key mask [B, 1, 1, T]: 0 for tokens, the dtype's minimum for padding (as transformers does).
        key_bias_b11t = jnp.where(mask_bt.astype(bool), 0.0, jnp.finfo(jnp.float32).min)[:, None, None, :]
        scale = 1.0 / np.sqrt(cfg.head_dim)

        def block(x_btd, p):
            w = {name: a.astype(dt) for name, a in p.items()}
            q = jnp.einsum("btd,dnh->bnth", x_btd, w["q_proj"]) + w["q_bias"][None, :, None, :]
            k = jnp.einsum("btd,dnh->bnth", x_btd, w["k_proj"]) + w["k_bias"][None, :, None, :]
            v = jnp.einsum("btd,dnh->bnth", x_btd, w["v_proj"]) + w["v_bias"][None, :, None, :]
            scores_bnts = jnp.einsum("bnth,bnsh->bnts", q, k, preferred_element_type=jnp.float32) * scale
            probs_bnts = jax.nn.softmax(scores_bnts + key_bias_b11t, axis=-1).astype(dt)
            out_btnh = jnp.einsum("bnts,bnsh->btnh", probs_bnts, v)
            attn_btd = jnp.einsum("btnh,nhd->btd", out_btnh, w["o_proj"]) + w["o_bias"]
            x_btd = layer_norm(x_btd + attn_btd, p["attn_norm_scale"], p["attn_norm_bias"], cfg.layer_norm_eps)
            act_btf = jax.nn.gelu(jnp.einsum("btd,df->btf", x_btd, w["up_proj"]) + w["up_bias"], approximate=False)
            mlp_btd = jnp.einsum("btf,fd->btd", act_btf, w["down_proj"]) + w["down_bias"]
            x_btd = layer_norm(x_btd + mlp_btd, p["mlp_norm_scale"], p["mlp_norm_bias"], cfg.layer_norm_eps)
            return x_btd, None

        stacked = {name: var[...] for name, var in self.layers.items()}
        x_btd, _ = jax.lax.scan(block, x_btd, stacked)
        return x_btd


# Our parameter -> (HF name inside the model, or inside "encoder.layer.{i}." for layer parameters;
# HF tensor [rows, ...] -> ours).
_TOP = {
    "word_embed": "embeddings.word_embeddings.weight",
    "position_embed": "embeddings.position_embeddings.weight",
    "type_embed": "embeddings.token_type_embeddings.weight",
    "embed_norm_scale": "embeddings.LayerNorm.weight",
    "embed_norm_bias": "embeddings.LayerNorm.bias",
}
_LAYER = {
    "q_proj": "attention.self.query.weight", "q_bias": "attention.self.query.bias",
    "k_proj": "attention.self.key.weight", "k_bias": "attention.self.key.bias",
    "v_proj": "attention.self.value.weight", "v_bias": "attention.self.value.bias",
    "o_proj": "attention.output.dense.weight", "o_bias": "attention.output.dense.bias",
    "attn_norm_scale": "attention.output.LayerNorm.weight", "attn_norm_bias": "attention.output.LayerNorm.bias",
    "up_proj": "intermediate.dense.weight", "up_bias": "intermediate.dense.bias",
    "down_proj": "output.dense.weight", "down_bias": "output.dense.bias",
    "mlp_norm_scale": "output.LayerNorm.weight", "mlp_norm_bias": "output.LayerNorm.bias",
}


def _to_ours(name: str, hf_w: np.ndarray, cfg: BertConfig) -> np.ndarray:
    """One layer's HF tensor (torch Linear weights are [out, in]) in our layout."""
    D, N, H = cfg.hidden_size, cfg.num_heads, cfg.head_dim
    if name in ("q_proj", "k_proj", "v_proj"):
        return hf_w.T.reshape(D, N, H)
    if name in ("q_bias", "k_bias", "v_bias"):
        return hf_w.reshape(N, H)
    if name == "o_proj":
        return hf_w.T.reshape(N, H, D)
    if name in ("up_proj", "down_proj"):
        return hf_w.T
    return hf_w


def _prefix(names: set[str]) -> str:
    """"" for a bare BertModel checkpoint, "bert." for one saved from a model with a head (e.g. BertForMaskedLM)."""
    return "bert." if "bert.embeddings.word_embeddings.weight" in names else ""


def load_bert(path: str, dtype: str = "float32") -> BertEncoder:
    """The BertEncoder of an HF folder (local or gs://) holding config.json and safetensors.

    Raises FileNotFoundError when the folder has no weights or config, ValueError naming the folder and the
    missing or mis-shaped tensors."""
    folder = CheckpointFolder(path)
    cfg = BertConfig.from_hf(folder.config(), f"{folder.path}/config.json", dtype)
    model = BertEncoder(cfg)
    prefix = _prefix(folder.names())

    def read(hf_name: str, expected: tuple[int, ...], ours: str) -> np.ndarray:
        full = prefix + hf_name
        if full not in folder.names():
            raise InputError(f"{folder.path}: BERT tensor {full!r} is missing")
        arr = _to_ours(ours, np.asarray(folder.read_rows(full, slice(None)), np.float32), cfg)
        if arr.shape != expected:
            raise InputError(f"{folder.path}: tensor {full!r} has shape {folder.shape(full)}, expected one for"
                             f" {expected} (config.json and weights disagree)")
        return arr

    for ours, hf_name in _TOP.items():
        var = getattr(model, ours)
        var.set_value(jnp.asarray(read(hf_name, var.shape, ours)))
    for ours, hf_name in _LAYER.items():
        var = model.layers[ours]
        stacked = [read(f"encoder.layer.{i}.{hf_name}", var.shape[1:], ours) for i in range(cfg.num_layers)]
        var.set_value(jnp.asarray(np.stack(stacked)))
    return model
