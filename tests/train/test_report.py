"""`python -m llds_jax.train.report`: plots and summary.md of run folders written by the real MetricsWriter; overlays of
several runs; skipped plots; corrupted lines; one-line errors with exit status 2 on bad input."""
import json
import math
import os
import subprocess
import sys

import pytest

from llds_jax.train import report
from llds_jax.config import default_config
from llds_jax.train.metrics import MetricsWriter

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
STEPS = 20
REWARD = [round(0.1 + 0.02 * i, 4) for i in range(STEPS)]            # 0.1 ... 0.48
LOGP_CORRECT = [round(-0.5 - 0.01 * i, 4) for i in range(STEPS)]     # the correct-trajectory likelihood falls
GRAD_NORM = [round(0.8 + 0.05 * i, 4) for i in range(STEPS)]
NULL_STEP = 3  # no correct trajectory at this step: the correct-trajectory metrics are NaN (null in the log)


def step_metrics(step: int, lld: bool = True) -> dict[str, float]:
    """A realistic record of the trainer for `step` (1-based): LLD rate every 5 steps, evaluation every 10."""
    i = step - 1
    metrics = {
        "reward/mean": REWARD[i], "rollout/valid_searches": 1.0 + 0.05 * i, "rollout/turns": 2.0,
        "rollout/response_length": 300.0 + i, "actor/grad_norm": GRAD_NORM[i], "actor/grad_norm_max": 2 * GRAD_NORM[i],
        "actor/entropy": 0.9 - 0.01 * i, "actor/ref_kl_k3": 1e-4 * i, "loss/llds": 0.01, "llds/gate_share": 0.3,
        "perf/tokens_per_s": 1234.0,
    }
    if lld:
        correct = math.nan if step == NULL_STEP else LOGP_CORRECT[i]
        metrics.update({
            "lld/logp_mean_correct": correct, "lld/logp_mean_incorrect": -0.9 - 0.005 * i,
            "lld/logp_sum_correct": 200 * correct, "lld/logp_sum_incorrect": -400.0 - i,
            "lld/logp_mean_first_action": -0.6, "lld/logp_mean_later_actions": -0.7 - 0.01 * i,
        })
        if step % 5 == 0:
            metrics.update({"lld/rate": 0.2 + 0.1 * (step // 5), "lld/delta_traj_correct": 1.0 - 0.5 * (step // 5)})
    if step % 10 == 0:
        metrics.update({"eval/em_nq": 0.2 + 0.01 * step, "eval/em_hotpotqa": 0.1 + 0.01 * step})
        metrics["eval/em_mean"] = (metrics["eval/em_nq"] + metrics["eval/em_hotpotqa"]) / 2
    return metrics


def write_results(run_dir, name, em, counts):
    folder = os.path.join(run_dir, "eval", name)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "results.json"), "w") as f:
        json.dump({"em": em, "counts": counts}, f)


@pytest.fixture
def make_run(tmp_path):
    """`make_run(name, steps=20, lld=True, llds_enabled=True, evals=True)`: a run folder like the trainer's, its
    log written by the real MetricsWriter, its config.json by the real config's to_json_best_effort."""
    def make(name="llds", steps=STEPS, lld=True, llds_enabled=True, evals=True):
        run_dir = str(tmp_path / name)
        cfg = default_config()
        cfg.objective.llds.enabled = llds_enabled
        cfg.objective.llds.lam = 0.3
        cfg.optim.learning_rate = 2e-6
        cfg.train.total_steps = steps
        cfg.data.samples_per_prompt = 5
        os.makedirs(run_dir)
        with open(os.path.join(run_dir, "config.json"), "w") as f:
            f.write(cfg.to_json_best_effort(indent=2))
        writer = MetricsWriter(run_dir, total_steps=steps, process_index=0, console=None)
        if evals:  # the trainer's evaluation of the starting policy (train.eval_at_start), logged at step 0
            writer.write(0, {"eval/em_hotpotqa": 0.05, "eval/em_nq": 0.15, "eval/em_mean": 0.1})
        for step in range(1, steps + 1):
            writer.write(step, step_metrics(step, lld=lld))
        writer.close()
        for step in (10, 20):
            os.makedirs(os.path.join(run_dir, "checkpoints", str(step)))
        if evals:
            write_results(run_dir, "start", {"hotpotqa": 0.05, "nq": 0.15, "mean": 0.1},
                          {"hotpotqa": 50, "nq": 50})
            write_results(run_dir, "step_10", {"hotpotqa": 0.2, "nq": 0.3, "mean": 0.25}, {"hotpotqa": 5, "nq": 5})
            write_results(run_dir, f"final_step_{steps}", {"hotpotqa": 0.31, "nq": 0.42, "mean": 0.365},
                          {"hotpotqa": 50, "nq": 50})
        return run_dir
    return make


def table_rows(markdown: str) -> dict[str, list[str]]:
    """Rows of the markdown tables by their first cell."""
    rows = {}
    for line in markdown.splitlines():
        if line.startswith("| ") and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            rows.setdefault(cells[0], cells[1:])
    return rows


def assert_png(path):
    with open(path, "rb") as f:
        data = f.read()
    assert data[:8] == PNG_SIGNATURE, path
    assert len(data) > 10_000, (path, len(data))  # axes, lines and labels, not a blank canvas


def test_report_of_one_run(make_run, capsys):
    run_dir = make_run()
    assert report.main([run_dir]) == 0
    out_dir = os.path.join(run_dir, "report")
    printed = capsys.readouterr().out.split()
    expected_pngs = [p.filename for p in report.PLOTS]
    assert printed == [os.path.join(out_dir, name) for name in expected_pngs] + [os.path.join(out_dir, "summary.md")]
    for name in expected_pngs:
        assert_png(os.path.join(out_dir, name))
    with open(os.path.join(out_dir, "summary.md")) as f:
        summary = f.read()
    rows = table_rows(summary)
    # metric: steps, first, last, min, max
    assert rows["reward/mean"] == ["1–20 (n=20)", "0.1", "0.48", "0.1", "0.48"]
    assert rows["actor/grad_norm"] == ["1–20 (n=20)", "0.8", "1.75", "0.8", "1.75"]
    assert rows["lld/logp_mean_correct"] == ["1–20 (n=19)", "-0.5", "-0.69", "-0.69", "-0.5"]  # step 3 is null
    assert rows["lld/rate"] == ["5–20 (n=4)", "0.3", "0.6", "0.3", "0.6"]
    assert rows["eval/em_mean"][:3] == ["0–20 (n=3)", "0.1", "0.35"]
    # config highlights
    assert rows["LLDS enabled (`objective.llds.enabled`)"] == ["True"]
    assert rows["LLDS lambda (`objective.llds.lam`)"] == ["0.3"]
    assert rows["learning rate (`optim.learning_rate`)"] == ["2e-06"]
    assert rows["total steps (`train.total_steps`)"] == ["20"]
    assert rows["group size (samples per prompt) (`data.samples_per_prompt`)"] == ["5"]
    # evaluations: all results.json by step, the start and final ones marked; the final EM table
    assert rows["start"] == ["0", "0.05", "0.15", "0.1", "100"]
    assert rows["step_10"] == ["10", "0.2", "0.3", "0.25", "10"]
    assert rows["final_step_20"] == ["20", "0.31", "0.42", "0.365", "100"]
    assert "## Final EM" in summary and rows["nq"] == ["0.42"] and rows["mean"] == ["0.365"]
    # the paper's reading: the periodic evaluation rated best (step 20's 0.35 over step 10's 0.25), next to the final
    assert rows["llds"] == ["20", "0.35", "0.365"]
    assert "skipped lines (corrupted JSON): 0" in summary
    assert "checkpoints: 10, 20" in summary
    assert "objective: GRPO + LLDS (variant llds, lambda 0.3" in summary
    for name in expected_pngs:
        assert f"]({name})" in summary  # embedded with relative links
    assert "skipped" not in summary.replace("skipped lines", "")


def test_figures_hold_the_logged_values(make_run):
    run = report.read_run(make_run())
    plots = {p.filename: p for p in report.PLOTS}
    fig, missing = report.plot_figure(plots["likelihood.png"], [run])
    assert missing == []
    token_mean = fig.axes[0]
    lines = {line.get_label(): line for line in token_mean.get_lines()}
    assert sorted(lines) == ["correct", "incorrect"]
    expected_steps = [s for s in range(1, STEPS + 1) if s != NULL_STEP]
    assert list(lines["correct"].get_xdata()) == expected_steps
    assert list(lines["correct"].get_ydata()) == [LOGP_CORRECT[s - 1] for s in expected_steps]
    fig, _ = report.plot_figure(plots["reward_em.png"], [run])
    lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
    assert list(lines["reward"].get_ydata()) == REWARD
    # EM during training: the log's eval/em_* and the non-final eval folders (step_10 overrides the log there).
    assert list(lines["EM mean"].get_xdata()) == [0, 10, 20]
    assert list(lines["EM mean"].get_ydata()) == pytest.approx([0.1, 0.25, (0.4 + 0.3) / 2])
    assert list(lines["EM mean (final eval)"].get_ydata()) == [0.365]


def test_compare_overlays_runs(make_run, tmp_path, capsys):
    grpo = make_run("grpo", steps=12, llds_enabled=False, evals=False)
    llds = make_run("llds")
    out_dir = str(tmp_path / "cmp")
    assert report.main([llds, "--compare", grpo, "--out", out_dir]) == 0
    assert capsys.readouterr().out.split()[-1] == os.path.join(out_dir, "summary.md")
    for p in report.PLOTS:
        assert_png(os.path.join(out_dir, p.filename))
    runs = [report.read_run(llds), report.read_run(grpo)]
    fig, _ = report.plot_figure(report.PLOTS[1], runs)
    labels = [line.get_label() for line in fig.axes[0].get_lines()]
    assert labels == ["llds correct", "llds incorrect", "grpo correct", "grpo incorrect"]
    assert len(fig.axes[0].get_lines()[2].get_xdata()) == 11  # grpo: 12 steps, one null
    with open(os.path.join(out_dir, "summary.md")) as f:
        summary = f.read()
    rows = table_rows(summary)
    assert "## Run llds" in summary and "## Run grpo" in summary
    assert rows["key"] == ["llds", "grpo"]
    assert rows["LLDS enabled (`objective.llds.enabled`)"] == ["True", "False"]
    assert "objective: GRPO (LLDS off)" in summary
    assert rows["data_source"] == ["llds", "grpo"] and rows["mean"] == ["0.365", "—"]  # final EM side by side
    assert "No `eval/*/results.json` in the run folder." in summary


def test_eval_folder_steps():
    assert [report.eval_step(n) for n in ("step_40", "final_step_1005", "start", "initial", "warm_start", "other")] \
        == [40, 1005, 0, 0, 0, None]


def test_same_folder_names_are_told_apart(tmp_path):
    assert report.unique_names([str(tmp_path / "a" / "run"), str(tmp_path / "b" / "run")]) == ["a/run", "b/run"]
    assert report.unique_names(["x/run", "x/run"]) == ["x/run [1]", "x/run [2]"]


def test_absent_metrics_skip_plots_with_a_note(make_run):
    run_dir = make_run(lld=False, evals=False)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:  # keep lld/rate at one step, no Delta_traj
        for record in records:
            if record["step"] == 5:
                record["lld/rate"] = 0.5
            f.write(json.dumps(record) + "\n")
    paths = report.write_report([run_dir])
    names = [os.path.basename(p) for p in paths]
    assert "likelihood.png" not in names and "lld.png" in names and "reward_em.png" in names
    with open(os.path.join(run_dir, "report", "summary.md")) as f:
        summary = f.read()
    assert "`likelihood.png` skipped: none of its metrics (lld/logp_mean_correct" in summary
    assert "![Likelihood" not in summary
    assert "_Panel left out (no finite value of its metrics): Delta_traj of correct trajectories (mean)._" in summary
    assert "`lld/logp_mean_correct`" in summary  # listed among the key metrics without a value
    assert "No `eval/*/results.json` in the run folder." in summary


def test_corrupted_lines_are_reported_and_skipped(make_run, capsys, monkeypatch):
    monkeypatch.setattr(report, "PLOTS", report.PLOTS[:1])  # the plots are tested above
    run_dir = make_run(evals=False)
    path = os.path.join(run_dir, "metrics.jsonl")
    with open(path) as f:
        lines = f.read().splitlines()
    lines[4] = lines[4][: len(lines[4]) // 2]  # step 5 cut in the middle
    lines.append("[1, 2]")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    assert report.main([run_dir]) == 0
    err = capsys.readouterr().err
    assert f"{path}:5: skipped: not valid JSON" in err
    assert f"{path}:21: skipped: not a metrics record with an integer 'step'" in err
    with open(os.path.join(run_dir, "report", "summary.md")) as f:
        summary = f.read()
    assert "skipped lines (corrupted JSON): 2" in summary
    assert table_rows(summary)["reward/mean"][0] == "1–20 (n=19)"


@pytest.mark.parametrize("case", ["missing_folder", "not_a_folder", "no_metrics", "empty_metrics", "all_corrupted"])
def test_bad_input_is_one_line_with_status_2(tmp_path, capsys, case):
    run_dir = tmp_path / "run"
    metrics = run_dir / "metrics.jsonl"
    expected = {"missing_folder": f"run folder not found: {run_dir}",
                "not_a_folder": f"not a run folder (not a directory): {run_dir}",
                "no_metrics": f"no metrics file: {metrics}",
                "empty_metrics": f"metrics file is empty: {metrics}",
                "all_corrupted": f"metrics file has no readable record (1 corrupted lines): {metrics}"}[case]
    if case == "not_a_folder":
        run_dir.write_text("")
    elif case != "missing_folder":
        run_dir.mkdir()
        if case == "empty_metrics":
            metrics.write_text("\n")
        elif case == "all_corrupted":
            metrics.write_text("{oops\n")
    assert report.main([str(run_dir)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    error_lines = [line for line in captured.err.splitlines() if "skipped" not in line]
    assert error_lines == [f"llds_jax.train.report: error: {expected}"]
    assert not (run_dir / "report").exists()


def test_bad_compare_folder_is_an_error(make_run, tmp_path, capsys):
    missing = str(tmp_path / "nowhere")
    assert report.main([make_run(evals=False), "--compare", missing]) == 2
    assert capsys.readouterr().err == f"llds_jax.train.report: error: run folder not found: {missing}\n"


def test_module_command_exit_status(tmp_path):
    missing = str(tmp_path / "nowhere")
    proc = subprocess.run([sys.executable, "-m", "llds_jax.train.report", missing], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert proc.stderr == f"llds_jax.train.report: error: run folder not found: {missing}\n"
