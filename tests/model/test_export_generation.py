"""An exported folder generates like its source in transformers: the special token ids and generation config are
carried over, so `generate()` stops at the same end-of-sequence token (local and gs:// exports)."""
import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from llds_jax.model import hf_io

PROMPT = [[3, 17, 42, 99]]
MAX_NEW = 12


def _greedy(folder):
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        return model.generate(torch.tensor(PROMPT), attention_mask=torch.ones(1, len(PROMPT[0]), dtype=torch.long),
                              max_new_tokens=MAX_NEW, do_sample=False)[0].tolist()


@pytest.fixture(scope="module")
def free_run(hf_checkpoint):
    """(HF folder without special token ids, its greedy continuation of PROMPT: MAX_NEW tokens)."""
    folder, _ = hf_checkpoint("qwen2_untied")
    with open(f"{folder}/config.json") as f:
        assert json.load(f).get("eos_token_id") is None
    tokens = _greedy(folder)[len(PROMPT[0]):]
    assert len(tokens) == MAX_NEW
    return folder, tokens


def _source(tmp_path, folder, tokens, with_generation_config):
    """A copy of `folder` whose end-of-sequence token is the first continuation token that is new at step >= 3
    (the source stops early, not at once). With a generation config, that id is only in generation_config.json's
    eos list (config.json names another id), as in Qwen2.5-Instruct's checkpoints."""
    stop = next(t for i, t in enumerate(tokens) if i >= 2 and t not in tokens[:i] + PROMPT[0])
    unused = next(t for t in range(100, 160) if t not in tokens + PROMPT[0])
    src = tmp_path / "source"
    shutil.copytree(folder, src)
    (src / hf_io.GENERATION_CONFIG_FILE).unlink(missing_ok=True)
    config = json.loads((src / "config.json").read_text())
    ids = {"bos_token_id": 1, "pad_token_id": 2}
    if with_generation_config:
        config.update(ids, eos_token_id=unused)
        (src / hf_io.GENERATION_CONFIG_FILE).write_text(json.dumps({**ids, "eos_token_id": [unused, stop]}))
    else:
        config.update(ids, eos_token_id=stop)
    (src / "config.json").write_text(json.dumps(config))
    return str(src), stop


@pytest.mark.parametrize("with_generation_config", [True, False])
@pytest.mark.parametrize("to_gcs", [False, True])
def test_export_stops_where_the_source_stops(free_run, tmp_path, gcs_dir, gcs_fs, with_generation_config, to_gcs):
    src, stop = _source(tmp_path, *free_run, with_generation_config)
    expected = _greedy(src)
    assert expected[-1] == stop and len(expected) < len(PROMPT[0]) + MAX_NEW  # the source stops early

    out = f"{gcs_dir}/export" if to_gcs else str(tmp_path / "export")
    hf_io.save_model(hf_io.load_model(src), out, generation_config=hf_io.read_generation_config(src))
    if to_gcs:
        gcs_fs.get(out, str(tmp_path / "downloaded"), recursive=True)
        out = str(tmp_path / "downloaded")
    assert _greedy(out) == expected
    with open(f"{out}/config.json") as f:
        exported = json.load(f)
    with open(f"{src}/config.json") as f:
        source = json.load(f)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert exported[key] == source[key], key
    with open(f"{out}/{hf_io.GENERATION_CONFIG_FILE}") as f:
        generation = json.load(f)
    if with_generation_config:
        with open(f"{src}/{hf_io.GENERATION_CONFIG_FILE}") as f:
            assert generation == json.load(f)
    else:
        assert generation == {"_from_model_config": True, "bos_token_id": 1, "eos_token_id": stop, "pad_token_id": 2}
