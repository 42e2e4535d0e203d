"""Decoder configuration for the Qwen2/Qwen2.5 and Llama-3.x family: presets and Hugging Face config.json."""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping, Optional, Union

from llds_jax import bounds
from llds_jax.bounds import ConfigError, same
from llds_jax.config.sections import ModelRunConfig
from llds_jax.errors import InputError

SUPPORTED_MODEL_TYPES = ("qwen2", "llama")
PLATFORMS = ("cpu", "gpu", "tpu")  # ModelConfig.attention_platform


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama-3.x RoPE frequency scaling ("rope_type": "llama3")."""

    factor: float = 32.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of one decoder.

    The fields a run sets from its `model` section (`RUN_FIELDS`: dtype, param_dtype, scan_layers, remat, attention
    and its blocks, mlp_chunks) take that section's declarations (`llds_jax.config.sections.ModelRunConfig`), except
    two defaults: `dtype` float32 and `remat` False, the numerics of a model built outside a run (tests, export, a
    checkpoint read alone); a run sets every one of them from its section (`run_overrides`), whose defaults are a
    training run's.

    Attributes:
      model_type: "qwen2" (Qwen2 / Qwen2.5) or "llama" (Llama-3.x); used for export.
      head_dim: per-head size H; attention width is num_heads * head_dim.
      qkv_bias: Qwen has biases on the q/k/v projections, Llama does not.
      param_dtype: storage dtype of parameters ("float32" master weights).
      dtype: compute dtype of matmuls ("bfloat16" on TPU, "float32" on CPU tests). Norms, softmax,
        log-softmax and RoPE angles are always float32.
      scan_layers: run the layer stack with `lax.scan` (compile time independent of depth).
      remat: rematerialize each decoder block in the backward pass.
      attention: the attention of full forwards (`Transformer.hidden`: the update and its log-probs; the rollout's
        ragged steps attend over their pages, llds_jax.model.paged_attention): "auto", "xla" (dense float32
        scores, the reference), "blockwise" (online softmax over tiles of at most attention_query_block x
        attention_key_block scores), "splash" (TPU: the Pallas splash kernel) or "cudnn" (GPU, bfloat16 /
        float16: cuDNN flash attention). "auto": splash on TPU, cudnn on GPU (half-precision dtype); otherwise
        blockwise when the dense scores [T, T] would be larger than one tile. See llds_jax.model.attention.
      attention_query_block, attention_key_block: the largest tile of the blockwise path; splash's blocks, rounded
        up to a multiple of 128.
      attention_platform: the platform the programs are compiled for ("cpu", "gpu", "tpu"), which `auto` and
        `cudnn` decide from; None: jax.default_backend() when traced. A run sets it from its mesh's devices (the
        compile check's are abstract TPU chips while JAX's own backend is the CPU).
      mlp_chunks: the SwiGLU MLP runs over this many slices of its F intermediate features in turn, forward and
        backward, so a layer holds [B, T, F / mlp_chunks] activations instead of [B, T, F] (llds_jax.model.mlp);
        F must be a multiple. 1: all at once.
      initializer_range: standard deviation of the normal initialization of a random model's matrices
        (Hugging Face's key; 0.02 as in Qwen2.5, which is too small for a model a few hundred wide to learn
        attention patterns quickly: the demo's 128-wide policy uses 0.1).
      bos_token_id, eos_token_id, pad_token_id: the checkpoint's special token ids (eos may be several), carried
        from its config.json into an export so that `generate()` stops where the source model stops; unused here.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: Optional[Llama3RopeScaling] = None
    rms_norm_eps: float = 1e-6
    qkv_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    model_type: str = "qwen2"
    param_dtype: str = same(ModelRunConfig, "param_dtype")
    dtype: str = same(ModelRunConfig, "dtype", default="float32")
    scan_layers: bool = same(ModelRunConfig, "scan_layers")
    remat: bool = same(ModelRunConfig, "remat", default=False)
    attention: str = same(ModelRunConfig, "attention")
    attention_query_block: int = same(ModelRunConfig, "attention_query_block")
    attention_key_block: int = same(ModelRunConfig, "attention_key_block")
    attention_platform: Optional[str] = None
    mlp_chunks: int = same(ModelRunConfig, "mlp_chunks")
    initializer_range: float = 0.02
    bos_token_id: Optional[int] = None
    eos_token_id: Union[int, tuple[int, ...], None] = None
    pad_token_id: Optional[int] = None

    def __post_init__(self):
        bounds.check(self)  # the run keys it takes (`same`): their choices and ranges
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"model.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"model.num_heads ({self.num_heads}) must be a multiple of model.num_kv_heads "
                              f"({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"model.head_dim must be even for RoPE, got {self.head_dim}")
        if self.attention_platform is not None and self.attention_platform not in PLATFORMS:
            raise ConfigError(f"model.attention_platform must be None or one of {PLATFORMS}, "
                              f"got {self.attention_platform!r}")
        if self.attention == "cudnn" and self.attention_platform not in (None, "gpu"):
            raise ConfigError(f"model.attention='cudnn' needs a GPU (cuDNN flash attention); the run's devices are "
                              f"{self.attention_platform!r}: use 'auto', 'splash' (TPU), 'blockwise' or 'xla'")
        if self.intermediate_size % self.mlp_chunks:
            raise ConfigError(f"model.mlp_chunks ({self.mlp_chunks}) must divide the MLP width intermediate_size "
                              f"({self.intermediate_size})")
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"model.model_type must be one of {SUPPORTED_MODEL_TYPES}, got {self.model_type!r}")

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def tiny(cls, **overrides: Any) -> "ModelConfig":
        """A tiny random test config (float32, Qwen2 layout with QKV bias, untied embeddings)."""
        fields = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, rope_theta=10000.0, qkv_bias=True, tie_word_embeddings=False)
        fields.update(overrides)
        return cls(**fields)

    def num_params(self) -> int:
        """Parameter count of this architecture (embeddings counted once when tied)."""
        d, f, h = self.hidden_size, self.intermediate_size, self.head_dim
        q, kv = self.num_heads * h, self.num_kv_heads * h
        attn = d * q + 2 * d * kv + q * d + ((q + 2 * kv) if self.qkv_bias else 0)
        layer = attn + 3 * d * f + 2 * d
        embed = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + embed + d


_QWEN25_COMMON = dict(model_type="qwen2", qkv_bias=True, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                      max_position_embeddings=32768, head_dim=128)

PRESETS: dict[str, ModelConfig] = {
    "qwen2.5-0.5b": ModelConfig(**{**_QWEN25_COMMON, "head_dim": 64}, vocab_size=151936, hidden_size=896,
                                intermediate_size=4864, num_layers=24, num_heads=14, num_kv_heads=2,
                                tie_word_embeddings=True),
    "qwen2.5-1.5b": ModelConfig(**_QWEN25_COMMON, vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                                num_layers=28, num_heads=12, num_kv_heads=2, tie_word_embeddings=True),
    "qwen2.5-3b": ModelConfig(**_QWEN25_COMMON, vocab_size=151936, hidden_size=2048, intermediate_size=11008,
                              num_layers=36, num_heads=16, num_kv_heads=2, tie_word_embeddings=True),
    "qwen2.5-7b": ModelConfig(**_QWEN25_COMMON, vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                              num_layers=28, num_heads=28, num_kv_heads=4, tie_word_embeddings=False),
    "qwen2.5-14b": ModelConfig(**{**_QWEN25_COMMON, "rms_norm_eps": 1e-5}, vocab_size=152064, hidden_size=5120,
                               intermediate_size=13824, num_layers=48, num_heads=40, num_kv_heads=8,
                               tie_word_embeddings=False),
    "llama-3.2-3b": ModelConfig(model_type="llama", vocab_size=128256, hidden_size=3072, intermediate_size=8192,
                                num_layers=28, num_heads=24, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
                                rope_scaling=Llama3RopeScaling(), rms_norm_eps=1e-5, qkv_bias=False,
                                tie_word_embeddings=True, max_position_embeddings=131072),
}


# The ModelConfig fields a run's `model` section sets on top of the checkpoint's architecture (numerics and
# execution), under the same names.
RUN_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig) if "key" in f.metadata)


def run_overrides(model_section: ModelRunConfig) -> dict[str, Any]:
    """The RUN_FIELDS of a run config's `model` section, as ModelConfig overrides."""
    return {name: getattr(model_section, name) for name in RUN_FIELDS}


def preset(name: str, **overrides: Any) -> ModelConfig:
    """A named preset (see PRESETS), with optional field overrides (e.g. dtype="bfloat16")."""
    key = name.lower()
    if key not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}")
    return PRESETS[key].replace(**overrides)


# Fields that do not make an architecture: numerics and execution choices of a run, the tokenizer's special ids.
_NOT_ARCHITECTURE = ("param_dtype", "dtype", "scan_layers", "remat", "attention", "attention_query_block",
                     "attention_key_block", "attention_platform", "initializer_range", "bos_token_id", "eos_token_id",
                     "pad_token_id")


def check_preset(cfg: ModelConfig, name: str) -> None:
    """Raises ValueError naming the fields in which a checkpoint's architecture `cfg` differs from preset `name`
    (a run config's `model.preset`, which `--mode=compile` compiles instead of the checkpoint)."""
    expected = preset(name)
    diffs = [f"{field.name} {getattr(cfg, field.name)!r} (preset: {getattr(expected, field.name)!r})"
             for field in dataclasses.fields(ModelConfig)
             if field.name not in _NOT_ARCHITECTURE and getattr(cfg, field.name) != getattr(expected, field.name)]
    if diffs:
        raise InputError(f"model.preset {name!r} does not match the checkpoint: " + ", ".join(diffs)
                         + " (set model.preset to the checkpoint's architecture, or to '' for none)")


def _rope_fields(hf: Mapping[str, Any], where: str) -> tuple[float, Optional[Llama3RopeScaling]]:
    """RoPE theta and scaling from either the transformers-5 `rope_parameters` or the older flat keys."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {}) or params
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise InputError(f"{where}: unsupported rope_type {rope_type!r} (supported: default, llama3)")
    return theta, Llama3RopeScaling(
        factor=float(scaling["factor"]), low_freq_factor=float(scaling["low_freq_factor"]),
        high_freq_factor=float(scaling["high_freq_factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]))


class HFConfig(dict):
    """The object of a Hugging Face config.json, with the file it was read from (`source`), which errors name."""

    def __init__(self, values: Mapping[str, Any], source: str):
        super().__init__(values)
        self.source = source


def from_hf_config(config: str | os.PathLike | Mapping[str, Any], **overrides: Any) -> ModelConfig:
    """Builds a ModelConfig from a Hugging Face `config.json` (path, folder or dict).

    `overrides` set our own fields (dtype, param_dtype, scan_layers, remat, attention and its block sizes). Errors
    name the file (a path, or an HFConfig's `source`).
    """
    where = config.source if isinstance(config, HFConfig) else "config dict"
    if not isinstance(config, Mapping):
        path = os.fspath(config)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        where = path
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    hf = dict(config)
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise InputError(f"{where}: model_type {model_type!r} is not supported (supported: {SUPPORTED_MODEL_TYPES})")
    if hf.get("hidden_act", "silu") != "silu":
        raise InputError(f"{where}: hidden_act {hf['hidden_act']!r} is not supported (expected 'silu')")
    if hf.get("mlp_bias"):
        raise InputError(f"{where}: mlp_bias=true is not supported")
    if hf.get("use_sliding_window"):
        raise InputError(f"{where}: use_sliding_window=true is not supported")
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if k not in hf]
    if missing:
        raise InputError(f"{where}: missing keys {missing}")
    theta, scaling = _rope_fields(hf, where)
    heads = int(hf["num_attention_heads"])
    fields = dict(
        model_type=model_type, vocab_size=int(hf["vocab_size"]), hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]), num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads, num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // heads), rope_theta=theta,
        rope_scaling=scaling, rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        qkv_bias=True if model_type == "qwen2" else bool(hf.get("attention_bias", False)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
        initializer_range=float(hf.get("initializer_range", 0.02)),
        **_token_ids(hf, where),
    )
    fields.update(overrides)
    return ModelConfig(**fields)


TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _token_ids(hf: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The special token ids of a config.json (an eos list becomes a tuple); absent or null ones are left out."""
    out: dict[str, Any] = {}
    for key in TOKEN_ID_KEYS:
        value = hf.get(key)
        if isinstance(value, list) and key == "eos_token_id" and all(isinstance(v, int) for v in value):
            out[key] = tuple(value)
        elif isinstance(value, int) and not isinstance(value, bool):
            out[key] = value
        elif value is not None:
            expected = "an integer or a list of them" if key == "eos_token_id" else "an integer"
            raise InputError(f"{where}: {key} must be {expected}, got {value!r}")
    return out


def token_ids(cfg: ModelConfig) -> dict[str, Any]:
    """The special token ids of `cfg` that are set, as config.json / generation_config.json hold them."""
    ids = {key: getattr(cfg, key) for key in TOKEN_ID_KEYS if getattr(cfg, key) is not None}
    return {key: list(value) if isinstance(value, tuple) else value for key, value in ids.items()}


def to_hf_config(cfg: ModelConfig, torch_dtype: str = "float32") -> dict[str, Any]:
    """The Hugging Face config.json dict of `cfg` (Qwen2ForCausalLM or LlamaForCausalLM)."""
    arch = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}[cfg.model_type]
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        rope = {"rope_type": "llama3", "rope_theta": cfg.rope_theta, **dataclasses.asdict(cfg.rope_scaling)}
    out = {
        "architectures": [arch], "model_type": cfg.model_type, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings, "rope_theta": cfg.rope_theta,
        "rope_scaling": None if cfg.rope_scaling is None else rope, "rope_parameters": rope,
        "initializer_range": cfg.initializer_range, "torch_dtype": torch_dtype, **token_ids(cfg),
    }
    if cfg.model_type == "llama":
        out.update(attention_bias=cfg.qkv_bias, mlp_bias=False)
    return out
