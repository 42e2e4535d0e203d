"""The Qwen2/Qwen2.5/Llama-3.x decoder family: config, Flax NNX model, paged KV cache."""
from llds_jax.model.config import (PRESETS, Llama3RopeScaling, ModelConfig, check_preset, from_hf_config,
                                   preset, run_overrides, to_hf_config)
from llds_jax.model.paged_kv import init_pages, pages_spec
from llds_jax.model.transformer import Transformer

__all__ = ["PRESETS", "Llama3RopeScaling", "ModelConfig", "check_preset", "from_hf_config", "preset", "run_overrides",
           "to_hf_config", "init_pages", "pages_spec", "Transformer"]
