"""Presets reproduce the published parameter counts (abstract shapes only: nothing is allocated); the random
initialization scale; special token ids in config.json."""
import math

import jax
import numpy as np
import pytest
from flax import nnx

from llds_jax.bounds import ConfigError
from llds_jax.model import ModelConfig, Transformer, check_preset, from_hf_config, preset
from llds_jax.model.config import to_hf_config

PUBLISHED = {  # from the safetensors metadata of the Hugging Face checkpoints
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-1.5b": 1_543_714_304,
    "qwen2.5-3b": 3_085_938_688,
    "qwen2.5-7b": 7_615_616_512,
    "llama-3.2-3b": 3_212_749_824,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_parameter_count(name):
    cfg = preset(name)
    abstract = nnx.state(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))), nnx.Param)
    leaves = jax.tree.leaves(abstract)
    assert all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in leaves)
    assert sum(math.prod(leaf.shape) for leaf in leaves) == PUBLISHED[name]
    assert cfg.num_params() == PUBLISHED[name]


def test_unknown_preset_lists_known():
    with pytest.raises(ConfigError, match="unknown model preset 'qwen9'; known: .*'qwen2.5-7b'"):
        preset("qwen9")


def test_initializer_range_sets_the_random_init_and_round_trips_the_hf_config():
    cfg = ModelConfig.tiny(initializer_range=0.1)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    assert abs(float(np.std(np.asarray(model.embed[...]))) - 0.1) < 0.005  # 8,192 draws
    assert abs(float(np.std(np.asarray(model.layers.q_proj[...]))) - 0.1) < 0.01
    hf = to_hf_config(cfg)
    assert hf["initializer_range"] == 0.1 and from_hf_config(hf).initializer_range == 0.1
    del hf["initializer_range"]
    assert from_hf_config(hf).initializer_range == 0.02  # Hugging Face's default


def test_checkpoint_is_checked_against_its_preset():
    """A run's model.preset (what --mode=compile compiled) must be the checkpoint's architecture; the run's
    numerics (dtypes, scan, remat) may differ."""
    check_preset(from_hf_config(to_hf_config(preset("qwen2.5-7b"))).replace(dtype="bfloat16", remat=True),
                 "qwen2.5-7b")
    with pytest.raises(ValueError, match=r"model\.preset 'qwen2\.5-7b' does not match the checkpoint: "
                                         r"vocab_size 151936 \(preset: 152064\), hidden_size 2048 \(preset: 3584\)"):
        check_preset(preset("qwen2.5-3b"), "qwen2.5-7b")


def test_special_token_ids_round_trip_the_hf_config():
    hf = to_hf_config(ModelConfig.tiny())
    assert not {"bos_token_id", "eos_token_id", "pad_token_id"} & set(hf)  # none set: none written
    hf.update(bos_token_id=None, eos_token_id=[151645, 151643], pad_token_id=151643)
    cfg = from_hf_config(hf)
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (None, (151645, 151643), 151643)
    again = to_hf_config(cfg)
    assert again["eos_token_id"] == [151645, 151643] and again["pad_token_id"] == 151643
    assert "bos_token_id" not in again
    with pytest.raises(ValueError, match=r"config dict: eos_token_id must be an integer or a list of them, "
                                         r"got '<\|im_end\|>'"):
        from_hf_config({**hf, "eos_token_id": "<|im_end|>"})
