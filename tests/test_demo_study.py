"""The study command (python -m llds_jax.apps.demo_study): its statistics on hand-made series, its plan, scheduling
and estimate, and a real tiny study (2 seeds x 2 arms x 2 steps, subprocesses) whose table is checked against the runs'
own metric and evaluation files."""
import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from llds_jax.apps import demo_study
from llds_jax.apps.study import budget, outcomes, plan, plots, runner, stats, table
from llds_jax.apps.study.outcomes import LIKELIHOOD, LLD_RATE, REWARD, RunResult

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny_test.py")
STRESS = os.path.join(ROOT, "configs", "demo_cpu_grpo.py")


# ----- statistics -----------------------------------------------------------------------------------------------------
def test_bootstrap_interval_of_equal_values_is_that_value():
    assert stats.bootstrap_interval([0.25, 0.25, 0.25]) == (0.25, 0.25)
    assert stats.bootstrap_interval([0.7]) == (0.7, 0.7)


def test_bootstrap_interval_of_zero_and_one_spans_both():
    # Means of 2 draws are 0, 0.5 or 1 with chances 1/4, 1/2, 1/4: the 2.5% and 97.5% quantiles are 0 and 1.
    assert stats.bootstrap_interval([0.0, 1.0]) == (0.0, 1.0)


def test_bootstrap_interval_is_the_percentile_interval_of_resampled_means_with_a_fixed_seed():
    values = [0.1, 0.4, 0.9, 0.3]
    draws = np.random.default_rng(7).integers(0, 4, size=(50, 4))
    means = np.asarray(values)[draws].mean(axis=1)
    expected = (float(np.quantile(means, 0.05)), float(np.quantile(means, 0.95)))
    assert stats.bootstrap_interval(values, confidence=0.9, resamples=50, seed=7) == expected
    assert stats.bootstrap_interval(values) == stats.bootstrap_interval(values)  # the default seed is fixed
    low, high = stats.bootstrap_interval(values)
    assert 0.1 < low < np.mean(values) < high < 0.9


@pytest.mark.parametrize("values", [[], [[0.1, 0.2]]])
def test_bootstrap_interval_rejects_what_is_not_a_list_of_numbers(values):
    with pytest.raises(ValueError, match="non-empty list"):
        stats.bootstrap_interval(values)


@pytest.mark.parametrize("steps, rewards, expected", [
    ([1, 2, 3, 4, 5, 6], [0.5, 0.05, 0.0, 0.09, 0.2, 0.0], 2),
    ([1, 2, 3, 4, 5, 6, 7], [0.5, 0.05, 0.0, 0.2, 0.0, 0.0, 0.0], 5),  # two below, then a recovery: not yet
    ([1, 2, 3], [0.1, 0.1, 0.1], None),                               # 0.1 is not below 0.1
    ([1, 2, 4, 5], [0.0, 0.0, 0.0, 0.0], None),                       # step 3 missing: no 3 consecutive steps
    ([3, 4, 5], [0.0, 0.0, 0.0], 3),
    ([], [], None),
])
def test_collapse_step_is_the_first_of_three_consecutive_steps_below_a_tenth(steps, rewards, expected):
    assert stats.collapse_step(steps, rewards) == expected


def test_collapse_rule_is_the_reward_run_or_a_final_em_below_005():
    assert stats.collapsed(4, 0.9)
    assert stats.collapsed(None, 0.049)
    assert not stats.collapsed(None, 0.05)


# ----- plan -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, seeds", [("3", [0, 1, 2]), ("2-4", [2, 3, 4]), ("5,", [5]), ("1,3", [1, 3])])
def test_seed_lists(text, seeds):
    assert plan.parse_seeds(text) == seeds


@pytest.mark.parametrize("text", ["x", "0", "1,1", "-1,"])
def test_bad_seed_lists_name_the_flag(text):
    with pytest.raises(plan.StudyError, match="--seeds"):
        plan.parse_seeds(text)


def test_arms_take_a_seed_count_and_llds_action_is_llds():
    assert plan.parse_arms("grpo,llds_action,grpo_kl10:4") == [("grpo", None), ("llds", None), ("grpo_kl10", 4)]
    with pytest.raises(plan.StudyError, match="twice"):
        plan.parse_arms("llds,llds_action")
    with pytest.raises(plan.StudyError, match="unknown arm 'gpro'"):
        plan.parse_arms("gpro")
    with pytest.raises(plan.StudyError, match="positive integer"):
        plan.parse_arms("grpo:0")


def test_controls_scale_the_settings_own_values_and_llds_arms_set_the_gate():
    stress = plan.load(STRESS, [])
    assert (stress.optim.learning_rate, stress.objective.kl_coef) == (5e-4, 1e-3)
    assert plan.ARMS["grpo_low_lr"].overrides(stress) == ["objective.llds.enabled=False",
                                                          "optim.learning_rate=0.0002"]
    assert plan.ARMS["grpo_kl10"].overrides(stress) == ["objective.llds.enabled=False", "objective.kl_coef=0.01"]
    assert plan.ARMS["llds"].overrides(stress) == ["objective.llds.enabled=True", "objective.llds.lam=0.2",
                                                   "objective.llds.gate=action"]
    for gate in ("token", "response"):
        assert f"objective.llds.gate={gate}" in plan.ARMS[f"llds_{gate}"].overrides(stress)


def test_plan_gives_each_seed_its_world_and_warm_start_and_each_run_its_folder(tmp_path):
    out = str(tmp_path / "study")
    settings = plan.parse_settings("stress,paper_shaped")
    study = plan.make_plan(out, settings, [("grpo", None), ("llds", 1)], [3, 5], ["train.total_steps=7"])
    assert [r.name for r in study.runs] == ["stress/grpo/seed_3", "stress/grpo/seed_5", "stress/llds/seed_3",
                                            "paper_shaped/grpo/seed_3", "paper_shaped/grpo/seed_5",
                                            "paper_shaped/llds/seed_3"]
    assert all(r.total_steps == 7 for r in study.runs)
    run = study.runs[1]
    cfg = plan.load(run.config, run.overrides)
    assert cfg.seed == 5 and cfg.run_dir == os.path.join(out, "runs", "stress", "grpo", "seed_5")
    assert cfg.demo.assets_dir == os.path.join(out, "seeds", "seed_5", "world")
    assert cfg.sft.output_dir == os.path.join(out, "seeds", "seed_5", "warm_start")
    assert sorted(study.warm_starts) == [3, 5] and study.warm_starts[5].command("sft")[4] == "--mode=sft"


def test_settings_that_need_different_warm_starts_for_one_seed_are_refused(tmp_path):
    other = tmp_path / "other.py"
    other.write_text("from configs import demo_cpu_grpo\n\n\ndef get_config():\n    c = demo_cpu_grpo.get_config()\n"
                     "    c.sft.steps = 300\n    return c\n")
    settings = {"stress": STRESS, "other": str(other)}
    with pytest.raises(plan.StudyError, match=r"differ in sft\.steps \(400 vs 300\)"):
        plan.make_plan(str(tmp_path), settings, [("grpo", None)], [0])


def test_a_study_of_a_config_without_its_final_evaluation_is_refused(tmp_path):
    with pytest.raises(plan.StudyError, match="train.final_eval is off"):
        plan.make_plan(str(tmp_path), {"stress": STRESS}, [("grpo", None)], [0], ["train.final_eval=False"])


# ----- scheduling and estimate ----------------------------------------------------------------------------------------
def _job(tmp_path, name, code, after=()):
    script = f"import sys, time; time.sleep(0.2); print('{name}'); sys.exit({code})"
    return runner.Job(name, (sys.executable, "-c", script), str(tmp_path / f"{name}.log"), after)


def test_printed_and_logged_commands_hide_secrets():
    job = runner.Job("run", ("python", "-m", "llds_jax.launch", "--config.retriever.password=hunter2",
                             "--config.retriever.hosts=https://elastic:s3cr3t@es:9200", "--config.seed=3"), None)
    assert job.shell() == ("python -m llds_jax.launch '--config.retriever.password=***' "
                           "'--config.retriever.hosts=https://***@es:9200' --config.seed=3")


def test_jobs_run_after_those_they_wait_for_and_are_skipped_when_one_failed(tmp_path):
    started = []
    jobs = [_job(tmp_path, "a", 0), _job(tmp_path, "b", 3), _job(tmp_path, "c", 0, ("a",)),
            _job(tmp_path, "d", 0, ("b",)), _job(tmp_path, "e", 0, ("d",))]
    outcomes = runner.run_jobs(jobs, 2, on_start=lambda job: started.append(job.name), poll_s=0.05)
    status = {o.job.name: o.status for o in outcomes}
    assert status == {"a": 0, "b": 3, "c": 0, "d": None, "e": None}
    assert started == ["a", "b", "c"]
    assert (tmp_path / "c.log").read_text().splitlines()[-1] == "c"
    with pytest.raises(ValueError, match="not earlier jobs"):
        runner.run_jobs([_job(tmp_path, "x", 0, ("y",))], 1)


def test_estimate_uses_measured_machine_seconds_per_setting_else_the_constants(tmp_path):
    runs = [plan.Run(s, "grpo", 0, "c.py", (), str(tmp_path / s), 10) for s in ("stress", "default")]
    constant = budget.rates([])
    assert budget.estimate_s(runs, 2, constant) == 20 * budget.RUN_STEP_S + 2 * budget.WARM_START_S
    timings = [{"kind": "run", "setting": "stress", "steps": 10, "seconds": 200.0, "jobs": 2, "status": 0},
               {"kind": "run", "setting": "stress", "steps": 10, "seconds": 400.0, "jobs": 2, "status": 0},
               {"kind": "run", "setting": "stress", "steps": 10, "seconds": 9.0, "jobs": 2, "status": 1},
               {"kind": "warm_start", "seconds": 600.0, "jobs": 2, "status": 0, "built": True},
               {"kind": "warm_start", "seconds": 20.0, "jobs": 2, "status": 0, "built": False}]
    measured = budget.rates(timings)
    assert (measured.step_s, measured.step_s_by_setting, measured.warm_start_s) == (15.0, {"stress": 15.0}, 300.0)
    assert budget.estimate_s(runs, 1, measured) == 150.0 + 150.0 + 300.0  # default: the overall rate


# ----- what a run shows ----
def _write_run(run_dir, records, final_em=None, steps=6):
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(record) + "\n" for record in records)
    if final_em is not None:
        final = os.path.join(run_dir, "eval", f"final_step_{steps}")
        os.makedirs(final)
        with open(os.path.join(final, "results.json"), "w") as f:
            json.dump({"em": {"single_hop": 2 * final_em, "two_hop": 0.0, "mean": final_em}, "counts": {}}, f)


def test_a_runs_result_comes_from_its_metrics_and_final_evaluation(tmp_path):
    rewards = [0.6, 0.3, 0.05, 0.0, 0.08, 0.0]
    rates = [0.2, None, 0.6, None, None, 1.0]  # null: no correct trajectory at that step
    records = [{"step": 0, "eval/em_mean": 0.1}] + [
        {"step": k + 1, REWARD: r, LLD_RATE: q, LIKELIHOOD: -0.1 * k} for k, (r, q) in enumerate(zip(rewards, rates))]
    run = plan.Run("stress", "grpo", 3, "c.py", (), str(tmp_path / "run"), 6)
    _write_run(run.run_dir, records, final_em=0.25)
    result = outcomes.read_result(run)
    assert (result.setting, result.arm, result.seed, result.final_em) == ("stress", "grpo", 3, 0.25)
    assert (result.collapse_step, result.collapsed) == (3, True)
    assert result.lld_rate_mean == pytest.approx(0.6, abs=1e-12)
    assert result.curves[REWARD] == ([1, 2, 3, 4, 5, 6], rewards)
    assert result.curves[LLD_RATE] == ([1, 3, 6], [0.2, 0.6, 1.0])

    unfinished = plan.Run("stress", "llds", 3, "c.py", (), str(tmp_path / "unfinished"), 6)
    _write_run(unfinished.run_dir, records[:3])
    with pytest.raises(plan.StudyError, match="stress/llds/seed_3: no final evaluation in .*final_step_6"):
        outcomes.read_result(unfinished)


def test_each_setting_gets_a_figure_with_one_line_per_seed_and_one_colour_per_arm(tmp_path):
    results = [_result("grpo", 0, 0.5, rate=0.4), _result("grpo", 1, 0.2, rate=0.1), _result("llds", 0, 0.7)]
    fig = plots.setting_figure("stress", results)
    reward_ax, likelihood_ax, rate_ax = fig.axes
    # grpo: 2 seeds and their mean; llds: 1 seed, no mean; llds seed 0 logged no LLD rate.
    assert len(reward_ax.lines) == 4 and len(rate_ax.lines) == 3
    assert [line.get_color() for line in reward_ax.lines][:3] == [reward_ax.lines[0].get_color()] * 3
    assert reward_ax.lines[3].get_color() != reward_ax.lines[0].get_color()
    assert rate_ax.lines[2].get_linewidth() > rate_ax.lines[0].get_linewidth()
    assert list(rate_ax.lines[2].get_ydata()) == pytest.approx([0.25])
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["grpo (mean of 2)", "llds"]
    assert plots.write(results, str(tmp_path)) == [str(tmp_path / "plots" / "stress.png")]
    assert (tmp_path / "plots" / "stress.png").read_bytes()[:4] == b"\x89PNG"


def test_mean_curve_averages_the_seeds_that_have_each_step():
    steps, values = plots.mean_curve([([1, 2, 3], [0.2, 0.4, 0.6]), ([1, 3], [0.0, 1.0]), ([4], [0.5])])
    assert steps == [1, 2, 3, 4] and values == pytest.approx([0.1, 0.4, 0.8, 0.5])


# ----- table ----------------------------------------------------------------------------------------------------------
def _result(arm, seed, em, step=None, rate=None):
    curves = {REWARD: ([1], [0.5]), LIKELIHOOD: ([1], [-0.1]),
              LLD_RATE: ([1], [rate]) if rate is not None else ([], [])}
    return RunResult("stress", arm, seed, em, step, stats.collapsed(step, em), rate, curves)


def test_table_rows_aggregate_each_arm_over_its_seeds(tmp_path):
    results = [_result("grpo", 1, 0.0, step=17, rate=0.6), _result("grpo", 0, 0.5, rate=0.4),
               _result("llds", 0, 0.7, rate=0.3), _result("llds", 1, 0.03)]
    grpo, llds = table.rows(results)
    assert (grpo.arm, grpo.seeds, grpo.final_em, grpo.em_mean) == ("grpo", [0, 1], [0.5, 0.0], 0.25)
    assert (grpo.em_low, grpo.em_high) == (0.0, 0.5)
    assert (grpo.collapsed, grpo.collapse_steps, grpo.lld_rate_mean) == (1, [None, 17], 0.5)
    assert (llds.collapsed, llds.collapse_steps, llds.lld_rates, llds.lld_rate_mean) == (1, [None, None],
                                                                                          [0.3, None], 0.3)
    paths = table.write([grpo, llds], results, str(tmp_path))
    text = (tmp_path / "table.md").read_text()
    assert ("| stress | grpo: GRPO (LLDS off) | 2 | 0.250 [0.000, 0.500] | 0.500 0.000 | 1/2 | 17 (seed 1) | 0.500 "
            "| — |") in text
    # llds - grpo on seeds 0 and 1: 0.7 - 0.5 and 0.03 - 0.0.
    assert (llds.vs_grpo, llds.vs_grpo_seeds) == (pytest.approx([0.2, 0.03]), [0, 1])
    assert llds.vs_grpo_mean == pytest.approx(0.115)
    assert (llds.vs_grpo_low, llds.vs_grpo_high) == stats.bootstrap_interval(llds.vs_grpo)
    assert "| +0.115 [+0.030, +0.200] (2 seeds) |" in text
    assert "3 consecutive steps" in text
    assert json.loads((tmp_path / "table.json").read_text())["rows"][1]["final_em"] == [0.7, 0.03]
    assert (tmp_path / "table.csv").read_text().splitlines()[1] == ("stress,grpo,2,0;1,0.25,0.0,0.5,0.5;0.0,1,;17,0.5"
                                                                    ",,,,")
    # A seed GRPO does not have is left out of the paired comparison.
    _, lone = table.rows(results + [_result("llds", 2, 0.9)])
    assert (lone.seeds, lone.vs_grpo_seeds) == ([0, 1, 2], [0, 1])
    assert len(paths) == 4


# ----- the command ----------------------------------------------------------------------------------------------------
def test_dry_run_prints_the_estimate_and_the_commands_and_skips_finished_runs(tmp_path, capsys):
    out = str(tmp_path / "study")
    final = os.path.join(out, "runs", "stress", "grpo", "seed_0", "eval", "final_step_20")
    os.makedirs(final)
    with open(os.path.join(final, "results.json"), "w") as f:
        json.dump({"em": {"mean": 0.5}}, f)
    assert demo_study.main(["--seeds", "2", "--out", out, "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == (f"study {out}: 4 runs over 2 seeds; 1 finished (skipped), 3 to run, 2 worlds + warm starts "
                        "to build")
    assert lines[3].startswith("estimated wall time: 18m22s (60 run steps at 8.7 s, 2 warm starts at 290 s")
    commands = [line for line in lines if line.startswith("+ ")]
    assert [("--mode=sft" in c, c.split("--config.run_dir=")[1].split()[0]) for c in commands] == [
        (True, f"{out}/runs/stress/grpo/seed_0"),  # seed 0's world and warm start, loaded as its first run's
        (False, f"{out}/runs/stress/llds/seed_0"),
        (True, f"{out}/runs/stress/grpo/seed_1"), (False, f"{out}/runs/stress/grpo/seed_1"),
        (False, f"{out}/runs/stress/llds/seed_1")]
    with pytest.raises(SystemExit):
        demo_study.main(["--seeds", "2", "--out", out, "--dry-run", "--", "train.total_steps=2"])
    assert "must be --config.KEY=VALUE overrides, got 'train.total_steps=2'" in capsys.readouterr().err


def test_report_writes_the_outputs_of_the_finished_runs_and_launches_nothing(tmp_path, capsys):
    out = str(tmp_path / "study")
    records = [{"step": k, REWARD: 0.5, LLD_RATE: 0.25, LIKELIHOOD: -0.1} for k in range(1, 21)]
    _write_run(os.path.join(out, "runs", "stress", "grpo", "seed_1"), records, final_em=0.375, steps=20)
    assert demo_study.main(["--seeds", "2", "--out", out, "--report"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"study {out}: 1 of 4 runs finished"
    assert lines[-1] == ("not in the outputs (not finished): stress/grpo/seed_0, stress/llds/seed_0, "
                         "stress/llds/seed_1")
    rows = json.loads(open(os.path.join(out, "table.json")).read())["rows"]
    assert [(r["arm"], r["seeds"], r["final_em"], r["lld_rate_mean"]) for r in rows] == [("grpo", [1], [0.375], 0.25)]
    assert os.path.exists(os.path.join(out, "plots", "stress.png"))
    assert not os.path.exists(os.path.join(out, "logs")) and not os.path.exists(os.path.join(out, "seeds"))
    with pytest.raises(SystemExit):
        demo_study.main(["--out", out, "--report", "--dry-run"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_runs_csv_reads_back_what_the_table_wrote_and_names_a_bad_value(tmp_path):
    results = [_result("grpo", 0, 0.5, rate=0.4), _result("grpo", 1, 0.0, step=17), _result("llds", 0, 0.7)]
    table.write(table.rows(results), results, str(tmp_path))
    read = table.read_runs(str(tmp_path / "runs.csv"))
    assert [dataclasses.replace(r, curves={}) for r in read] == [dataclasses.replace(r, curves={}) for r in results]
    assert all(r.curves == {REWARD: ([], []), LIKELIHOOD: ([], []), LLD_RATE: ([], [])} for r in read)
    lines = (tmp_path / "runs.csv").read_text().splitlines()
    bad = tmp_path / "bad.csv"
    bad.write_text("\n".join([lines[0], lines[1], lines[2].replace(",17,True,", ",17,yes,")]) + "\n")
    with pytest.raises(plan.StudyError, match=r"bad.csv line 3: column collapsed must be True or False, got 'yes'"):
        table.read_runs(str(bad))
    bad.write_text("setting,arm,seed,final_em\nstress,grpo,0,0.5\n")
    with pytest.raises(plan.StudyError, match="bad.csv line 1: .* missing collapse_step, collapsed, lld_rate_mean"):
        table.read_runs(str(bad))


def test_report_takes_the_runs_not_finished_here_from_a_recorded_runs_csv(tmp_path, capsys, monkeypatch):
    out = str(tmp_path / "study")
    plotted = []
    write_plots = plots.write
    monkeypatch.setattr(plots, "write", lambda results, folder: plotted.append([r.name for r in results]) or
                        write_plots(results, folder))
    records = [{"step": k, REWARD: 0.5, LLD_RATE: 0.25, LIKELIHOOD: -0.1} for k in range(1, 21)]
    _write_run(os.path.join(out, "runs", "stress", "grpo", "seed_1"), records, final_em=0.375, steps=20)
    recorded = [_result("grpo", 1, 0.375, rate=0.25), _result("llds", 0, 0.5, rate=0.125)]
    table.write(table.rows(recorded), recorded, str(tmp_path / "earlier"))
    csv_path = str(tmp_path / "earlier" / "runs.csv")
    assert demo_study.main(["--seeds", "2", "--out", out, "--report", "--recorded", csv_path]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == f"runs not finished here taken from {csv_path} (in the table, not the plots): 1"
    assert lines[2] == "stress/grpo/seed_1: reproduces the record exactly (final EM 0.375000)"
    assert lines[-1] == "not in the outputs (not finished): stress/grpo/seed_0, stress/llds/seed_1"
    rows = json.loads(open(os.path.join(out, "table.json")).read())["rows"]
    assert [(r["arm"], r["seeds"], r["final_em"], r["vs_grpo"]) for r in rows] == [
        ("grpo", [1], [0.375], []), ("llds", [0], [0.5], [])]
    assert plotted == [["stress/grpo/seed_1"]]  # the recorded llds run has no curves to draw

    # A recorded number the run here does not reproduce is named with both values.
    recorded[0] = _result("grpo", 1, 0.5, rate=0.25)
    table.write(table.rows(recorded), recorded, str(tmp_path / "earlier"))
    assert demo_study.main(["--seeds", "2", "--out", out, "--report", "--recorded", csv_path]) == 0
    assert "stress/grpo/seed_1: final_em 0.375 here, 0.5 recorded" in capsys.readouterr().out.splitlines()
    with pytest.raises(SystemExit):
        demo_study.main(["--out", out, "--recorded", csv_path])
    assert "--recorded is only read by --report" in capsys.readouterr().err
    assert demo_study.main(["--out", out, "--report", "--recorded", str(tmp_path / "none.csv")]) == 2
    assert "error: --recorded: " in capsys.readouterr().err


@pytest.mark.slow
def test_a_tiny_study_runs_and_its_table_matches_the_runs_own_files(tmp_path):
    out = tmp_path / "study"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)  # one CPU device per run, as on the command line
    # A warm start on guessing demonstrations long enough to answer in the format (one memorized value per seed's
    # world), longer turns and every test question: some final EM and train rewards are not 0, so the table's
    # numbers can be told apart.
    tiny = {"demo.tokenizer": "world", "demo.vocab_size": 512, "demo.search_fraction": 0.0, "sft.enabled": True,
            "sft.steps": 300, "sft.batch_size": 16, "sft.learning_rate": 1e-2, "sft.warmup_steps": 5,
            "sft.log_every": 100, "rollout.max_turn_tokens": 32, "data.prompts_per_step": 4,
            "data.samples_per_prompt": 4, "optim.mini_batch_size": 8, "optim.micro_batch_size": 4,
            "train.eval_every": 0, "train.total_steps": 2, "eval.max_examples": 0}
    command = [sys.executable, "-m", "llds_jax.apps.demo_study", f"--settings=tiny={TINY}", "--arms=grpo,llds",
               "--seeds=2", f"--out={out}", "--jobs=2", "--", *(f"--config.{k}={v}" for k, v in tiny.items())]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "4 to run, 2 worlds + warm starts to build" in proc.stdout

    rows = json.loads((out / "table.json").read_text())["rows"]
    assert [(r["setting"], r["arm"], r["seeds"]) for r in rows] == [("tiny", "grpo", [0, 1]), ("tiny", "llds", [0, 1])]
    for row in rows:
        em, rates, collapsed = [], [], 0
        for seed in (0, 1):
            run_dir = out / "runs" / "tiny" / row["arm"] / f"seed_{seed}"
            em.append(json.loads((run_dir / "eval" / "final_step_2" / "results.json").read_text())["em"]["mean"])
            records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            assert [r["step"] for r in records] == [1, 2]
            seed_rates = [r[LLD_RATE] for r in records if r.get(LLD_RATE) is not None]
            rates.append(sum(seed_rates) / len(seed_rates) if seed_rates else None)
            collapsed += em[-1] < 0.05  # 2 steps: no 3 consecutive steps of low reward
            config = json.loads((run_dir / "config.json").read_text())
            assert config["seed"] == seed and config["objective"]["llds"]["enabled"] == (row["arm"] == "llds")
            assert config["model"]["path"] == str(out / "seeds" / f"seed_{seed}" / "warm_start")
        assert row["final_em"] == em and row["em_mean"] == pytest.approx(sum(em) / 2, abs=1e-15)
        assert (row["em_low"], row["em_high"]) == stats.bootstrap_interval(em)
        assert row["collapsed"] == collapsed and row["collapse_steps"] == [None, None]
        assert row["lld_rates"] == pytest.approx(rates)
    assert any(em for row in rows for em in row["final_em"]), "every final EM is 0: the check above cannot bite"
    grpo_row, llds_row = rows
    assert llds_row["vs_grpo"] == pytest.approx([a - b for a, b in zip(llds_row["final_em"], grpo_row["final_em"])])
    assert grpo_row["vs_grpo"] == [] and llds_row["vs_grpo_seeds"] == [0, 1]
    worlds = [json.loads((out / "seeds" / f"seed_{s}" / "world" / "COMPLETE").read_text()) for s in (0, 1)]
    assert [w["seed"] for w in worlds] == [0, 1]  # each seed its own world (and warm start on it)
    assert (out / "plots" / "tiny.png").read_bytes()[:4] == b"\x89PNG"
    timings = [json.loads(line) for line in (out / "timings.jsonl").read_text().splitlines()]
    assert sorted((t["kind"], t["built"]) for t in timings) == [("run", False)] * 4 + [("warm_start", True)] * 2

    table_md = (out / "table.md").read_text()
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "4 finished (skipped), 0 to run, 0 worlds + warm starts to build" in proc.stdout
    assert "start " not in proc.stdout and (out / "table.md").read_text() == table_md
