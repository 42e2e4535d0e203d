"""`python -m llds_jax.launch` with the model folder, the QA data and the run folder on gs:// (a GCS emulator; the
embedded index stays local): training, resume from the bucket's checkpoint, export to gs://, one-line errors."""
import json
from collections import Counter

import jax
import numpy as np
import pytest
import torch
from flax import nnx
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import AutoModelForCausalLM, AutoTokenizer

from llds_jax.apps import demo, demo_config
from llds_jax.config import ConfigError, default_config
from llds_jax.model import hf_io
from llds_jax.model.tokenizer import load_tokenizer
from llds_jax.train.checkpoint import Checkpointer


@pytest.fixture(scope="module")
def gcs_assets(tiny_assets, gcs_bucket, gcs_fs):
    """`tiny_assets` with the model folder (weights and tokenizer) and the QA files copied to the bucket."""
    root = f"{gcs_bucket}/e2e_assets"
    gcs_fs.put(tiny_assets["model"], f"{root}/model", recursive=True)
    for split in ("train", "test"):
        gcs_fs.put(tiny_assets[split], f"{root}/{split}.parquet")
    return {**tiny_assets, "model": f"{root}/model", "train": f"{root}/train.parquet",
            "test": f"{root}/test.parquet"}


def names(gcs_fs, folder):
    """Names of the objects and folders directly in a gs:// folder, sorted."""
    return sorted(path.rsplit("/", 1)[1] for path in gcs_fs.ls(folder, refresh=True))


def read_jsonl(gcs_fs, path):
    return [json.loads(line) for line in gcs_fs.cat(path).decode().splitlines()]


@pytest.mark.slow
def test_train_resume_and_export_in_a_bucket(tmp_path, gcs_assets, gcs_dir, gcs_fs, gcs_env, config_writer, launch):
    run_dir, cache_dir = f"{gcs_dir}/run", f"{gcs_dir}/compilation_cache"
    config = config_writer(tmp_path / "cfg.py", gcs_assets, run_dir=run_dir, compilation_cache_dir=cache_dir,
                           **{"train.eval_every": 0})
    # The later runs read the first one's XLA executables from the bucket's compilation cache (JAX keeps only
    # programs that took >= 1 s to compile unless told otherwise: the tiny model's take less).
    gcs_env = {**gcs_env, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
               "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    code, out, err = launch(config, env=gcs_env)
    assert code == 0, err[-3000:]
    assert len(gcs_fs.ls(cache_dir, refresh=True)) >= 10  # the rollout's and the update's programs, at least
    assert "training stopped after step 2 of 2" in out and "exact match" in out
    assert names(gcs_fs, f"{run_dir}/checkpoints") == ["1", "2"]
    assert names(gcs_fs, f"{run_dir}/eval") == ["final_step_2"]
    results = json.loads(gcs_fs.cat(f"{run_dir}/eval/final_step_2/results.json"))
    transcripts = read_jsonl(gcs_fs, f"{run_dir}/eval/final_step_2/transcripts.jsonl")
    assert len(transcripts) == 4  # eval.max_examples
    assert results["counts"] == Counter(r["data_source"] for r in transcripts)
    assert json.loads(gcs_fs.cat(f"{run_dir}/config.json"))["model"]["path"] == gcs_assets["model"]

    code, out, err = launch(config, "--config.train.total_steps=3", "--config.train.final_eval=False",
                            env={**gcs_env, "JAX_LOG_COMPILES": "1"})
    assert code == 0, err[-3000:]
    assert f"resumed from step 2 of {run_dir}" in err and "training stopped after step 3 of 3" in out
    assert "Persistent compilation cache hit for 'jit__update_impl'" in err  # the update, read back from gs://
    assert names(gcs_fs, f"{run_dir}/checkpoints") == ["1", "2", "3"]
    records = read_jsonl(gcs_fs, f"{run_dir}/metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert len(gcs_fs.ls(f"{run_dir}/tensorboard", refresh=True)) == 2  # one events file per run
    events = EventAccumulator(f"{run_dir}/tensorboard")
    events.Reload()
    scalars = events.Scalars("reward/mean")  # flat lists: pytest 9 no longer compares nested ones approximately
    assert [e.step for e in scalars] == [r["step"] for r in records]
    assert [e.value for e in scalars] == pytest.approx([r["reward/mean"] for r in records], rel=1e-6)

    export = f"{gcs_dir}/export"
    code, out, err = launch(config, "--mode=export", f"--export_dir={export}", env=gcs_env)
    assert code == 0, err[-3000:]
    assert f"exported step 3 to {export}" in out and "WARNING" not in err
    local = tmp_path / "export"
    gcs_fs.get(export, str(local), recursive=True)
    exported = hf_io.load_model(export)  # the step-3 checkpoint's policy
    ckpt = Checkpointer(f"{run_dir}/checkpoints", save_every=1, keep=3)
    trained = ckpt.restore(3, nnx.state(exported, nnx.Param)).params
    ckpt.close()
    for (path, ours), theirs in zip(nnx.to_flat_state(nnx.state(exported, nnx.Param)), jax.tree.leaves(trained)):
        np.testing.assert_array_equal(np.asarray(ours.get_value()), np.asarray(theirs), err_msg=str(path))
    ids = np.asarray([[9707, 11, 1879, 0]])
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(str(local))(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(logits, np.asarray(exported(ids, np.ones_like(ids))), atol=1e-4)
    text = "<|im_start|>user\nWhere was Tova Ren born?<|im_end|>"
    assert AutoTokenizer.from_pretrained(str(local)).encode(text) == load_tokenizer(gcs_assets["model"]).encode(text)


@pytest.mark.slow
@pytest.mark.parametrize("problem", ["missing_model", "missing_data", "unreachable_endpoint"])
def test_gcs_problems_are_one_line(tmp_path, gcs_assets, gcs_dir, gcs_env, unreachable_gcs_env, config_writer,
                                   launch, problem):
    settings, env = {"run_dir": f"{gcs_dir}/run"}, gcs_env
    model_path = f"{gcs_dir}/no_model" if problem == "missing_model" else None
    if problem == "missing_data":
        settings["data.train_files"] = [f"{gcs_dir}/missing.parquet"]
    if problem == "unreachable_endpoint":
        env = unreachable_gcs_env
    config = config_writer(tmp_path / "cfg.py", gcs_assets, model_path=model_path, **settings)
    code, _, err = launch(config, env=env)
    assert code == 2
    expected = {
        "missing_model": f"tokenizer folder not found: {gcs_dir}/no_model (no tokenizer files there)",
        "missing_data": f"data.train_files: file not found: {gcs_dir}/missing.parquet",
        "unreachable_endpoint": f"run_dir {gcs_dir}/run: Google Cloud Storage at "
                                f"{unreachable_gcs_env['STORAGE_EMULATOR_HOST']} did not answer (ConnectionError)",
    }[problem]
    assert err.strip().splitlines()[-1] == f"llds_jax: error: {expected}"
    assert "Traceback" not in err


def test_demo_assets_must_be_local():
    cfg = default_config()
    cfg.app, cfg.demo = demo_config.APP, demo_config.section()
    cfg.run_dir, cfg.demo.enabled = "gs://llds-test/run", True
    with pytest.raises(ConfigError, match="^demo.assets_dir must be a local folder .*, got 'gs://llds-test/run/assets' "
                                          "from run_dir: set demo.assets_dir$"):
        demo.prepare(cfg)
