"""Issue 56's registered endpoints: the one-sided exact sign-flip test of non-inferiority, the lasting collapse and
lasting decline rules that tell a transient dip from a collapse, the mean of the last 3 evaluations (all questions
and two-hop ones), and the primary table (llds_jax.apps.study.primary) with the study command's --primary and
--margin; each against values worked out here by hand or by brute-force enumeration."""
import itertools
import json
import os

import numpy as np
import pytest

from llds_jax.apps import demo_study
from llds_jax.apps.study import outcomes, paired, plan, primary, stats, steps
from llds_jax.apps.study.outcomes import EVAL_EM, EVAL_EM_TWO_HOP, LLD_RATE, REWARD, RunResult


def _enumerated_greater(differences, null):
    """The one-sided p by listing every sign assignment with itertools (independent of stats' bit tricks)."""
    d = np.asarray(differences, dtype=float) - null
    sums = [sum(s * x for s, x in zip(signs, d)) for signs in itertools.product((1, -1), repeat=len(d))]
    return float(np.mean([total >= d.sum() - 1e-12 for total in sums]))


@pytest.mark.parametrize("differences, null, expected", [
    # s . (0.1, -0.05, 0.03) over the 8 assignments: 0.08 (observed), 0.18, 0.12 reach 0.08; -0.12, 0.02, -0.02,
    # -0.18, -0.08 do not
    ([0.1, -0.05, 0.03], 0.0, 3 / 8),
    ([0.01] * 16, -0.02, 1 / 2 ** 16),   # 16 seeds all above -0.02: only the observed assignment reaches it
    ([-0.03] * 4, -0.02, 1.0),           # every shifted difference -0.01: every assignment reaches the sum -0.04
    ([0.5, 0.5], 0.0, 1 / 4),
])
def test_non_inferiority_p_is_the_share_of_sign_assignments_reaching_the_shifted_sum(differences, null, expected):
    assert stats.sign_flip_p_greater(differences, null) == pytest.approx(expected, abs=1e-15)


def test_non_inferiority_p_matches_enumeration_and_is_one_sided():
    d = [0.04, -0.06, 0.01, 0.02, -0.01, 0.05, -0.02, 0.03, 0.0, 0.01]
    assert stats.sign_flip_p_greater(d, -0.02) == _enumerated_greater(d, -0.02)
    assert stats.sign_flip_p_greater(d, 0.0) == _enumerated_greater(d, 0.0)
    # the two-sided p of a sum above 0 is twice the one-sided one when no assignment sums to exactly 0
    assert stats.sign_flip_p([0.3, 0.1, 0.2]) == 2 * stats.sign_flip_p_greater([0.3, 0.1, 0.2]) == 2 * 1 / 8
    assert stats.sign_flip_p_greater([-0.3, -0.1, -0.2]) == 1.0  # below: one-sided, no evidence above
    with pytest.raises(ValueError, match="sign_flip_p_greater needs a non-empty list of numbers"):
        stats.sign_flip_p_greater([])


def test_non_inferiority_beyond_16_differences_samples_the_assignments():
    # all 17 above the null: only the observed assignment reaches the sum; 100 draws miss it, p = 1 / 101
    assert stats.sign_flip_p_greater(np.zeros(17), -0.02, resamples=100) == 1 / 101


STEPS = list(range(1, 31))


@pytest.mark.parametrize("rewards, final_em, collapse_step, lasting", [
    # grpo_low_lr seed 5 of issue 40 in small: below 0.1 on steps 11-15, back to 0.9: a transient collapse
    ([0.9] * 10 + [0.05] * 5 + [0.9] * 15, 0.9, 11, False),
    ([0.9] * 10 + [0.05] * 20, 0.5, 11, True),                 # below 0.1 to the end: lasting
    ([0.9] * 10 + [0.05] * 15 + [0.2] * 5, 0.5, 11, True),    # end 0.125, below half the peak 0.9: lasting
    ([0.9] * 10 + [0.05] * 10 + [0.5] * 10, 0.5, 11, False),  # end 0.5, back above half the peak: transient
    ([0.9] * 30, 0.01, None, True),                            # a final EM below 0.05 is a lasting collapse
    ([0.9] * 30, 0.5, None, False),
])
def test_a_collapse_lasts_when_the_runs_last_10_steps_stay_below_half_its_peak(rewards, final_em, collapse_step,
                                                                               lasting):
    assert stats.collapse_step(STEPS, rewards) == collapse_step
    assert stats.lasting_collapse(STEPS, rewards, final_em) is lasting


@pytest.mark.parametrize("rewards, decline_step, lasting", [
    # 3-step means 0.8, 0.8, ..., then at step 12 (0.8 + 0.3 + 0.3) / 3 = 0.467 >= 0.4, step 13 0.3 < 0.4
    ([0.8] * 10 + [0.3] * 5 + [0.8] * 15, 13, False),          # a dip the run recovers from
    ([0.8] * 10 + [0.3] * 20, 13, True),                       # end 0.3 < half the peak 0.8
    ([0.8] * 10 + [0.3] * 12 + [0.5] * 8, 13, False),          # end (2 x 0.3 + 8 x 0.5) / 10 = 0.46 >= 0.4
    ([0.2, 0.4, 0.6] * 10, None, False),                       # noisy, never half of its running peak
])
def test_a_decline_lasts_when_the_runs_end_is_below_half_its_peak(rewards, decline_step, lasting):
    assert stats.decline_step(STEPS, rewards) == decline_step
    assert stats.lasting_decline(STEPS, rewards) is lasting


def test_the_decline_rules_trailing_mean_counts_only_logged_steps():
    assert stats.trailing_means([1, 2, 5, 6], [0.2, 0.4, 0.6, 1.0]) == pytest.approx([0.2, 0.3, 0.6, 0.8])
    with pytest.raises(ValueError, match="2 steps but 1 rewards"):
        stats.trailing_means([1, 2], [0.5])
    with pytest.raises(ValueError, match="lasting_decline needs at least one reward"):
        stats.lasting_decline([], [])
    with pytest.raises(ValueError, match="lasting_collapse needs at least one reward"):
        stats.lasting_collapse([], [], 0.5)


def _run(arm, seed, final_em, em, two_hop, rewards=(0.9,) * 12):
    """A RunResult with rewards on steps 1..12 and evaluations at steps 0, 3, 6, 9, 12."""
    evaluations = [0, 3, 6, 9, 12][:len(em)]
    curves = {**{metric: ([], []) for metric in outcomes.CURVES}, REWARD: (list(range(1, 13)), list(rewards)),
              EVAL_EM: (evaluations, list(em)), EVAL_EM_TWO_HOP: (evaluations, list(two_hop))}
    return outcomes.result_of("good_lr", arm, seed, final_em, curves)


def test_last3_em_is_the_mean_of_the_last_three_evaluations_after_step_0():
    run = _run("grpo", 4, 0.7, [0.1, 0.5, 0.6, 0.8, 0.7], [0.0, 0.25, 0.5, 0.625, 0.375])
    assert run.last3_em == pytest.approx((0.6 + 0.8 + 0.7) / 3, abs=1e-15)
    assert run.last3_two_hop_em == pytest.approx(0.5, abs=1e-15)
    assert _run("grpo", 4, 0.7, [0.1, 0.5, 0.6], [0.0, 0.2, 0.4]).last3_em is None  # 2 evaluations after step 0
    bare = RunResult("good_lr", "grpo", 4, 0.7, None, False, None, {m: ([], []) for m in outcomes.CURVES})
    assert (bare.last3_em, bare.last3_two_hop_em, bare.lasting_collapse, bare.lasting_decline) == (None,) * 4


def test_the_two_hop_em_is_read_from_the_runs_metrics_and_kept_in_the_steps_file(tmp_path):
    run = plan.Run("good_lr", "llds", 4, "c.py", (), str(tmp_path / "run"), 12)
    records = [{"step": 0, EVAL_EM: 0.1, EVAL_EM_TWO_HOP: 0.05}]
    for step in range(1, 13):
        records.append({"step": step, REWARD: 0.9, LLD_RATE: 0.5, **(
            {EVAL_EM: 0.5 + step / 100, EVAL_EM_TWO_HOP: 0.25 + step / 100} if step % 3 == 0 else {})})
    os.makedirs(os.path.join(run.run_dir, "eval", "final_step_12"))
    with open(os.path.join(run.run_dir, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(record) + "\n" for record in records)
    with open(os.path.join(run.run_dir, "eval", "final_step_12", "results.json"), "w") as f:
        json.dump({"em": {"single_hop": 0.82, "two_hop": 0.42, "mean": 0.62}}, f)
    result = outcomes.read_result(run)
    assert result.curves[EVAL_EM_TWO_HOP] == ([0, 3, 6, 9, 12], [0.05, *(0.25 + step / 100 for step in (3, 6, 9, 12))])
    assert result.last3_two_hop_em == pytest.approx((0.31 + 0.34 + 0.37) / 3, abs=1e-15)
    assert result.last3_em == pytest.approx((0.56 + 0.59 + 0.62) / 3, abs=1e-15)
    path = steps.write([result], str(tmp_path / "study"))
    assert steps.read(path)[result.name][EVAL_EM_TWO_HOP] == result.curves[EVAL_EM_TWO_HOP]


def _study():
    """16 seeds (4-19): llds's last-3 EM is grpo's plus (seed - 11) / 200, so the differences are -0.035 ... +0.04;
    grpo's runs on seeds 4 and 5 collapse and stay collapsed."""
    results = []
    for seed in range(4, 20):
        base = 0.6 + seed / 100
        collapsed = seed in (4, 5)
        rewards = [0.9] * 2 + [0.0] * 10 if collapsed else [0.9] * 12
        results.append(_run("grpo", seed, base, [0.1, base, base, base, base], [0.0, 0.5, 0.5, 0.5, 0.5], rewards))
        em = base + (seed - 11) / 200
        results.append(_run("llds", seed, em, [0.1, em, em, em, em], [0.0, 0.5, 0.5, 0.5, 0.5]))
    return results


def test_the_primary_table_tests_the_arm_against_the_control_exactly_and_for_non_inferiority():
    from scipy import stats as scipy_stats  # an independent t quantile
    found = primary.rows(_study(), ["grpo"], "last3_em", 0.02)
    assert len(found) == 1
    row = found[0]
    c = row.comparison
    d = np.array([(seed - 11) / 200 for seed in range(4, 20)])
    assert (c.arm, c.control, c.seeds) == ("llds", "grpo", list(range(4, 20)))
    assert c.differences == pytest.approx(d, abs=1e-12) and c.mean == pytest.approx(0.0025, abs=1e-12)
    signs = np.array(list(itertools.product((1.0, -1.0), repeat=16)))
    assert c.sign_flip_p == np.mean(np.abs(signs @ d) >= abs(d.sum()) - 1e-9)
    assert row.non_inferiority_p == np.mean(signs @ (d + 0.02) >= (d + 0.02).sum() - 1e-9)
    assert 0.0 < row.non_inferiority_p < 0.025 < c.sign_flip_p  # no difference shown, non-inferior at 2 points
    half = scipy_stats.t.ppf(0.975, 15) * d.std(ddof=1) / 4
    assert (c.t_low, c.t_high) == pytest.approx((0.0025 - half, 0.0025 + half), rel=1e-9)
    assert (c.higher, c.lower, c.equal) == (8, 7, 1)
    lines = primary.markdown(found)
    assert lines[2] == (f"| good_lr | llds | grpo | greedy EM, mean of the last 3 evaluations | 16 "
                        f"(4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19) | {c.mean:+.3f} | [{c.t_low:+.3f}, "
                        f"{c.t_high:+.3f}] | {c.sign_flip_p:.4f} | 0.02 | {row.non_inferiority_p:.4f} | 8 / 7 / 1 |")
    assert primary.rows(_study(), ["grpo"], "last3_em")[0].non_inferiority_p is None
    with pytest.raises(plan.StudyError, match="--primary: 'lld_rate_common' is not an endpoint of one run"):
        primary.rows(_study(), ["grpo"], "lld_rate_common")
    with pytest.raises(plan.StudyError, match="--margin must be a positive number, got -0.02"):
        primary.rows(_study(), ["grpo"], "last3_em", -0.02)


def test_lasting_collapse_and_decline_are_paired_endpoints_tested_as_mcnemars():
    found = paired.comparisons(_study(), ["grpo"], paired.parse_endpoints("lasting_decline,lasting_collapse"))
    assert [(c.endpoint, c.differences, c.sign_flip_p) for c in found] == [
        ("lasting_collapse", [-1, -1] + [0] * 14, 0.5), ("lasting_decline", [-1, -1] + [0] * 14, 0.5)]


def test_the_study_command_writes_the_primary_table_and_refuses_a_margin_alone(tmp_path, capsys):
    out = str(tmp_path / "study")
    for result in _study():
        if result.seed > 5:
            continue
        run_dir = os.path.join(out, "runs", "stress", result.arm, f"seed_{result.seed}")
        os.makedirs(os.path.join(run_dir, "eval", "final_step_12"))
        records = [{"step": step, **({REWARD: result.curves[REWARD][1][step - 1]} if step else {}),
                    **({EVAL_EM: result.curves[EVAL_EM][1][step // 3]} if step % 3 == 0 else {})}
                   for step in range(13)]
        with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
            f.writelines(json.dumps(record) + "\n" for record in records)
        with open(os.path.join(run_dir, "eval", "final_step_12", "results.json"), "w") as f:
            json.dump({"em": {"mean": result.final_em}}, f)
    argv = ["--seeds", "4-5", "--out", out, "--report", "--controls", "grpo", "--endpoints", "lasting_collapse",
            "--primary", "last3_em", "--margin", "0.02", "--", "--config.train.total_steps=12"]
    assert demo_study.main(argv) == 0
    table = (tmp_path / "study" / "primary.md").read_text().splitlines()
    # seeds 4, 5: differences -0.035, -0.03; two-sided p 2/4; shifted by the margin -0.015, -0.01: every assignment
    # reaches their sum, one-sided p 1
    assert table[2].startswith("| stress | llds | grpo | greedy EM, mean of the last 3 evaluations | 2 (4,5) "
                               "| -0.033 |")
    assert table[2].endswith("| 0.5000 | 0.02 | 1.0000 | 0 / 2 / 0 |")
    assert "| stress | llds | 2 | " in (tmp_path / "study" / "arms.md").read_text()
    assert json.loads((tmp_path / "study" / "primary.json").read_text())[0]["non_inferiority_p"] == 1.0
    with pytest.raises(SystemExit):
        demo_study.main(["--out", out, "--report", "--margin", "0.02"])
    assert "--margin is only read with --primary" in capsys.readouterr().err
    assert demo_study.main(["--out", out, "--report", "--primary", "reward"]) == 2
    assert "--primary: 'reward' is not an endpoint of one run" in capsys.readouterr().err


def test_the_registered_study_is_32_runs_of_200_steps_at_lr_2e4_evaluated_every_10(tmp_path):
    """docs/evidence.md's registration of issue 56: setting good_lr, arms grpo and llds, seeds 4-19."""
    study = plan.make_plan(str(tmp_path), plan.parse_settings("good_lr"), plan.parse_arms("grpo,llds"),
                           plan.parse_seeds("4-19"))
    assert [(r.arm, r.seed) for r in study.runs] == [(a, s) for a in ("grpo", "llds") for s in range(4, 20)]
    for run in study.runs:
        cfg = plan.load(run.config, run.overrides)
        assert (cfg.train.total_steps, cfg.optim.learning_rate, cfg.train.eval_every) == (200, 2e-4, 10)
        assert cfg.seed == run.seed and cfg.train.final_eval
        llds = cfg.objective.llds
        assert (llds.enabled, llds.lam, llds.gate) == ((True, 0.2, "action") if run.arm == "llds" else
                                                      (False, llds.lam, llds.gate))
    assert sorted(study.warm_starts) == list(range(4, 20))


def test_the_registered_partial_rollout_comparison_is_16_runs_of_20_steps_and_8_warm_starts(tmp_path, capsys):
    """docs/evidence.md's registration of issue 59's comparison: setting stress, arms sync_tis and partial2, seeds
    0-7, primary final_em, the timing family; its --dry-run plans 16 runs and 8 warm starts and starts nothing."""
    out = str(tmp_path / "partial_study")
    argv = ["--settings", "stress", "--arms", "sync_tis,partial2", "--seeds", "8", "--out", out,
            "--controls", "sync_tis", "--primary", "final_em", "--endpoints", "step_s,rollout_s,tokens_per_s"]
    assert demo_study.main([*argv, "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert f"study {out}: 16 runs over 8 seeds; 0 finished (skipped), 16 to run, 8 worlds + warm starts to build" \
        in printed
    assert printed.count("--mode=sft") == 8 and sum(line.startswith("+ ") for line in printed.splitlines()) == 24
    assert not os.path.exists(out)
    study = plan.make_plan(out, plan.parse_settings("stress"), plan.parse_arms("sync_tis,partial2"),
                           plan.parse_seeds("8"))
    assert [(r.arm, r.seed) for r in study.runs] == [(a, s) for a in ("sync_tis", "partial2") for s in range(8)]
    for run in study.runs:
        cfg = plan.load(run.config, run.overrides)
        assert (cfg.train.total_steps, cfg.train.eval_every, cfg.seed) == (20, 0, run.seed) and cfg.train.final_eval
        assert cfg.rollout.partial == (run.arm == "partial2") and cfg.objective.tis_cap == 2.0
