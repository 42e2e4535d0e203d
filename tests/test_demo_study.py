"""The study command (python -m llds_jax.apps.demo_study): its statistics on hand-made series, its plan, scheduling
and estimate, and a real tiny study (2 seeds x 2 arms x 2 steps, subprocesses) whose table is checked against the runs'
own metric and evaluation files."""
import dataclasses
import gzip
import itertools
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from llds_jax.apps import demo_study
from llds_jax.apps.study import arms, budget, outcomes, paired, plan, plots, runner, stats, steps, table
from llds_jax.train.run_config import flat
from llds_jax.apps.study.outcomes import DELTA_TRAJ, GRAD_NORM, LIKELIHOOD, LLD_RATE, REF_KL, REWARD, RunResult

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


# The paired statistics, on hand computations and, where scipy is installed, against scipy.stats.
@pytest.mark.parametrize("differences, expected", [
    ([1.0, 2.0, 3.0], 2 / 8),       # sums +-1+-2+-3: only +6 and -6 reach |6|
    ([1.0, -1.0], 1.0),             # observed sum 0: every assignment reaches it
    ([0.5] * 4, 2 / 16),            # the smallest p of 4 seeds
    ([0.25], 1.0),
    # |sum| 0.4; of the 8 values of +-0.1+-0.2+-0.3 added to +0.4, five reach 0.4 (1.0, 0.8, 0.6 and two exact
    # 0.4s that floating point would put a hair below), and as many mirrored: 10 of 16.
    ([0.1, 0.2, -0.3, 0.4], 10 / 16),
])
def test_sign_flip_p_is_the_share_of_sign_assignments_reaching_the_observed_sum(differences, expected):
    assert stats.sign_flip_p(differences) == expected


def test_sign_flip_p_beyond_16_differences_samples_the_assignments():
    # Exact p of 17 differences by enumerating all 2^17 assignments here; the sampled p is within its noise.
    d = np.array([0.3, -0.1, 0.2, 0.05, -0.25, 0.15, 0.1, -0.05, 0.4, -0.3, 0.2, 0.1, -0.15, 0.05, 0.3, -0.2, 0.1])
    signs = np.array(list(itertools.product([1.0, -1.0], repeat=17)))
    exact = np.mean(np.abs(signs @ d) >= abs(d.sum()) - 1e-12)
    sampled = stats.sign_flip_p(d)
    assert abs(sampled - exact) < 4 * np.sqrt(exact * (1 - exact) / stats.BOOTSTRAP_RESAMPLES)
    # Only 2 of the 2^17 assignments reach 17: 100 draws miss them, and the observed one counts: p = 1 / 101.
    assert stats.sign_flip_p(np.ones(17), resamples=100) == 1 / 101


def test_t_quantile_and_interval_match_closed_forms_by_hand():
    # df 1 (Cauchy): P(|T| <= t) = 2 arctan(t) / pi; df 2: P(|T| <= t) = t / sqrt(2 + t^2).
    assert stats.t_quantile(0.95, 1) == pytest.approx(np.tan(0.95 * np.pi / 2), rel=1e-13)
    assert stats.t_quantile(0.95, 2) == pytest.approx(0.95 * np.sqrt(2 / (1 - 0.95 ** 2)), rel=1e-13)
    # [1, 2, 3]: mean 2, sd 1, df 2.
    half = 0.95 * np.sqrt(2 / (1 - 0.95 ** 2)) / np.sqrt(3)
    assert stats.t_interval([1.0, 2.0, 3.0]) == pytest.approx((2 - half, 2 + half), rel=1e-13)
    assert stats.t_interval([0.1, 0.1, 0.1]) == pytest.approx((0.1, 0.1))
    with pytest.raises(ValueError, match="at least 2 differences"):
        stats.t_interval([0.1])


@pytest.mark.parametrize("p_values, expected", [
    ([0.01, 0.04, 0.03], [0.03, 0.06, 0.06]),  # 3 x 0.01, then max(0.03, 2 x 0.03), then max(0.06, 1 x 0.04)
    ([0.5, 0.001], [0.5, 0.002]),
    ([0.3, 0.4], [0.6, 0.6]),
    ([0.02, 0.02, 0.9], [0.06, 0.06, 0.9]),
    ([0.6, 0.7], [1.0, 1.0]),                   # capped at 1
    ([], []),
])
def test_holm_adjusts_step_down_in_the_given_order(p_values, expected):
    assert stats.holm(p_values) == pytest.approx(expected)


def test_holm_rejects_what_is_not_a_p_value():
    with pytest.raises(ValueError, match="p-values in"):
        stats.holm([0.5, 1.5])


def test_paired_statistics_match_scipy():
    scipy_stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(3)
    for n in (2, 4, 7, 9):
        arm, control = rng.uniform(0, 1, n), rng.uniform(0, 1, n)
        d = arm - control
        interval = scipy_stats.ttest_rel(arm, control).confidence_interval(0.95)
        assert stats.t_interval(d) == pytest.approx((interval.low, interval.high), rel=1e-12)
        test = scipy_stats.permutation_test((arm, control), lambda x, y: np.mean(x - y), permutation_type="samples",
                                            n_resamples=np.inf, alternative="two-sided")
        assert stats.sign_flip_p(d) == pytest.approx(test.pvalue, abs=1e-12)
    for df in (1, 2, 3, 4, 7, 15, 60):
        for confidence in (0.8, 0.95, 0.99):
            assert stats.t_quantile(confidence, df) == pytest.approx(scipy_stats.t.ppf((1 + confidence) / 2, df),
                                                                     rel=1e-12)


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
    assert plan.load(STRESS, plan.ARMS["llds_lam1"].overrides(stress)).objective.llds.lam == 1.0


@pytest.mark.parametrize("arm, group, trees, mini, micro", [("llds_trees", 8, 2, 16, 16),
                                                          ("llds_trees_wide", 16, 2, 32, 16),
                                                          ("llds_trees_quarter", 4, 1, 8, 8)])
def test_tree_arms_make_valid_runs_with_the_settings_number_of_updates(arm, group, trees, mini, micro):
    from llds_jax import application
    from llds_jax import config as config_lib

    default = os.path.join(ROOT, "configs", "demo_cpu.py")
    cfg = plan.load(default, plan.ARMS[arm].overrides(plan.load(default, [])))
    config_lib.check(cfg, application.load(cfg))
    r = cfg.rollout
    assert (cfg.data.samples_per_prompt, r.trees, r.trees * (1 + r.tree_rounds * r.tree_forks)) == (group, trees, group)
    run = config_lib.typed(cfg)
    assert (run.optim.mini_batch_size, run.optim.micro_batch_size, run.updates_per_step) == (mini, micro, 4)
    assert cfg.objective.advantages == "tree_grpo" and cfg.objective.llds.enabled


def test_a_setting_hands_its_argument_to_the_config_files_get_config(tmp_path):
    late = os.path.join(ROOT, "configs", "demo_cpu_late_collapse.py")
    settings = plan.parse_settings(f"lr7e4={late}:7e-4,plain={late}")
    study = plan.make_plan(str(tmp_path), settings, [("grpo", None)], [0])
    by_setting = {run.setting: run for run in study.runs}
    assert f"--config={late}:7e-4" in by_setting["lr7e4"].command()
    assert plan.load(settings["lr7e4"], []).optim.learning_rate == 7e-4
    assert plan.load(settings["plain"], []).optim.learning_rate == 6e-4  # the file's default
    with pytest.raises(plan.StudyError, match="config file not found: .*missing.py$"):
        plan.load(str(tmp_path / "missing.py:7e-4"), [])


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


def test_em_is_drawn_against_the_tokens_generated_by_each_evaluation(tmp_path):
    """Evaluations at steps 0, 2 and 4 and the final one after step 4 (the same step: the final one wins), tokens
    summed up to each; a run without evaluations during training has no points and no figure of its own."""
    def run(arm, seed, tokens, ems, final_em):
        curves = {**{metric: ([], []) for metric in outcomes.CURVES}, REWARD: ([1, 2, 3, 4], [0.5] * 4),
                  outcomes.SAMPLED_TOKENS: ([1, 2, 3, 4], tokens), outcomes.EVAL_EM: ([0, 2, 4], ems)}
        return RunResult("tree_study", arm, seed, final_em, None, False, None, curves)

    chains = run("llds", 1, [100.0, 200.0, 300.0, 400.0], [0.1, 0.5, 0.7], 0.75)
    trees = run("llds_trees", 1, [50.0, 50.0, 60.0, 40.0], [0.1, 0.4, 0.6], 0.6)
    assert plots.em_by_tokens(chains, 4) == ([0.0, 300.0, 1000.0], [0.1, 0.5, 0.75])
    assert plots.em_by_tokens(trees, 4) == ([0.0, 100.0, 200.0], [0.1, 0.4, 0.6])
    fig = plots.budget_figure("tree_study", [chains, trees], 4)
    (ax,) = fig.axes
    assert [list(line.get_xdata()) for line in ax.lines] == [[0.0, 300.0, 1000.0], [0.0, 100.0, 200.0]]
    assert ax.lines[0].get_color() != ax.lines[1].get_color()
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["llds", "llds_trees"]
    assert plots.write([chains, trees], str(tmp_path), {"tree_study": 4})[1] == str(
        tmp_path / "plots" / "tree_study_em_vs_tokens.png")
    bare = dataclasses.replace(chains, curves={**chains.curves, outcomes.EVAL_EM: ([], [])})
    assert plots.em_by_tokens(bare, 4) == ([], [])
    assert plots.write([bare], str(tmp_path / "bare"), {"tree_study": 4}) == [str(tmp_path / "bare" / "plots" /
                                                                                  "tree_study.png")]


def test_mean_curve_averages_the_seeds_that_have_each_step():
    steps, values = plots.mean_curve([([1, 2, 3], [0.2, 0.4, 0.6]), ([1, 3], [0.0, 1.0]), ([4], [0.5])])
    assert steps == [1, 2, 3, 4] and values == pytest.approx([0.1, 0.4, 0.8, 0.5])


# ----- table ----------------------------------------------------------------------------------------------------------
def _result(arm, seed, em, step=None, rate=None):
    curves = {**{metric: ([], []) for metric in outcomes.CURVES}, REWARD: ([1], [0.5]), LIKELIHOOD: ([1], [-0.1]),
              LLD_RATE: ([1], [rate]) if rate is not None else ([], [])}
    return RunResult("stress", arm, seed, em, step, stats.collapsed(step, em), rate, curves)


def test_table_rows_aggregate_each_arm_over_its_seeds(tmp_path):
    results = [_result("grpo", 1, 0.0, step=17, rate=0.6), _result("grpo", 0, 0.5, rate=0.4),
               _result("llds", 0, 0.7, rate=0.3), _result("llds", 1, 0.03)]
    grpo, llds = table.rows(results, {f"stress/{arm}/seed_{seed}": 20 for arm in ("grpo", "llds") for seed in (0, 1)})
    assert (grpo.arm, grpo.seeds, grpo.final_em, grpo.em_mean) == ("grpo", [0, 1], [0.5, 0.0], 0.25)
    # Time to collapse: seed 1's step 17 and seed 0's 21 (not collapsed: its last step + 1), median 19; llds seed 1
    # collapsed by its final EM only, which counts as 21 too.
    assert (grpo.time_to_collapse, llds.time_to_collapse) == (19.0, 21.0)
    assert table.rows(results)[0].time_to_collapse is None  # steps unknown
    assert (grpo.em_low, grpo.em_high) == (0.0, 0.5)
    assert (grpo.collapsed, grpo.collapse_steps, grpo.lld_rate_mean) == (1, [None, 17], 0.5)
    assert (llds.collapsed, llds.collapse_steps, llds.lld_rates, llds.lld_rate_mean) == (1, [None, None],
                                                                                          [0.3, None], 0.3)
    paths = table.write([grpo, llds], results, str(tmp_path))
    text = (tmp_path / "table.md").read_text()
    assert ("| stress | grpo: GRPO (LLDS off) | 2 | 0.250 [0.000, 0.500] | 0.500 0.000 | 1/2 | 17 (seed 1) | 19 "
            "| 0.500 | — |") in text
    # llds - grpo on seeds 0 and 1: 0.7 - 0.5 and 0.03 - 0.0.
    assert (llds.vs_grpo, llds.vs_grpo_seeds) == (pytest.approx([0.2, 0.03]), [0, 1])
    assert llds.vs_grpo_mean == pytest.approx(0.115)
    assert (llds.vs_grpo_low, llds.vs_grpo_high) == stats.bootstrap_interval(llds.vs_grpo)
    assert "| +0.115 [+0.030, +0.200] (2 seeds) |" in text
    assert "| stress | llds | +0.200 +0.030 (seeds 0,1) | 2 of 2 |" in text
    assert "3 consecutive steps" in text
    assert json.loads((tmp_path / "table.json").read_text())["rows"][1]["final_em"] == [0.7, 0.03]
    assert (tmp_path / "table.csv").read_text().splitlines()[1] == ("stress,grpo,2,0;1,0.25,0.0,0.5,0.5;0.0,1,;17,0.5"
                                                                    ",,,,,19.0")
    # A seed GRPO does not have is left out of the paired comparison.
    _, lone = table.rows(results + [_result("llds", 2, 0.9)])
    assert (lone.seeds, lone.vs_grpo_seeds) == ([0, 1, 2], [0, 1])
    assert len(paths) == 4


def test_each_control_meets_every_other_arm_and_two_controls_meet_once():
    arms = ["grpo", "llds", "grpo_low_lr", "grpo_kl10", "llds_token"]
    assert paired.pairs(arms, ["grpo", "grpo_low_lr", "grpo_kl10"]) == [
        ("llds", "grpo"), ("grpo_low_lr", "grpo"), ("grpo_kl10", "grpo"), ("llds_token", "grpo"),
        ("llds", "grpo_low_lr"), ("grpo_kl10", "grpo_low_lr"), ("llds_token", "grpo_low_lr"),
        ("llds", "grpo_kl10"), ("llds_token", "grpo_kl10")]
    assert paired.pairs(["llds", "grpo_kl10"], ["grpo", "grpo_kl10"]) == [("llds", "grpo_kl10")]  # no grpo here
    results = [_result("llds", 0, 0.5), _result("grpo_kl10", 0, 0.5), _result("grpo", 0, 0.5)]
    assert paired.default_controls(results) == ["grpo_kl10", "grpo"]
    assert plan.parse_controls("grpo, llds_action") == ["grpo", "llds"]
    with pytest.raises(plan.StudyError, match="unknown arm 'gpro' in --controls"):
        plan.parse_controls("gpro")


def _paired_results():
    """grpo on seeds 0-3, llds on seeds 0-2 and 4, grpo_low_lr on seed 1 only; llds seed 2 logged no LLD rate."""
    return [_result("grpo", 0, 0.50, rate=0.5), _result("grpo", 1, 0.25, rate=0.5), _result("grpo", 2, 0.75, rate=0.25),
            _result("grpo", 3, 0.5, rate=0.5),
            _result("llds", 0, 0.75, rate=0.25), _result("llds", 1, 0.75, rate=0.375), _result("llds", 2, 0.5),
            _result("llds", 4, 1.0, rate=0.0),
            _result("grpo_low_lr", 1, 0.625, rate=0.125)]


def test_paired_comparisons_use_the_seeds_both_arms_have_and_holm_over_all_of_them():
    found = paired.comparisons(_paired_results())
    assert [(c.endpoint, c.arm, c.control, c.seeds) for c in found] == [
        ("final_em", "llds", "grpo", [0, 1, 2]), ("final_em", "grpo_low_lr", "grpo", [1]),
        ("final_em", "llds", "grpo_low_lr", [1]),
        ("lld_rate_mean", "llds", "grpo", [0, 1]), ("lld_rate_mean", "grpo_low_lr", "grpo", [1]),
        ("lld_rate_mean", "llds", "grpo_low_lr", [1])]
    em = found[0]
    # 0.75 - 0.5, 0.75 - 0.25, 0.5 - 0.75: mean 1/6; the sums of +-0.25+-0.5+-0.25 are +-1 (2), +-0.5 (4) and 0 (2):
    # 6 of 8 reach |0.5|.
    assert em.differences == [0.25, 0.5, -0.25] and em.mean == pytest.approx(0.5 / 3)
    assert (em.higher, em.lower, em.equal) == (2, 1, 0)
    assert em.sign_flip_p == 6 / 8
    assert (em.boot_low, em.boot_high) == stats.bootstrap_interval([0.25, 0.5, -0.25])
    assert (em.t_low, em.t_high) == stats.t_interval([0.25, 0.5, -0.25])
    one_seed = found[1]
    assert (one_seed.differences, one_seed.t_low, one_seed.t_high, one_seed.sign_flip_p) == ([0.375], None, None, 1.0)
    rate = found[3]
    assert (rate.differences, rate.lower, rate.sign_flip_p) == ([-0.25, -0.125], 2, 0.5)
    # Holm over the family of 6: p = 0.75, 1, 1, 0.5, 1, 1 -> 6 x 0.5 = 3 caps at 1, and so does every other.
    assert [c.holm_p for c in found] == stats.holm([c.sign_flip_p for c in found]) == [1.0] * 6
    only_grpo = paired.comparisons(_paired_results(), ["grpo"])
    assert [(c.arm, c.control) for c in only_grpo] == [("llds", "grpo"), ("grpo_low_lr", "grpo")] * 2


def test_each_arms_endpoints_are_its_mean_over_its_seeds_with_a_t_interval(tmp_path):
    from scipy import stats as scipy_stats  # an independent t quantile
    found = arms.rows(_paired_results(), ["final_em", "lld_rate_common", "lld_rate_mean", "collapsed"])
    assert [(r.arm, r.endpoint, r.seeds) for r in found] == [  # pairwise lld_rate_common has no per-arm value
        ("grpo", "final_em", [0, 1, 2, 3]), ("grpo", "lld_rate_mean", [0, 1, 2, 3]),
        ("grpo", "collapsed", [0, 1, 2, 3]),
        ("llds", "final_em", [0, 1, 2, 4]), ("llds", "lld_rate_mean", [0, 1, 4]), ("llds", "collapsed", [0, 1, 2, 4]),
        ("grpo_low_lr", "final_em", [1]), ("grpo_low_lr", "lld_rate_mean", [1]), ("grpo_low_lr", "collapsed", [1])]
    llds_em = found[3]
    values = [0.75, 0.75, 0.5, 1.0]
    half = scipy_stats.t.ppf(0.975, 3) * np.std(values, ddof=1) / 2
    assert llds_em.values == values and llds_em.mean == 0.75
    assert (llds_em.t_low, llds_em.t_high) == pytest.approx((0.75 - half, 0.75 + half), rel=1e-12)
    assert (found[6].mean, found[6].t_low, found[6].t_high) == (0.625, None, None)  # one seed: no interval
    assert found[2].values == [0.0] * 4  # collapsed as 0 / 1: the mean is the share collapsed
    rate = found[4]
    assert rate.values == [0.25, 0.375, 0.0]
    lines = arms.markdown(found)
    assert lines[0] == "| setting | arm | seeds | final EM | mean LLD rate | collapse (1: collapsed) |"
    assert lines[3] == (f"| stress | llds | 4 | 0.750 [{0.75 - half:.3f}, {0.75 + half:.3f}] | 0.208 "
                        f"[{rate.t_low:.3f}, {rate.t_high:.3f}] | 0.000 [0.000, 0.000] |")
    assert lines[4] == "| stress | grpo_low_lr | 1 | 0.625 | 0.125 | 0.000 |"
    big = arms.ArmEndpoint("s", "a", "tokens_generated", [1, 2], [52000.0, 54000.0], 53000.0, 40293.5, 65706.5)
    assert arms.markdown([big])[2] == "| s | a | 2 | 53,000 [40,294, 65,706] |"
    md, js = arms.write(found, str(tmp_path))
    assert open(md).read() == "\n".join(lines) + "\n"
    assert json.load(open(js))[3]["values"] == values


def test_collapse_is_an_endpoint_to_ask_for_whose_sign_flip_test_is_mcnemars():
    # grpo collapses on seeds 0-4 (step 5), llds on seed 0 only: 4 discordant pairs, all one way, 1 tie
    results = [_result("grpo", seed, 0.0, step=5) for seed in range(5)] + [_result("llds", 0, 0.0, step=5)]
    results += [_result("llds", seed, 0.5) for seed in range(1, 5)]
    found = paired.comparisons(results, ["grpo"], paired.parse_endpoints("collapsed,final_em"))
    assert [(c.endpoint, c.arm, c.control) for c in found] == [("collapsed", "llds", "grpo"),
                                                               ("final_em", "llds", "grpo")]
    collapse = found[0]
    assert collapse.differences == [0, -1, -1, -1, -1] and (collapse.lower, collapse.equal) == (4, 1)
    # McNemar's exact test on 4 discordant pairs all one way: 2 x 0.5^4
    assert collapse.sign_flip_p == 2 * 0.5 ** 4
    assert paired.parse_endpoints("final_em, collapsed") == ("collapsed", "final_em")  # ENDPOINTS order
    known = ("collapsed, lasting_collapse, lasting_decline, final_em, last3_em, last3_two_hop_em, peak_em, "
             "lld_rate_mean, lld_rate_common, tokens_generated, searches_per_trajectory, step_s, rollout_s, "
             "tokens_per_s")
    with pytest.raises(plan.StudyError, match=f"--endpoints: 'reward'; known: {known}"):
        paired.parse_endpoints("reward,final_em")
    assert paired.comparisons(results, ["grpo"])[0].endpoint == "final_em"  # the default family: no collapse


def test_the_budget_endpoints_are_read_off_the_runs_logged_rollout_counts():
    """Tokens generated (summed over steps), searches per trajectory (over all steps) and seconds per step (from step
    2 on): the comparison of chains and trees (docs/tree-rollouts.md); None for runs that did not log them."""
    curves = {outcomes.SAMPLED_TOKENS: ([1, 2, 3], [1552.0, 1960.0, 2456.0]),
              outcomes.SEARCHES: ([1, 2, 3], [22.0, 39.0, 60.0]), outcomes.TRAJECTORIES: ([1, 2, 3], [64.0] * 3),
              outcomes.STEP_S: ([1, 2, 3], [90.0, 20.0, 24.0])}
    run = dataclasses.replace(_result("llds", 0, 0.5), curves={**_result("llds", 0, 0.5).curves, **curves})
    assert (run.tokens_generated, run.searches_per_trajectory, run.step_s) == (5968.0, 121 / 192, 22.0)
    bare = _result("grpo", 0, 0.5)
    assert (bare.tokens_generated, bare.searches_per_trajectory, bare.step_s) == (None, None, None)
    found = paired.comparisons([run, dataclasses.replace(bare, curves={**bare.curves, **{
        m: (steps, [v / 2 for v in values]) for m, (steps, values) in curves.items()}})], ["grpo"],
        paired.parse_endpoints("tokens_generated,step_s"))
    assert [(c.endpoint, c.differences) for c in found] == [("tokens_generated", [2984.0]), ("step_s", [11.0])]


def test_the_speed_endpoints_are_read_off_steps_2_on_and_tokens_per_s_weighs_each_step_by_its_seconds():
    """Rollout seconds per step (the mean of `perf/rollout_s` from step 2 on) and trained tokens per second (the
    steps' trained tokens over their seconds: sum of tokens/s x seconds over sum of seconds, steps 2 on): issue 59's
    comparison of synchronous and partial rollouts; None for runs that did not log them."""
    curves = {outcomes.STEP_S: ([1, 2, 3], [90.0, 20.0, 30.0]), outcomes.ROLLOUT_S: ([1, 2, 3], [60.0, 8.0, 12.0]),
              outcomes.TOKENS_PER_S: ([1, 2, 3], [10.0, 100.0, 50.0])}
    base = _result("partial2", 0, 0.5)
    run = dataclasses.replace(base, curves={**base.curves, **curves})
    # steps 2-3: (100 x 20 + 50 x 30) trained tokens in 20 + 30 seconds = 70 per second (the mean of the rates: 75)
    assert (run.step_s, run.rollout_s, run.tokens_per_s) == (25.0, 10.0, 70.0)
    bare = _result("sync_tis", 0, 0.5)
    assert (bare.rollout_s, bare.tokens_per_s) == (None, None)
    no_seconds = dataclasses.replace(base, curves={**base.curves, outcomes.TOKENS_PER_S: curves[outcomes.TOKENS_PER_S]})
    assert no_seconds.tokens_per_s is None  # tokens/s without the step's seconds weigh nothing
    control = dataclasses.replace(bare, curves={**bare.curves, outcomes.STEP_S: ([1, 2, 3], [90.0, 40.0, 40.0]),
                                                outcomes.ROLLOUT_S: ([1, 2, 3], [60.0, 20.0, 20.0]),
                                                outcomes.TOKENS_PER_S: ([1, 2, 3], [10.0, 50.0, 50.0])})
    found = paired.comparisons([control, run], ["sync_tis"], paired.parse_endpoints("step_s,rollout_s,tokens_per_s"))
    assert [(c.arm, c.control, c.endpoint, c.differences) for c in found] == [
        ("partial2", "sync_tis", "step_s", [-15.0]), ("partial2", "sync_tis", "rollout_s", [-10.0]),
        ("partial2", "sync_tis", "tokens_per_s", [20.0])]


def test_the_speed_curves_survive_the_steps_file(tmp_path):
    """A recorded report (recompute.sh: runs.csv and steps.csv.gz) gives the speed endpoints of the runs as read."""
    base = _result("partial2", 0, 0.5)
    run = dataclasses.replace(base, curves={**base.curves, outcomes.STEP_S: ([1, 2], [9.0, 4.0]),
                                            outcomes.ROLLOUT_S: ([1, 2], [6.0, 1.5]),
                                            outcomes.TOKENS_PER_S: ([1, 2], [100.0, 250.0])})
    path = steps.write([run], str(tmp_path))
    bare = dataclasses.replace(run, curves={metric: ([], []) for metric in outcomes.CURVES})
    (read,) = steps.attach([bare], steps.read(path), path)
    assert (read.step_s, read.rollout_s, read.tokens_per_s) == (4.0, 1.5, 250.0)


def test_the_partial_rollout_arms_differ_only_in_partial_rollouts():
    """sync_tis and partial2 (issue 59's comparison): GRPO + LLDS with the same TIS cap on the continuous policy;
    partial2 alone starts 2x the groups and carries the unfinished ones; both make valid runs of the stress setting."""
    from llds_jax import application
    from llds_jax import config as config_lib

    stress = plan.load(STRESS, [])
    sync, partial = (plan.load(STRESS, plan.ARMS[arm].overrides(stress)) for arm in ("sync_tis", "partial2"))
    for cfg in (sync, partial):
        config_lib.check(cfg, application.load(cfg))
        assert cfg.objective.llds.enabled and cfg.objective.llds.lam == 0.2 and cfg.objective.tis_cap == 2.0
        assert cfg.rollout.continuous_batching
    assert not sync.rollout.partial
    assert (partial.rollout.partial, partial.rollout.over_sampling, partial.rollout.max_staleness) == (True, 2.0, 1)
    assert config_lib.typed(partial).rollout_sequences() == 2 * config_lib.typed(sync).rollout_sequences() == 128
    differ = {key for key, value in flat(partial.to_dict()).items() if flat(sync.to_dict()).get(key) != value}
    assert differ == {"rollout.partial"}  # partial2 sets over_sampling 2 and max_staleness 1: today's defaults



def test_paired_table_is_written_as_markdown_csv_and_json(tmp_path):
    found = paired.comparisons(_paired_results())
    paths = table.write_paired(found, ["grpo", "grpo_low_lr"], str(tmp_path))
    assert paths == [str(tmp_path / name) for name in ("paired.md", "paired.csv", "paired.json")]
    text = (tmp_path / "paired.md").read_text()
    low, high = stats.t_interval([0.25, 0.5, -0.25])
    boot_low, boot_high = stats.bootstrap_interval([0.25, 0.5, -0.25])
    assert (f"| stress | llds | grpo | 3 (0,1,2) | +0.167 | [{boot_low:+.3f}, {boot_high:+.3f}] | [{low:+.3f}, "
            f"{high:+.3f}] | 0.7500 | 1.0000 | 2 / 1 / 0 |") in text
    assert ("| stress | grpo_low_lr | grpo | 1 (1) | +0.375 | [+0.375, +0.375] | — | 1.0000 | 1.0000 | 1 / 0 / 0 |"
            in text)
    assert text.index("final EM: arm minus control") < text.index("mean LLD rate: arm minus control")
    assert "over all 6 comparisons" in text and "controls: grpo, grpo_low_lr" in text
    lines = (tmp_path / "paired.csv").read_text().splitlines()
    assert lines[0].startswith("setting,arm,control,endpoint,n_seeds,seeds,mean_difference,boot_ci_low")
    assert lines[2] == "stress,grpo_low_lr,grpo,final_em,1,1,0.375,0.375,0.375,,,1.0,1.0,1,0,0,0.375"
    written = json.loads((tmp_path / "paired.json").read_text())
    assert written["controls"] == ["grpo", "grpo_low_lr"]
    assert written["comparisons"][3] == dataclasses.asdict(found[3])


# ----- per-step metrics -----------------------------------------------------------------------------------------------
def _records(seed, arm):
    """A few steps of every per-step metric, not all on every step, with values that are not short decimals; grpo
    seed 2 collapses at step 2."""
    base = seed / 7 + (arm == "llds") / 3
    return [{"step": k, REWARD: 0.05 if (arm, seed, k > 1) == ("grpo", 2, True) else 0.9 - k * base / 5,
             LIKELIHOOD: -0.05 * k - base, GRAD_NORM: 1.0 / (k + seed + 1), REF_KL: k * 0.013,
             LLD_RATE: None if k == 2 else base / (k + 1), DELTA_TRAJ: None if k == 2 else -base / 11}
            for k in range(1, 5)]


def test_steps_file_reads_back_the_curves_and_names_a_bad_value(tmp_path):
    out = str(tmp_path / "study")
    runs = [plan.Run("stress", arm, seed, "c.py", (), str(tmp_path / arm / str(seed)), 4)
            for arm in ("grpo", "llds") for seed in (0, 1)]
    for run in runs:
        _write_run(run.run_dir, _records(run.seed, run.arm), final_em=0.5, steps=4)
    results = [outcomes.read_result(run) for run in runs] + [_result("grpo", 5, 0.5)]
    results[-1] = dataclasses.replace(results[-1], curves={m: ([], []) for m in outcomes.CURVES})  # no curves
    path = steps.write(results, out)
    assert path == os.path.join(out, "steps.csv.gz")
    lines = gzip.open(path, "rt").read().splitlines()
    assert lines[0] == ("setting,arm,seed,step,reward/mean,lld/logp_mean_correct,lld/rate,lld/delta_traj_correct,"
                        "actor/grad_norm,actor/ref_kl_k3")
    assert len(lines) == 1 + 4 * 4 and lines[2].startswith("stress,grpo,0,2,0.9,-0.1,,,")
    read = steps.read(path)
    assert read == {r.name: r.curves for r in results[:4]}
    assert read["stress/llds/seed_1"][LLD_RATE][0] == [1, 3, 4]
    first = open(path, "rb").read()
    assert steps.write(results, out) == path and open(path, "rb").read() == first  # the same bytes again

    bad = str(tmp_path / "bad.csv")
    header, row = lines[0], lines[1]
    for text, message in [
        (f"{header}\n{row}\n{lines[2].replace(',0.9,', ',high,')}\n", r"bad.csv line 3: column reward/mean must be a "
                                                                   r"number or empty, got 'high'"),
        (f"{header}\n{row}\n{row}\n", r"bad.csv line 3: stress/grpo/seed_0 step 1 is given twice"),
        ("setting,arm,seed,step,reward/mean\n", r"bad.csv line 1: .* missing lld/logp_mean_correct, lld/rate"),
    ]:
        with open(bad, "w") as f:
            f.write(text)
        with pytest.raises(plan.StudyError, match=message):
            steps.read(bad)

    # Recorded numbers are checked against the ones computed from the steps.
    recorded = [dataclasses.replace(r, curves={m: ([], []) for m in outcomes.CURVES}) for r in results]
    assert steps.attach(recorded, read, path) == results
    recorded[1] = dataclasses.replace(recorded[1], lld_rate_mean=0.5)
    with pytest.raises(plan.StudyError, match=r"steps.csv.gz: stress/grpo/seed_1: lld_rate_mean from its steps is "
                                              r"0.0\d+, the runs file says 0.5"):
        steps.attach(recorded, read, path)
    with pytest.raises(plan.StudyError, match=r"steps.csv.gz: steps of runs not in the runs file: stress/llds/seed_0, "
                                              "stress/llds/seed_1"):
        steps.attach(recorded[:2], read, path)


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
    assert all(r.curves == {metric: ([], []) for metric in outcomes.CURVES} for r in read)
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
    monkeypatch.setattr(plots, "write", lambda results, folder, final_steps: plotted.append(
        [r.name for r in results]) or write_plots(results, folder, final_steps))
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


def test_one_report_command_recomputes_every_output_from_the_committed_runs_and_steps_files(tmp_path, capsys):
    # 1 setting x 2 arms x 3 seeds x 4 steps: the report of the run folders, then the report of its runs.csv and
    # steps.csv.gz alone (another --out, no run folders) must write the same files.
    here, elsewhere = str(tmp_path / "here"), str(tmp_path / "elsewhere")
    for arm in ("grpo", "llds"):
        for seed in range(3):
            _write_run(os.path.join(here, "runs", "stress", arm, f"seed_{seed}"), _records(seed, arm),
                       final_em=0.5 + seed / 8 + (arm == "llds") * (seed + 1) / 16, steps=4)
    plan_args, overrides = ["--seeds", "3"], ["--", "--config.train.total_steps=4"]
    assert demo_study.main(["--out", here, *plan_args, "--report", *overrides]) == 0
    printed_here = capsys.readouterr().out
    assert "final EM: arm minus control, same seeds" in printed_here
    # llds minus grpo: 1/16, 2/16, 3/16 (sign-flip p 2/8); grpo seed 2 collapsed at step 2.
    assert "| stress | llds | grpo | 3 (0,1,2) | +0.125 |" in printed_here and "| 0.2500 |" in printed_here
    committed = str(tmp_path / "committed")
    os.makedirs(committed)
    for name in ("runs.csv", "steps.csv.gz"):
        shutil.copy(os.path.join(here, name), committed)

    recorded = ["--recorded", os.path.join(committed, "runs.csv")]
    assert demo_study.main(["--out", elsewhere, *plan_args, "--report", *recorded, *overrides]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == (f"runs not finished here taken from {committed}/runs.csv, their curves from "
                        f"{committed}/steps.csv.gz: 6 (6 with curves, in the plots too)")
    for name in ("table.md", "table.csv", "table.json", "runs.csv", "paired.md", "paired.csv", "paired.json",
                 "steps.csv.gz", os.path.join("plots", "stress.png")):
        with open(os.path.join(here, name), "rb") as f, open(os.path.join(elsewhere, name), "rb") as g:
            assert f.read() == g.read(), name
    assert "\n".join(lines).count("| stress |") == printed_here.count("| stress |")
    # grpo seed 2's collapse, recorded and recomputed from the steps' rewards:
    assert "| 1/3 | 2 (seed 2) |" in (tmp_path / "elsewhere" / "table.md").read_text()

    with pytest.raises(SystemExit):
        demo_study.main(["--out", elsewhere, "--report", "--recorded-steps", os.path.join(committed, "steps.csv.gz")])
    assert "--recorded-steps is only read with --recorded" in capsys.readouterr().err
    assert demo_study.main(["--out", elsewhere, *plan_args, "--report", *recorded, "--recorded-steps",
                            str(tmp_path / "none.gz"), *overrides]) == 2
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


def test_the_committed_calibration_of_the_collapse_study_recomputes_to_its_committed_figures(tmp_path, capsys):
    """docs/evidence.md's calibration figures from its committed runs.csv and steps.csv.gz alone, by the page's
    own report command: both GRPO runs collapsed (steps 19 and 5), and the committed early-warning table."""
    committed = os.path.join(ROOT, "docs", "evidence", "collapse", "calibration")
    out = str(tmp_path / "calibration")
    argv = ["--settings", f"lr1e3={os.path.join(ROOT, 'configs', 'demo_cpu_grpo.py')}", "--seeds", "0-1", "--arms", "grpo", "--out", out,
            "--report", "--recorded", os.path.join(committed, "runs.csv"), "--",
            "--config.optim.learning_rate=1e-3", "--config.train.total_steps=40"]
    assert demo_study.main(argv) == 0
    assert "2 (2 with curves, in the plots too)" in capsys.readouterr().out
    results = {r.seed: r for r in table.read_runs(os.path.join(out, "runs.csv"))}
    assert {seed: (r.collapsed, r.collapse_step, r.final_em) for seed, r in results.items()} == {
        0: (True, 19, 0.0), 1: (True, 5, 0.0)}
    for name in ("runs.csv", "steps.csv.gz", "early_warning.md"):
        with open(os.path.join(committed, name), "rb") as f, open(os.path.join(out, name), "rb") as g:
            assert f.read() == g.read(), name
    for seed in (0, 1):  # each collapse with every diagnostic on one figure
        figure = os.path.join(out, "plots", "collapses", f"lr1e3_grpo_seed_{seed}.png")
        assert os.path.getsize(figure) > 50_000, figure


# What the evidence page's tables are rows of: the settings of its studies.
EVIDENCE_SETTINGS = {"stress", "default", "paper_shaped", "lr1e3", "collapse", "lr5e4", "lr6e4", "lr7e4", "lr8e4",
                     "late_collapse", "long_lr2e4", "good_lr"}


def _decoy_pythons(folder) -> dict[str, str]:
    """An environment whose PATH finds, first, a `python3` and a `python` of another environment (one without the
    project: each fails as such an interpreter fails), as a shell does where a virtual environment is not
    activated."""
    folder.mkdir()
    for name in ("python3", "python"):
        decoy = folder / name
        decoy.write_text("#!/bin/sh\necho \"ModuleNotFoundError: No module named 'ml_collections'\" >&2\nexit 1\n")
        decoy.chmod(0o755)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PATH": f"{folder}{os.pathsep}{os.environ['PATH']}"}
    env.pop("PYTHON", None)
    return env


def test_recompute_names_the_interpreter_to_set_when_none_on_path_has_the_project(tmp_path):
    env = _decoy_pythons(tmp_path / "bin")
    proc = subprocess.run(["sh", os.path.join("docs", "evidence", "recompute.sh"), str(tmp_path / "out")], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("recompute.sh: no python3 or python on PATH cannot import llds_jax; set PYTHON")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_every_table_row_of_the_evidence_page_is_recomputed_from_the_committed_records(tmp_path):
    """`sh docs/evidence/recompute.sh OUT` (the page's one command) rebuilds the committed records byte for byte
    from themselves, the studies' committed tables too, and every table row of docs/evidence.md that reports a
    run, an arm or a comparison (and of the tree study in docs/tree-rollouts.md) is a row of one of its outputs. Run
    with this interpreter as `PYTHON` while PATH finds other pythons first (an environment that is not activated)."""
    env = {**_decoy_pythons(tmp_path / "bin"), "PYTHON": sys.executable}
    proc = subprocess.run(["sh", os.path.join("docs", "evidence", "recompute.sh"), str(tmp_path)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    evidence = os.path.join(ROOT, "docs", "evidence")
    same = [(os.path.join(evidence, "runs.csv"), tmp_path / "study_2026_12_02" / "runs.csv")]
    same += [(os.path.join(evidence, "collapse", "study", name), tmp_path / "collapse_study" / name)
             for name in ("runs.csv", "steps.csv.gz", "table.md", "paired.md", "early_warning.md", "auc.md",
                          "survival.md", "sequence.md")]
    same.append((os.path.join(evidence, "collapse", "reread", "paired_common_steps.md"),
                 tmp_path / "collapse_study_common_steps" / "paired.md"))
    calibration = os.path.join(evidence, "late_collapse", "calibration")
    same += [(os.path.join(calibration, name), tmp_path / "late_collapse_calibration" / name)
             for name in ("runs.csv", "steps.csv.gz", "table.md", "sequence.md", "survival.md")]
    late = os.path.join(evidence, "late_collapse", "study")
    same += [(os.path.join(late, name), tmp_path / "late_collapse_study" / name)
             for name in ("runs.csv", "steps.csv.gz", "table.md", "paired.md", "early_warning.md", "auc.md",
                          "survival.md", "sequence.md")]
    long_calibration = os.path.join(evidence, "long_horizon", "calibration")
    same += [(os.path.join(long_calibration, name), tmp_path / "long_horizon_calibration" / name)
             for name in ("runs.csv", "steps.csv.gz", "table.md")]
    trees = os.path.join(evidence, "tree_study")
    same += [(os.path.join(trees, name), tmp_path / "tree_study" / name)
             for name in ("runs.csv", "steps.csv.gz", "table.md", "paired.md", "arms.md", "survival.md", "sequence.md")]
    partial = os.path.join(evidence, "partial_study")
    same += [(os.path.join(partial, name), tmp_path / "partial_study" / name)
             for name in ("runs.csv", "steps.csv.gz", "table.md", "primary.md", "paired.md", "arms.md")]
    good_lr = os.path.join(evidence, "good_lr", "study")
    same += [(os.path.join(good_lr, name), tmp_path / "good_lr_study" / name)
             for name in ("runs.csv", "steps.csv.gz", "table.md", "primary.md", "paired.md", "arms.md", "survival.md",
                          "sequence.md", "auc.md", "early_warning.md")]
    for committed, produced in same:
        with open(committed, "rb") as f:
            assert f.read() == produced.read_bytes(), committed

    outputs = "".join(path.read_text() for path in sorted(tmp_path.glob("*/*.md")))
    rows = _table_rows("evidence.md", EVIDENCE_SETTINGS)
    assert len(rows) > 100, "the page's tables are not where this test looks"
    tree_rows = _table_rows("tree-rollouts.md", {"tree_study"})
    assert len(tree_rows) >= 12, "the tree study's tables are not where this test looks"
    assert [row for row in rows + tree_rows if row + "\n" not in outputs] == []


def test_the_pages_re_readings_are_printed_from_the_committed_records():
    """Issues 56's and 66's re-readings (not pre-registered): every table line `python docs/evidence/readings.py`
    prints is a line of docs/evidence.md or docs/tree-rollouts.md, and the pages have all of them: issue 66's are
    the good-learning-rate study's realised spread against its registered power assumption, and the partial-rollout
    comparison's trained trajectory lengths, rollout seconds and searches per seed."""
    proc = subprocess.run([sys.executable, os.path.join("docs", "evidence", "readings.py")], cwd=ROOT,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert len(printed) >= 15, proc.stdout
    rows = {line.split(" | ")[0] for line in printed}
    assert {"| 16, all", "| 15, without seed 4", "| trained tokens per trajectory, steps 1-5"} <= rows, proc.stdout
    pages = ""
    for page in ("evidence.md", "tree-rollouts.md"):
        with open(os.path.join(ROOT, "docs", page)) as f:
            pages += f.read()
    assert [line for line in printed if line + "\n" not in pages] == []


def _table_rows(page: str, settings: set[str]) -> list[str]:
    """The table rows of docs/PAGE whose first column is one of `settings`."""
    with open(os.path.join(ROOT, "docs", page)) as f:
        return [line.strip() for line in f if line.strip().startswith("| ")
                and line.strip().split("|")[1].strip() in settings]
