"""bench/step_profile.py end to end on the tiny config: phase shares that add up, and no compilation after step 1."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

from tests.bench.loading import load_bench

ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "step_profile.py"
TINY = ROOT / "configs" / "tiny_test.py"
PHASES = ("rollout/decode", "rollout/host", "rollout/retrieval_wait", "rollout/compile_grid",
          "batch", "compile_rows", "logp", "updates", "checkpoint", "other")


def test_overrides_take_the_type_of_the_key_and_name_unknown_keys():
    bench = load_bench("step_profile")
    args = bench.parse_args(["--config", str(TINY), "--override", "rollout.top_p=1", "--config.train.lld_every=0",
                             "--override", "data.train_files=a.parquet,b.parquet", "--config.model.remat=true"])
    cfg = bench.load_config(args.config, args.override)  # llds_jax.config.loader.load_config: as the launch command reads
    assert cfg.rollout.top_p == 1.0 and isinstance(cfg.rollout.top_p, float)
    assert cfg.train.lld_every == 0 and cfg.model.remat is True
    assert list(cfg.data.train_files) == ["a.parquet", "b.parquet"]
    with pytest.raises(KeyError, match="rollout.no_such_key"):
        bench.load_config(args.config, ["rollout.no_such_key=1"])
    with pytest.raises(ValueError, match="train.lld_every"):
        bench.load_config(args.config, ["train.lld_every=often"])


def small_overrides():
    """Shrinks the tiny config further where its keys allow (the demo's small world tokenizer if it has one)."""
    from llds_jax.apps import demo_config

    overrides = ["rollout.top_p=1.0", "train.lld_every=0"]
    if "tokenizer" in demo_config.section():
        overrides.append("demo.tokenizer=world")
    return [arg for o in overrides for arg in ("--override", o)]


@pytest.mark.slow
def test_step_profile_shares_add_up_and_nothing_compiles_after_step_one(tmp_path):
    out = tmp_path / "profile.json"
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # one CPU device, like a plain user run
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    cmd = [sys.executable, str(BENCH), "--config", str(TINY), "--steps", "2", "--json", str(out),
           *small_overrides()]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert tuple(result["shares"]) == PHASES
    assert sum(result["shares"].values()) == pytest.approx(1.0, abs=1e-6)
    assert all(share >= 0 for share in result["shares"].values())
    for record in result["steps"]:
        assert sum(record["phases"].values()) == pytest.approx(record["wall_s"], rel=1e-6)
    assert result["shares"]["rollout/decode"] > 0 and result["shares"]["updates"] > 0
    assert result["tokens_per_s"] > 0
    assert result["compiles_first_step"] > 0 and result["compiles_after_first_step"] == 0, result["steps"]
    assert result["recompiles_of_a_seen_signature"] == 0
    for line in ("rollout/retrieval_wait", "share (step 2)", "XLA compilations: step 1: "
                 f"{result['compiles_first_step']}, after step 1: 0"):
        assert line in proc.stdout
