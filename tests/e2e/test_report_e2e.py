"""`python -m llds_jax.train.report` on the run folder of a real tiny training run (`python -m llds_jax.launch`): every
plot drawn from the metrics the trainer logs, the summary's values equal to the log's and to the final EM."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from llds_jax.train import report
from llds_jax.data.qa import read_qa


def run_module(root, *args):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # one CPU device, like a plain user run
    proc = subprocess.run([sys.executable, "-m", *args], cwd=root, env=env, capture_output=True, text=True,
                          timeout=600)
    return proc.returncode, proc.stdout, proc.stderr


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, tiny_assets, answer_policy, config_writer, repo_root):
    """A 2-step GRPO + LLDS run of the tiny config, an evaluation at step 2 and a final one, on 4 questions: 3
    answered by the policy's city (it answers that city to everything), 1 not. Every step then holds correct
    trajectories (the LLD rate and correct-trajectory likelihood are logged, not null) and 3 of 4 are right at
    evaluation."""
    tmp = tmp_path_factory.mktemp("report_e2e")
    policy, city = answer_policy
    world = read_qa(tiny_assets["test"]) + read_qa(tiny_assets["train"])
    right = [ex for ex in world if city in ex.golden_answers][:3]
    wrong = [ex for ex in world if city not in ex.golden_answers][:1]
    assert len(right) == 3 and len(wrong) == 1
    questions = str(tmp / "questions.jsonl")
    with open(questions, "w") as f:
        for ex in right + wrong:
            f.write(json.dumps({"id": ex.id, "question": ex.question, "golden_answers": list(ex.golden_answers),
                                "data_source": ex.data_source}) + "\n")
    run_dir = str(tmp / "llds_run")
    config = config_writer(tmp / "cfg.py", tiny_assets, model_path=policy, run_dir=run_dir, **{
        "data.train_files": [questions], "data.eval_files": [questions], "train.transcripts_every": 0,
        "train.eval_max_examples": 4, "eval.max_examples": 4})
    code, out, err = run_module(repo_root, "llds_jax.launch", f"--config={config}")
    assert code == 0, err[-3000:]
    assert "training stopped after step 2 of 2" in out
    return run_dir


@pytest.mark.slow
def test_report_of_a_trained_run(trained_run, repo_root, tmp_path):
    code, out, err = run_module(repo_root, "llds_jax.train.report", trained_run)
    assert code == 0, err[-3000:]
    out_dir = os.path.join(trained_run, "report")
    expected = [os.path.join(out_dir, p.filename) for p in report.PLOTS] + [os.path.join(out_dir, "summary.md")]
    assert out.split() == expected  # every plot drawn: the trainer logs each plotted metric
    for path in expected[:-1]:
        with open(path, "rb") as f:
            data = f.read()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, path
    with open(os.path.join(out_dir, "summary.md")) as f:
        summary = f.read()
    with open(os.path.join(trained_run, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records] == [1, 2]
    rows = {}
    for line in summary.splitlines():
        if line.startswith("| "):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            rows.setdefault(cells[0], cells[1:])
    for metric in ("reward/mean", "actor/grad_norm", "actor/entropy", "lld/logp_mean_correct",
                   "rollout/valid_searches"):
        assert rows[metric][:3] == ["1–2 (n=2)", report.fmt(records[0][metric]), report.fmt(records[1][metric])]
    assert rows["lld/rate"][0] == "1–2 (n=2)"
    logged = set().union(*records)
    for plot in report.PLOTS:  # the report's metric names are the trainer's
        assert {metric for panel in plot.panels for metric, _ in panel.series} <= logged, plot.filename
    with open(os.path.join(trained_run, "eval", "final_step_2", "results.json")) as f:
        final = json.load(f)["em"]
    assert rows["final_step_2"][0] == "2"
    assert rows["mean"] == [report.fmt(final["mean"])]  # the final EM table
    assert final["mean"] == pytest.approx(0.75)
    assert rows["total steps (`train.total_steps`)"] == ["2"]
    assert "skipped lines (corrupted JSON): 0" in summary and "checkpoints: 1, 2" in summary
    assert "skipped:" not in summary and "left out" not in summary

    # The same run compared with a copy of itself: both overlaid, labelled by folder name.
    other = str(tmp_path / "grpo_run")
    shutil.copytree(trained_run, other, ignore=shutil.ignore_patterns("report", "checkpoints", "tensorboard"))
    runs = [report.read_run(trained_run), report.read_run(other)]
    fig, _ = report.plot_figure(report.PLOTS[0], runs)
    labels = [line.get_label() for line in fig.axes[0].get_lines()]
    assert "llds_run reward" in labels and "grpo_run reward" in labels
