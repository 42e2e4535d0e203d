"""The demo's whole pipeline through `python -m llds_jax.launch` at tiny sizes: generated world with a trained
tokenizer, demonstrations, cached warm start, evaluation before RL, GRPO + LLDS, the start-vs-final EM table, the
report; and the GRPO vs LLDS comparison's commands."""
import json
import os
import subprocess
import sys

import pytest

from llds_jax.apps import demo_compare
from llds_jax.model.tokenizer import chat_template, load_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs", "tiny_test.py")


def run(*args):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # one CPU device, like a plain user run
    proc = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    return proc.returncode, proc.stdout, proc.stderr


@pytest.mark.slow
def test_world_tokenizer_warm_start_rl_and_report(tmp_path):
    run_dir, assets, warm = tmp_path / "run", tmp_path / "assets", tmp_path / "warm_start"
    flags = [f"--config={TINY}", f"--config.run_dir={run_dir}", f"--config.demo.assets_dir={assets}",
             "--config.demo.tokenizer=world", "--config.demo.vocab_size=512", "--config.sft.enabled=True",
             f"--config.sft.output_dir={warm}", "--config.sft.steps=2", "--config.sft.batch_size=2",
             "--config.sft.warmup_steps=1", "--config.sft.log_every=1", "--config.train.eval_at_start=True",
             "--config.train.total_steps=1", "--config.train.eval_every=0"]
    code, out, err = run("llds_jax.launch", *flags)
    assert code == 0, err[-3000:]
    assert "warm start step 2/2" in out and "warm start: done" in out
    trained = load_tokenizer(str(assets / "model"), fallback_chat_template=None)
    assert trained.chat_template == chat_template("base") and len(trained) <= 512
    with open(warm / "warm_start.json") as f:
        assert json.load(f)["demonstrations"] > 0
    with open(run_dir / "config.json") as f:
        assert json.load(f)["model"]["path"] == str(warm)  # RL starts from the warm start
    with open(run_dir / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records] == [0, 1] and "eval/em_mean" in records[0]
    with open(run_dir / "eval" / "start" / "results.json") as f:
        start = json.load(f)["em"]
    header = next(line for line in out.splitlines() if line.startswith("data_source"))
    assert header.split() == ["data_source", "start", "step", "1", "n"]
    mean_row = next(line for line in out.splitlines() if line.startswith("mean "))
    assert float(mean_row.split()[1]) == pytest.approx(start["mean"], abs=5e-4)
    searches = out[out.index("searches per question"):].splitlines()  # the second table: searches per question
    with open(run_dir / "eval" / "start" / "results.json") as f:
        start_searches = json.load(f)["searches"]["mean"]
    mean_row = next(line for line in searches if line.startswith("mean "))
    assert float(mean_row.split()[1]) == pytest.approx(start_searches, abs=5e-4)

    code, out, err = run("llds_jax.launch", *flags, "--mode=sft")  # cached: nothing trained again
    assert code == 0, err[-3000:]
    assert "reusing" in out and "warm start step" not in out

    code, out, err = run("llds_jax.train.report", str(run_dir))
    assert code == 0, err[-3000:]
    with open(run_dir / "report" / "summary.md") as f:
        summary = f.read()
    assert "start" in summary


def test_comparison_runs_grpo_then_llds_with_the_same_config_then_the_report(capsys):
    assert demo_compare.main(["--config=configs/demo_cpu_grpo.py", "--out=runs/cmp", "--dry-run", "--",
                              "--config.train.total_steps=3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3
    grpo, llds, report = lines
    assert "llds_jax.launch --config=configs/demo_cpu_grpo.py --config.run_dir=runs/cmp/grpo" in grpo
    assert grpo.endswith("--config.objective.llds.enabled=False --config.train.total_steps=3")
    assert llds.endswith("--config.objective.llds.enabled=True --config.objective.llds.lam=0.2 "
                         "--config.objective.llds.gate=action --config.train.total_steps=3")
    assert report.endswith("llds_jax.train.report runs/cmp/llds --compare runs/cmp/grpo --out runs/cmp/report")


def test_comparison_of_a_missing_config_names_it(capsys):
    assert demo_compare.main(["--config=configs/x.py", "--dry-run"]) == 2
    assert "config file not found: configs/x.py" in capsys.readouterr().err


@pytest.mark.slow
def test_the_demo_trains_and_evaluates_with_the_retriever_on_the_devices(tmp_path):
    """`--config.demo.retriever=e5_device`: the assets gain the world's e5 Flat index (a small random BERT's vectors),
    the run's retriever searches it on the devices (the start-up check searches), and the run trains and evaluates
    to the end."""
    run_dir = tmp_path / "run"
    code, out, err = run("llds_jax.launch", f"--config={TINY}", f"--config.run_dir={run_dir}",
                         "--config.demo.retriever=e5_device")
    assert code == 0, err[-3000:]
    with open(run_dir / "config.json") as f:
        retriever = json.load(f)["retriever"]
    assert retriever == {"backend": "e5_device", "index_path": str(run_dir / "assets" / "e5_index"),
                         "encoder_path": str(run_dir / "assets" / "e5"), "max_length": 128}
    assert "retriever e5_device" in out and "training stopped after step 2 of 2" in out
    with open(run_dir / "metrics.jsonl") as f:
        assert "eval/em_mean" in [json.loads(line) for line in f][-1]
