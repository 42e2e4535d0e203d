"""The study's step-matched AUC (llds_jax.apps.study.auc), censored time to collapse (llds_jax.apps.study.survival)
and the endpoints of issue 40's study (peak EM, LLD rate on common steps): exact values on hand-built runs, a brute-force oracle of the seed resampling, and the
collapse study's committed records against an independent recomputation (issue 40's figures)."""
import dataclasses
import gzip
import os

import numpy as np
import pytest

from llds_jax.apps import demo_study
from llds_jax.apps.study import auc, paired, sequence, steps, survival
from llds_jax.apps.study.outcomes import CURVES, EVAL_EM, LIKELIHOOD, LLD_RATE, REF_KL, REWARD, RunResult

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLLAPSE_STUDY = os.path.join(ROOT, "docs", "evidence", "collapse", "study")


def _run(arm: str, seed: int, collapse_step: int | None, collapsed: bool, **series) -> RunResult:
    """A run with the given curves (metric -> values at steps 1, 2, ...; None skips a step), the others empty."""
    curves = {metric: ([], []) for metric in CURVES if metric not in series}
    for metric, values in series.items():
        kept = [(step, v) for step, v in enumerate(values, start=1) if v is not None]
        curves[metric] = ([s for s, _ in kept], [v for _, v in kept])
    return RunResult("s", arm, seed, 0.5, collapse_step, collapsed, None, curves)


def test_trailing_mean_takes_the_logged_values_of_the_last_three_steps():
    assert auc.trailing_mean([1, 2, 3, 4, 5], [1.0, 2.0, 4.0, 8.0, 16.0], 4) == pytest.approx((2 + 4 + 8) / 3)
    assert auc.trailing_mean([1, 3], [1.0, 5.0], 4) == 5.0  # steps 2 and 4 have no value: skipped
    assert auc.trailing_mean([1, 2], [1.0, 2.0], 9) is None


def test_step_matched_auc_of_hand_built_runs():
    # Positive: collapses at step 8, LLD rate 0.9 at steps 3-5 (lead 3 reads step 5: mean of steps 3-5).
    # Negatives at step 5: 0.3 (lower: a win), 0.9 (a tie: 1/2), 1.0 (higher: a loss). AUC = 1.5 / 3.
    ones = [0.9] * 10
    runs = [_run("grpo", 0, 8, True, **{LLD_RATE: ones}),
            _run("low", 0, None, False, **{LLD_RATE: [0.3] * 10}),
            _run("low", 1, None, False, **{LLD_RATE: ones}),
            _run("other", 1, None, False, **{LLD_RATE: [1.0] * 10}),
            _run("em_only", 1, None, True, **{LLD_RATE: [0.0] * 10})]  # collapsed by final EM: in no pair
    pairs = auc.matched_pairs(runs, LLD_RATE, 3)
    assert pairs.auc() == pytest.approx(0.5)
    assert sorted(pairs.negative_p.tolist()) == pytest.approx([0.3, 0.9, 1.0])
    # A lower-warns signal flips the signs: the 0.3 run is now the higher score, the 1.0 run the lower.
    rewards = [_run("grpo", 0, 8, True, **{REWARD: [0.5] * 10}), _run("low", 0, None, False, **{REWARD: [0.8] * 10})]
    assert auc.matched_pairs(rewards, REWARD, 3).auc() == 1.0
    # Lead 8 would read step 0: no pair.
    assert auc.matched_pairs(runs, LLD_RATE, 8).auc() is None


def test_seed_resampling_weighs_each_pair_by_its_two_seeds_counts():
    rng = np.random.default_rng(1)
    pairs = auc.Pairs(rng.integers(0, 3, 40), rng.integers(0, 3, 40), rng.normal(size=40), rng.normal(size=40))
    counts_bn = rng.integers(0, 3, size=(5, 3)).astype(float)
    counts_bn[0] = [0, 0, 0]  # a draw without any seed: no pair has weight
    got_b = pairs.resampled_auc([0, 1, 2], counts_bn)
    assert np.isnan(got_b[0])
    for b in range(1, 5):  # brute force: each pair repeated count(positive seed) x count(negative seed) times
        wins, total = 0.0, 0.0
        for sp, sn, x, y in zip(pairs.positive_seed_p, pairs.negative_seed_p, pairs.positive_p, pairs.negative_p):
            w = counts_bn[b, sp] * counts_bn[b, sn]
            wins += w * ((x > y) + 0.5 * (x == y))
            total += w
        assert got_b[b] == pytest.approx(wins / total) if total else np.isnan(got_b[b])


def test_the_collapse_study_auc_matches_the_independent_recomputation_of_issue_40():
    """Issue 40 recomputed from steps.csv.gz (3-step trailing mean, 3-5 steps before collapse, against the
    non-collapsed runs at the same step): LLD rate 0.65-0.68, delta_traj 0.77-0.80, log-prob of correct
    trajectories 0.92-0.98, reward 0.97-0.98, KL to the reference 0.98-1.00."""
    results, _ = demo_study.read_recorded(os.path.join(COLLAPSE_STUDY, "runs.csv"), None)
    rows = {r.signal: r for r in auc.rows(list(results.values()), resamples=200)}
    rounded = {signal: [round(a, 2) for a in row.by_lead] for signal, row in rows.items()}
    assert rounded[LLD_RATE] == [0.65, 0.65, 0.68]
    assert rounded["lld/delta_traj_correct"] == [0.80, 0.80, 0.77]
    assert rounded["lld/logp_mean_correct"] == [0.97, 0.98, 0.92]
    assert rounded[REWARD] == [0.97, 0.97, 0.98]
    assert rounded[REF_KL] == [1.00, 0.99, 0.98]
    assert rows[LLD_RATE].pairs == [448, 448, 432]  # 31 collapse steps x 16 runs that did not collapse, less early ones
    assert rows[LLD_RATE].low < rows[LLD_RATE].pooled < rows[LLD_RATE].high
    assert rows[LLD_RATE].minus_high[0] < 0  # below the reward-drop baseline on every seed resample's 97.5%


def test_time_to_collapse_is_censored_at_the_last_step():
    def result(step, collapsed):
        return RunResult("s", "a", 0, 0.0 if collapsed else 0.5, step, collapsed, None, {})

    assert survival.time_of(result(7, True), 30) == survival.Time(7, True)
    assert survival.time_of(result(None, True), 30) == survival.Time(30, True, by_final_em=True)
    assert survival.time_of(result(None, False), 30) == survival.Time(30, False)
    assert str(survival.Time(30, False)) == "30+"
    censored, early, late = survival.Time(30, False), survival.Time(5, True), survival.Time(9, True)
    assert [survival.longer(censored, early), survival.longer(early, censored), survival.longer(censored, censored),
            survival.longer(late, early), survival.longer(early, early)] == [1, -1, 0, 1, 0]


def test_kaplan_meier_median_by_hand():
    times = [survival.Time(s, True) for s in (2, 4, 4)] + [survival.Time(3, False), survival.Time(6, False)]
    # at risk 5 at step 2 (1 event): 4/5; step 4: at risk 3 (steps 4, 4, 6), 2 events: 4/5 * 1/3 = 4/15.
    assert survival.kaplan_meier(times) == [(2, pytest.approx(0.8)), (4, pytest.approx(4 / 15))]
    assert survival.median_time(times) == 4
    assert survival.median_time([survival.Time(3, True), survival.Time(9, False), survival.Time(9, False)]) is None


def test_the_collapse_study_paired_times_to_collapse():
    results, _ = demo_study.read_recorded(os.path.join(COLLAPSE_STUDY, "runs.csv"), None)
    results = list(results.values())
    arm_rows, paired_rows = survival.tables(results, {r.name: 30 for r in results}, ["grpo"])
    by_arm = {r.arm: r for r in arm_rows}
    assert by_arm["grpo"].median == 12 and by_arm["grpo_low_lr"].median is None
    assert by_arm["llds"].times[by_arm["llds"].seeds.index(6)] == "30 by final EM"
    rows = {r.arm: r for r in paired_rows}
    # llds vs grpo: longer on seeds 3, 4, 6 (final EM at 30 vs 18), 8, 9; shorter on 5 and 7; tied on seed 2.
    assert (rows["llds"].longer, rows["llds"].shorter, rows["llds"].ties) == (5, 2, 1)
    assert rows["llds"].p == pytest.approx(2 * (1 + 7 + 21) / 128)  # two-sided binomial, 2 of 7
    assert rows["grpo_low_lr"].p == pytest.approx(2 / 256) and rows["grpo_low_lr"].holm_p == pytest.approx(5 * 2 / 256)


def test_lld_rate_on_common_steps_averages_only_the_steps_both_runs_logged():
    # grpo logged steps 1-4, llds steps 2, 4, 5: common steps 2 and 4.
    grpo = _run("grpo", 0, None, False, **{LLD_RATE: [0.9, 0.6, 0.8, 0.4]})
    llds = _run("llds", 0, None, False, **{LLD_RATE: [None, 0.2, None, 0.3, 0.0]})
    lonely = _run("llds", 1, None, False, **{LLD_RATE: [0.5]})  # its seed has no grpo run: left out
    (comparison,) = paired.comparisons([grpo, llds, lonely], ["grpo"], ["lld_rate_common"])
    assert comparison.seeds == [0]
    assert comparison.differences == [pytest.approx((0.2 + 0.3) / 2 - (0.6 + 0.4) / 2)]
    # the plain means average different steps: 0.5/3 - 2.7/4
    plain_means = [dataclasses.replace(r, lld_rate_mean=float(np.mean(r.curves[LLD_RATE][1]))) for r in (grpo, llds)]
    (plain,) = paired.comparisons(plain_means, ["grpo"], ["lld_rate_mean"])
    assert plain.differences == [pytest.approx(0.5 / 3 - 2.7 / 4)]


def test_peak_em_and_its_curve_round_trip_through_the_steps_file(tmp_path):
    with_evals = _run("grpo", 0, None, False, **{REWARD: [0.5, 0.6], EVAL_EM: [None, 0.7]})
    with_evals = dataclasses.replace(with_evals, curves={**with_evals.curves, EVAL_EM: ([0, 2], [0.1, 0.7])})
    assert with_evals.peak_em == 0.7  # step 0 (before training) is not a peak; the final EM 0.5 is below
    assert dataclasses.replace(with_evals, final_em=0.8).peak_em == 0.8
    without = _run("llds", 0, None, False, **{REWARD: [0.5, 0.6]})
    assert without.peak_em is None and EVAL_EM not in without.curves
    path = steps.write([with_evals, without], str(tmp_path))
    read = steps.read(path)
    assert read["s/grpo/seed_0"][EVAL_EM] == ([0, 2], [0.1, 0.7])
    assert EVAL_EM not in read["s/llds/seed_0"]
    # A study without evaluations during training keeps the columns of CURVES alone (its committed files unchanged).
    steps.write([without], str(tmp_path / "plain"))
    with gzip.open(tmp_path / "plain" / steps.FILE, "rt") as f:
        assert f.readline().strip().split(",") == [*steps.KEY_FIELDS, *CURVES]


def test_the_order_of_events_of_hand_built_runs():
    # Rewards rise to a 3-step peak of 0.9 (steps 3-5), then halve (trailing mean < 0.45 from step 8);
    # the correct trajectories' log-prob falls below -0.15 (trailing) at step 7: the likelihood first.
    rewards = [0.5, 0.8, 0.9, 0.9, 0.9, 0.6, 0.3, 0.2, 0.1, 0.0]
    logp = [-0.05, -0.02, -0.01, -0.01, -0.05, -0.2, -0.3, -0.4, None, None]
    first = sequence.of(_run("grpo", 0, 9, True, **{REWARD: rewards, LIKELIHOOD: logp}))
    assert (first.peak, first.peak_step, first.halved_step, first.likelihood_step) == (
        pytest.approx(0.9), 5, 8, 7)
    assert first.order == "likelihood first" and first.learned
    # The same rewards with a likelihood that never falls: the reward first; a flat run never halves.
    second = sequence.of(_run("grpo", 1, 9, True, **{REWARD: rewards, LIKELIHOOD: [-0.01] * 10}))
    assert second.likelihood_step is None and second.order == "reward first"
    flat = sequence.of(_run("grpo", 2, None, False, **{REWARD: [0.5] * 6}))
    assert (flat.halved_step, flat.order, flat.learned) == (None, "—", False)
    assert sequence.of(_run("grpo", 3, None, False)) is None  # no curves
    lines = sequence.markdown([_run("grpo", 0, 9, True, **{REWARD: rewards, LIKELIHOOD: logp})])
    assert "| s | grpo | 0 | 0.90 at 5 | 8 | 7 | 9 | likelihood first |" in lines
