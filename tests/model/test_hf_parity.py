"""Logit parity with transformers' PyTorch models, HF round trips, and checkpoint error messages."""
import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from transformers import AutoModelForCausalLM

from llds_jax.model import from_hf_config, hf_io


def torch_logits(model, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.float().numpy()


def _ours(model, ids, mask):
    return np.asarray(model(jnp.asarray(ids), jnp.asarray(mask)))


@pytest.mark.parametrize("variant", ["qwen2_untied", "qwen2_tied", "llama3_scaled", "llama_untied"])
def test_logits_match_transformers_with_left_padding(hf_checkpoint, left_padded_batch, variant):
    folder, torch_model = hf_checkpoint(variant)
    ids, mask = left_padded_batch
    ours = _ours(hf_io.load_model(folder), ids, mask)
    ref = torch_logits(torch_model, ids, mask)
    real = mask.astype(bool)
    assert np.abs(ours - ref)[real].max() <= 1e-4
    # The comparison is not vacuous: the rows differ from each other and from zero.
    assert np.abs(ref[real]).max() > 0.1


def test_llama3_rope_scaling_is_applied(hf_checkpoint):
    folder, _ = hf_checkpoint("llama3_scaled")
    cfg = from_hf_config(folder)
    assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == 8.0
    from llds_jax.model import rope
    scaled = rope.inverse_frequencies(cfg)
    plain = rope.inverse_frequencies(cfg.replace(rope_scaling=None))
    # High frequencies untouched, low ones divided by the factor, the band between smoothly interpolated.
    assert scaled[0] == plain[0] and np.isclose(scaled[-1], plain[-1] / 8.0)
    assert np.all(scaled <= plain) and np.all(scaled >= plain / 8.0 - 1e-12)
    assert np.any((scaled < plain) & (scaled > plain / 8.0))


@pytest.mark.parametrize("scan_layers,remat", [(False, False), (True, True)])
def test_layer_loop_variants_agree(hf_checkpoint, left_padded_batch, scan_layers, remat):
    folder, torch_model = hf_checkpoint("qwen2_untied")
    ids, mask = left_padded_batch
    ours = _ours(hf_io.load_model(folder, scan_layers=scan_layers, remat=remat), ids, mask)
    ref = torch_logits(torch_model, ids, mask)
    assert np.abs(ours - ref)[mask.astype(bool)].max() <= 1e-4


@pytest.mark.parametrize("variant,max_shard_bytes", [("qwen2_untied", 2 << 30), ("llama3_scaled", 20_000)])
def test_export_round_trip_reloads_in_transformers(hf_checkpoint, left_padded_batch, tmp_path, variant,
                                                   max_shard_bytes):
    folder, torch_model = hf_checkpoint(variant)
    ids, mask = left_padded_batch
    hf_io.save_model(hf_io.load_model(folder), str(tmp_path), max_shard_bytes=max_shard_bytes)
    sharded = os.path.exists(tmp_path / hf_io.INDEX_FILE)
    assert sharded == (max_shard_bytes < 1 << 20)
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    np.testing.assert_array_equal(torch_logits(reloaded, ids, mask), torch_logits(torch_model, ids, mask))
    # And our loader reads the sharded export back to the same parameters.
    again = hf_io.load_model(str(tmp_path))
    np.testing.assert_array_equal(_ours(again, ids, mask), _ours(hf_io.load_model(folder), ids, mask))


def test_url_style_local_path(hf_checkpoint, left_padded_batch):
    folder, torch_model = hf_checkpoint("qwen2_tied")
    ids, mask = left_padded_batch
    ours = _ours(hf_io.load_model("file://" + folder), ids, mask)
    assert np.abs(ours - torch_logits(torch_model, ids, mask))[mask.astype(bool)].max() <= 1e-4


def _copy_with(folder, tmp_path, edit):
    out = tmp_path / "ckpt"
    shutil.copytree(folder, out)
    tensors = load_file(str(out / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out)


def test_missing_tensor_is_named(hf_checkpoint, tmp_path):
    folder, _ = hf_checkpoint("qwen2_untied")
    bad = _copy_with(folder, tmp_path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensors \['model\.layers\.1\.mlp\.up_proj\.weight'\]"):
        hf_io.load_model(bad)


def test_preset_mismatch_is_named_before_any_weight_is_read(hf_checkpoint, tmp_path):
    """A run's model.preset is checked against config.json alone: a folder whose weights are gone still fails on
    the architecture."""
    folder, _ = hf_checkpoint("qwen2_untied")
    bare = tmp_path / "config_only"
    bare.mkdir()
    shutil.copy(os.path.join(folder, "config.json"), bare / "config.json")
    save_file({"unrelated": np.zeros(1, np.float32)}, str(bare / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.preset 'qwen2\.5-7b' does not match the checkpoint: vocab_size "):
        hf_io.load_model(str(bare), preset="qwen2.5-7b")


def test_unexpected_tensor_is_named(hf_checkpoint, tmp_path):
    folder, _ = hf_checkpoint("qwen2_untied")
    bad = _copy_with(folder, tmp_path, lambda t: t.update({"model.extra.weight": np.zeros(3, np.float32)}))
    with pytest.raises(ValueError, match=r"unexpected tensors \['model\.extra\.weight'\]"):
        hf_io.load_model(bad)


def test_shape_mismatch_is_named(hf_checkpoint, tmp_path):
    folder, _ = hf_checkpoint("qwen2_untied")
    bad = _copy_with(folder, tmp_path, lambda t: t.update(
        {"model.layers.0.self_attn.k_proj.bias": np.zeros(7, np.float32)}))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_proj\.bias: expected \(16,\), got \(7,\)"):
        hf_io.load_model(bad)


def test_missing_folder_and_unsupported_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        hf_io.CheckpointFolder(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        from_hf_config(str(tmp_path))


def test_bf16_compute_stays_close(hf_checkpoint, left_padded_batch):
    folder, torch_model = hf_checkpoint("qwen2_untied")
    ids, mask = left_padded_batch
    model = hf_io.load_model(folder, dtype="bfloat16")
    assert model.layers.q_proj.get_value().dtype == jnp.float32  # master weights stay float32
    ours = _ours(model, ids, mask)
    assert ours.dtype == np.float32
    assert np.abs(ours - torch_logits(torch_model, ids, mask))[mask.astype(bool)].max() < 0.1
