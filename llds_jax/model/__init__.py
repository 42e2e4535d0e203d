"""The Qwen2/Qwen2.5/Llama-3.x decoder family: config, Flax NNX model, KV cache (dense per row, and paged)."""
from llds_jax.model.config import (PRESETS, Llama3RopeScaling, ModelConfig, check_preset, from_hf_config,
                                   preset, run_overrides, to_hf_config)
from llds_jax.model.kv_cache import KVCache, init_cache
from llds_jax.model.paged_kv import init_pages, pages_spec
from llds_jax.model.transformer import Transformer

__all__ = ["PRESETS", "Llama3RopeScaling", "ModelConfig", "check_preset", "from_hf_config", "preset", "run_overrides",
           "to_hf_config", "KVCache", "init_cache", "init_pages", "pages_spec", "Transformer"]
