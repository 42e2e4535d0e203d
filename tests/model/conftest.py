"""Tiny random Hugging Face checkpoints (real transformers models saved with save_pretrained)."""
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

TINY = dict(vocab_size=160, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)

HF_VARIANTS = {
    "qwen2_untied": (Qwen2Config, Qwen2ForCausalLM, dict(rope_theta=1e6, tie_word_embeddings=False)),
    "qwen2_tied": (Qwen2Config, Qwen2ForCausalLM, dict(rope_theta=1e6, tie_word_embeddings=True)),
    "llama3_scaled": (LlamaConfig, LlamaForCausalLM, dict(
        tie_word_embeddings=True, head_dim=16, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64}, rope_theta=500000.0)),
    "llama_untied": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=False, rope_theta=10000.0)),
}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Non-trivial norms and biases too (HF initializes them to ones/zeros, which would hide layout bugs)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.copy_(0.2 * torch.randn(p.shape, generator=gen) + (1.0 if p.ndim == 1 and p.shape[0] == 32 else 0.0))


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """Builds (once per variant) a tiny random HF model, saves it; returns (folder, torch model)."""
    cache = {}

    def make(variant: str):
        if variant not in cache:
            config_cls, model_cls, extra = HF_VARIANTS[variant]
            model = model_cls(config_cls(**TINY, **extra)).eval()
            _randomize(model, seed=len(cache))
            folder = tmp_path_factory.mktemp(variant)
            model.save_pretrained(folder)
            cache[variant] = (str(folder), model)
        return cache[variant]

    return make


@pytest.fixture(scope="session")
def left_padded_batch():
    """Token ids [3, 12] with left padding of 0, 5 and 9 tokens, and the matching attention mask."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, TINY["vocab_size"], size=(3, 12))
    mask = np.ones_like(ids)
    for row, pad in enumerate((0, 5, 9)):
        mask[row, :pad] = 0
        ids[row, :pad] = 0
    return ids, mask
