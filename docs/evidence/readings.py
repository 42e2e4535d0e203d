"""Issue 56's re-readings of the late-collapse study and the chain-vs-tree study (not pre-registered), printed from
the committed records alone: python docs/evidence/readings.py (from the repository root); and the curves of its
good-learning-rate calibration and of its study.

Late-collapse study (docs/evidence/late_collapse/study/): how the LLDS runs declined; the collapse counts at other
reward thresholds of the rule (llds_jax/apps/study/stats.py: reward below the threshold on 3 consecutive steps, or a
final greedy EM below 0.05); `grpo_low_lr` seed 5's collapse and recovery; the order of events
(llds_jax/apps/study/sequence.py) with the registered threshold (-0.15) and with one relative to each run's own level.
Calibration at a good learning rate (docs/evidence/long_horizon/calibration/): per seed, the greedy test EM of
every evaluation, the mean of the last 3 against the middle of the horizon, the train reward and LLD rate by quarter.
Issue 56's registered design: the minimum detectable effect of its primary endpoint (the mean of the last 3
evaluations' EM, LLDS minus GRPO, 16 paired seeds) at 80% power, from the calibration's spread, and the simulated power
of the exact sign-flip tests there.
Issue 56's study (docs/evidence/good_lr/study/): per arm its registered descriptive counts (collapse steps and
declines, transient or lasting); not pre-registered, each seed's mean of the last 3 evaluations and each arm's mean
greedy EM at every evaluation, with the paired differences.
Tree study (docs/evidence/tree_study/): the paired EM differences at every evaluation, the power of the primary test
against a 5-point difference, seconds per step.
Issue 66's readings (not pre-registered): of issue 56's study, the spread its primary endpoint had against the one its
registration assumed (each arm's sd, their correlation across seeds, the paired differences' sd and the minimum
detectable effect at it, with and without GRPO's collapsed seed 4); of issue 59's comparison
(docs/evidence/partial_study/), per seed the trained tokens per trajectory in the first steps, the rollout seconds,
the searches sent and the final EM, and the paired differences of the first.
docs/evidence.md and docs/tree-rollouts.md quote these lines (tests/test_demo_study.py checks the table rows).
"""
from __future__ import annotations

import itertools
import os
import sys

import numpy as np

from llds_jax.train import report
from llds_jax.apps.study import sequence, stats, steps, table
from llds_jax.apps.study.auc import trailing_mean
from llds_jax.apps.study.outcomes import (EVAL_EM, LIKELIHOOD, LLD_RATE, REWARD, SEARCHES, STEP_S, TOKENS_PER_S,
                                          TRAJECTORIES)

EVIDENCE = os.path.dirname(os.path.abspath(__file__))
LATE_ARMS = ("grpo", "llds", "llds_lam1", "grpo_low_lr", "grpo_clip_higher")
THRESHOLDS = (0.05, stats.COLLAPSE_REWARD, 0.2)
DROPS = (0.03, 0.05, 0.1)  # the relative likelihood thresholds: below the run's own peak minus this
TREE_ARMS = ("llds_trees", "llds_trees_wide", "llds_trees_quarter")
MARGIN = 0.05              # the tree study's registered non-inferiority margin
POWER_DRAWS = 200_000
MIDDLE = (90, 100, 110)    # the calibration's middle evaluations, against its last 3
QUARTERS = ((1, 50), (51, 100), (101, 150), (151, 200))
STUDY_SEEDS = 16           # issue 56's registered paired seeds
GOOD_LR_ARMS = ("grpo", "llds")  # its arms, control first
NI_MARGIN = 0.02           # its registered non-inferiority margin
EXACT_DRAWS = 2000         # simulated studies per power of an exact sign-flip test
TARGET_MDE = 0.05          # the effect a next registration at that setting would want to detect
PARTIAL_ARMS = ("sync_tis", "partial2")  # issue 59's comparison, control first
EARLY = (1, 5)             # its first steps (inclusive), where the cut's choice of groups shows most


def load(folder: str):
    path = os.path.join(EVIDENCE, folder)
    return steps.attach(table.read_runs(os.path.join(path, "runs.csv")),
                        steps.read(os.path.join(path, "steps.csv.gz")), os.path.join(path, "steps.csv.gz"))


def relative_fall(result, events: sequence.Events, drop: float) -> int | None:
    """The first step after the reward's peak at which the 3-step mean log-prob of the correct trajectories is below
    its highest 3-step mean up to the reward's peak, minus `drop` (None: never, or no value up to the peak)."""
    logged, values = result.curves[LIKELIHOOD]
    before = [trailing_mean(logged, values, s) for s in logged if s <= events.peak_step]
    if not before:
        return None
    level = max(before) - drop
    return sequence._first_after(logged, values, events.peak_step, lambda mean: mean < level)


def order_counts(pairs) -> list[str]:
    """[halved, both, likelihood first, same step, reward first] of (events, likelihood step) pairs."""
    halved = [(e, fell) for e, fell in pairs if e.halved_step is not None]
    both = [(e, fell) for e, fell in halved if fell is not None]
    return [str(n) for n in (len(halved), len(both), sum(fell < e.halved_step for e, fell in both),
                             sum(fell == e.halved_step for e, fell in both),
                             sum(fell > e.halved_step for e, fell in both))]


def late_collapse() -> list[str]:
    results = load(os.path.join("late_collapse", "study"))
    arm = {name: [r for r in results if r.arm == name] for name in LATE_ARMS}
    events = {r.name: sequence.of(r) for r in results}
    lines = ["late-collapse study (not pre-registered)"]
    for name in ("llds", "llds_lam1"):
        at10 = np.mean([dict(zip(*r.curves[EVAL_EM]))[10] for r in arm[name]])
        halved = sum(events[r.name].halved_step is not None for r in arm[name])
        lines.append(f"- {name}: mean greedy EM {at10:.3f} at step 10, {np.mean([r.final_em for r in arm[name]]):.3f} "
                     f"at step 80; train reward halved in {halved} of {len(arm[name])} runs")
    lines += ["", "collapse counts by the rule's reward threshold (final EM below 0.05 as registered):", ""]
    rows = []
    for threshold in THRESHOLDS:
        label = f"{threshold}" + (" (registered)" if threshold == stats.COLLAPSE_REWARD else "")
        counts = [sum(stats.collapsed(stats.collapse_step(*r.curves[REWARD], threshold=threshold), r.final_em)
                      for r in arm[name]) for name in LATE_ARMS]
        rows.append([label] + [f"{n}/{len(arm[name])}" for n, name in zip(counts, LATE_ARMS)])
    lines += report.markdown_table(["reward threshold", *LATE_ARMS], rows)

    low5 = next(r for r in arm["grpo_low_lr"] if r.seed == 5)
    below = [s for s, v in zip(*low5.curves[REWARD]) if s >= low5.collapse_step and v < stats.COLLAPSE_REWARD]
    back = next(s for s, v in zip(*low5.curves[REWARD]) if s > below[-1] and v >= 0.85)
    ranked = sorted(results, key=lambda r: -r.final_em)
    lines += ["", f"- grpo_low_lr seed 5: collapse step {low5.collapse_step}; train reward below "
                  f"{stats.COLLAPSE_REWARD} on steps {below[0]}-{below[-1]} ({len(below)} steps), 0.85 or more "
                  f"again at step {back}; greedy EM at step 50 {dict(zip(*low5.curves[EVAL_EM]))[50]:.3f}; final EM "
                  f"{low5.final_em:.3f}, rank {ranked.index(low5) + 1} of {len(results)} (best: {ranked[0].name} "
                  f"{ranked[0].final_em:.3f})"]

    lines += ["", "order of events: when the likelihood of correct trajectories fell (3-step means, after the reward's "
                  "peak):", ""]
    rows = [[f"below {sequence.LIKELIHOOD_DROP} (registered)"] + order_counts(
        [(events[r.name], events[r.name].likelihood_step) for r in results])]
    for drop in DROPS:
        rows.append([f"below its own peak minus {drop}"] + order_counts(
            [(events[r.name], relative_fall(r, events[r.name], drop)) for r in results]))
    lines += report.markdown_table(["the likelihood fell", "runs whose reward halved", "of those, both events",
                                    "likelihood first", "same step", "reward first"], rows)
    at_peak = [trailing_mean(*r.curves[LIKELIHOOD], events[r.name].peak_step) for r in results
               if events[r.name].halved_step is not None]
    stable = [r for r in arm["grpo_low_lr"] if events[r.name].halved_step is None]
    drawdown = []
    for r in stable:
        logged, values = r.curves[LIKELIHOOD]
        means = [trailing_mean(logged, values, s) for s in logged if s >= 6]
        drawdown.append(max(np.maximum.accumulate(means) - means))
    lines += ["", f"- 3-step log-prob of correct trajectories at the reward's peak, runs whose reward halved: "
                  f"{min(at_peak):.3f} to {max(at_peak):.3f} (median {np.median(at_peak):.3f})",
              f"- grpo_low_lr runs whose reward never halved: {len(stable)}; their 3-step log-prob's largest fall "
              f"below its running peak from step 6 on: {' '.join(f'{d:.3f}' for d in sorted(drawdown))}"]
    return lines


def long_horizon_calibration() -> list[str]:
    results = sorted(load(os.path.join("long_horizon", "calibration")), key=lambda r: r.seed)
    em = {r.seed: dict(zip(*r.curves[EVAL_EM])) for r in results}
    evaluations = sorted(em[results[0].seed])
    lines = ["good-learning-rate calibration: greedy test EM per evaluation", ""]
    lines += report.markdown_table(
        ["step", *(f"seed {r.seed}" for r in results), "mean"],
        [[str(step), *(f"{em[r.seed][step]:.3f}" for r in results),
          f"{np.mean([em[r.seed][step] for r in results]):.3f}"]
         for step in evaluations])
    rows = []
    for r in results:
        periodic = [em[r.seed][step] for step in evaluations if step > 0]
        last3, middle = np.mean(periodic[-3:]), np.mean([em[r.seed][step] for step in MIDDLE])
        reward = dict(zip(*r.curves[REWARD]))
        means = [trailing_mean(*r.curves[REWARD], step) for step in reward]
        running = np.maximum.accumulate(means)
        rates = dict(zip(*r.curves[LLD_RATE]))
        rows.append([str(r.seed), f"{r.final_em:.3f}", f"{last3:.3f}", f"{middle:.3f}", f"{last3 - middle:+.3f}",
                     f"{max(periodic):.3f}", f"{min(periodic):.3f} at {evaluations[1:][int(np.argmin(periodic))]}",
                     f"{min(reward.values()):.3f}", str(int(np.sum(np.array(means) < running / 2))),
                     " ".join(f"{np.mean([v for s, v in reward.items() if a <= s <= b]):.2f}" for a, b in QUARTERS),
                     " ".join(f"{np.mean([v for s, v in rates.items() if a <= s <= b]):.2f}" for a, b in QUARTERS)])
    lines += ["", "per seed (evaluations at steps 10-200; quarters: steps 1-50, 51-100, 101-150, 151-200):", ""]
    lines += report.markdown_table(
        ["seed", "final EM", "mean of last 3 evaluations", "mean at steps 90-110", "last 3 minus middle",
         "highest evaluation", "lowest evaluation", "lowest train reward",
         "steps with the 3-step train reward below half its running peak", "train reward by quarter",
         "LLD rate by quarter"], rows)
    last3 = [float(row[2]) for row in rows]
    lines += ["", f"- mean of last 3 evaluations over seeds: mean {np.mean(last3):.3f}, sd {np.std(last3, ddof=1):.3f}"]
    return lines


def _exact_power(sd: float, n: int, effect: float, margin: float = 0.0) -> float:
    """Simulated power of an exact sign-flip test over all 2^n sign assignments, on n normal differences of this sd
    centred on `effect` (EXACT_DRAWS studies, numpy's default_rng(0)): two-sided at 0.05 without a margin, else
    one-sided at 0.025 of the differences plus `margin` (the non-inferiority test)."""
    signs_an = (1 - 2 * ((np.arange(2 ** n)[:, None] >> np.arange(n)) & 1)).astype(np.float64)
    draws_nb = np.random.default_rng(0).normal(effect, sd, size=(n, EXACT_DRAWS)) + margin
    rejected = 0
    for chunk_nb in np.split(draws_nb, 8, axis=1):
        sums_ab = signs_an @ chunk_nb  # row 0 is the observed assignment (every sign +1)
        tolerance = stats.SIGN_FLIP_TIE_RTOL * np.abs(chunk_nb).sum(axis=0)
        if margin:
            p_b = (sums_ab >= sums_ab[0] - tolerance).mean(axis=0)
            rejected += int((p_b <= 0.025).sum())
        else:
            p_b = (np.abs(sums_ab) >= np.abs(sums_ab[0]) - tolerance).mean(axis=0)
            rejected += int((p_b <= 0.05).sum())
    return rejected / EXACT_DRAWS


def _t_multiplier(n: int) -> float:
    """t(0.975, n - 1) + t(0.80, n - 1): the minimum detectable effect at 80% power, two-sided 0.05, of n paired
    differences, in units of their sd / sqrt(n)."""
    return stats.t_quantile(0.95, n - 1) + stats.t_quantile(0.6, n - 1)


def _mde(sd: float, n: int) -> float:
    """The minimum detectable effect (EM) of the registered designs' paired test: n pairs whose differences have
    this sd (EM)."""
    return _t_multiplier(n) * sd / np.sqrt(n)


def good_lr_design() -> list[str]:
    results = sorted(load(os.path.join("long_horizon", "calibration")), key=lambda r: r.seed)
    between = float(np.std([r.last3_em for r in results], ddof=1))
    windows = []
    for r in results:  # each run's means of 3 consecutive evaluations, steps 30-200 (6 windows)
        em = dict(zip(*r.curves[EVAL_EM]))
        windows.append(np.array([em[step] for step in range(30, 201, 10)]).reshape(6, 3).mean(axis=1))
    within = float(np.sqrt(np.mean([w.var(ddof=1) for w in windows])))
    n = STUDY_SEEDS
    multiplier = _t_multiplier(n)
    rows = []
    assumptions = (("runs of a seed independent: sqrt(2) x the between-seed sd of the last-3 mean", between),
                   ("sqrt(2) x the within-run sd of a 3-evaluation mean (steps 30-200, pooled)", within))
    for label, sd in ((label, np.sqrt(2) * sd) for label, sd in assumptions):
        mde = _mde(sd, n)
        rows.append([label, f"{sd:.3f}", f"{mde:.3f}", f"{_exact_power(sd, n, mde):.2f}",
                     f"{_exact_power(sd, n, 0.0, NI_MARGIN):.2f}"])
    lines = [f"issue 56's design: {n} paired seeds, the primary endpoint's minimum detectable effect at 80% power", ""]
    lines += report.markdown_table(
        ["sd of the paired differences, assumed", "sd", "MDE: (t(0.975, 15) + t(0.80, 15)) x sd / 4",
         "exact sign-flip power at the MDE (simulated)",
         f"non-inferiority power at a true difference of 0, margin {NI_MARGIN} (simulated)"], rows)
    lines += ["", f"- between-seed sd of the last-3 mean {between:.4f}; within-run sd of a 3-evaluation mean "
                  f"{within:.4f}; t multiplier {multiplier:.4f}"]
    late = load(os.path.join("late_collapse", "study"))
    for name, runs in (("calibration", results), ("late-collapse study", late)):
        ends = ", ".join(f"{r.name} end {np.mean(r.curves[REWARD][1][-stats.END_STEPS:]):.3f}" for r in runs
                         if r.collapse_step is not None and not r.lasting_collapse
                         or stats.decline_step(*r.curves[REWARD]) is not None and not r.lasting_decline)
        counts = {arm: (sum(r.lasting_collapse for r in runs if r.arm == arm),
                        sum(r.lasting_decline for r in runs if r.arm == arm))
                  for arm in dict.fromkeys(r.arm for r in runs)}
        lines.append(f"- the lasting rules on the {name}: lasting collapses / declines per arm "
                     + ", ".join(f"{arm} {c} / {d}" for arm, (c, d) in counts.items())
                     + f"; recovered from a collapse or a dip: {ends or 'none'}")
    return lines


def _paired_cell(d: np.ndarray) -> str:
    """Paired differences over seeds as 'mean [95% t interval] (seeds higher / lower)'."""
    low, high = stats.t_interval(d)
    return f"{d.mean():+.3f} [{low:+.3f}, {high:+.3f}] ({(d > 0).sum()} / {(d < 0).sum()})"


def _paired_arms(results, names: tuple[str, str], folder: str):
    """(control's runs, the arm's runs) of a study's records, each by seed; ValueError naming `folder` when the two
    arms' seeds differ."""
    control, treated = (sorted((r for r in results if r.arm == name), key=lambda r: r.seed) for name in names)
    if [r.seed for r in control] != [r.seed for r in treated]:
        raise ValueError(f"{folder}: the arms' seeds differ: {[r.seed for r in control]} vs "
                         f"{[r.seed for r in treated]}")
    return control, treated


def good_lr_study() -> list[str]:
    """Issue 56's study: per arm the registered descriptive counts (collapse steps and declines by the studies'
    rules, and how many of them the lasting rules drop as transient); not pre-registered, per seed the mean of the
    last 3 evaluations, and per evaluation each arm's mean greedy EM with the paired difference."""
    results = load(os.path.join("good_lr", "study"))
    arm = dict(zip(GOOD_LR_ARMS, _paired_arms(results, GOOD_LR_ARMS, "good_lr/study")))
    control, treated = (arm[name] for name in GOOD_LR_ARMS)
    rows = []
    for name, runs in arm.items():
        collapses = [r for r in runs if r.collapse_step is not None]
        declines = [(r, step) for r in runs if (step := stats.decline_step(*r.curves[REWARD])) is not None]
        rows.append([name, str(len(runs)), str(len(collapses)), str(sum(r.lasting_collapse for r in runs)),
                     str(sum(not r.lasting_collapse for r in collapses)), str(len(declines)),
                     str(sum(r.lasting_decline for r in runs)), str(sum(not r.lasting_decline for r, _ in declines)),
                     ", ".join(f"seed {r.seed} at {step}" + (" (lasting)" if r.lasting_decline else "")
                               for r, step in declines) or "—"])
    lines = ["good-learning-rate study: collapses and declines per arm (registered, descriptive)", ""]
    lines += report.markdown_table(
        ["arm", "runs", "collapse step (studies' rule)", "lasting collapses", "transient collapses",
         "declines (3-step reward below half its running peak)", "lasting declines", "transient dips",
         "declined at"], rows)
    lines += ["", "per seed, the mean of the last 3 evaluations (not pre-registered):", ""]
    lines += report.markdown_table(
        ["seed", *(f"{name} last-3 EM" for name in GOOD_LR_ARMS), "difference"],
        [[str(c.seed), f"{c.last3_em:.3f}", f"{t.last3_em:.3f}", f"{t.last3_em - c.last3_em:+.3f}"]
         for c, t in zip(control, treated)])
    em = {r.name: dict(zip(*r.curves[EVAL_EM])) for r in results}
    evaluations = sorted(step for step in em[control[0].name] if step > 0)
    rows = []
    for step in evaluations:
        d = np.array([em[t.name][step] - em[c.name][step] for c, t in zip(control, treated)])
        rows.append([str(step), *(f"{np.mean([em[r.name][step] for r in runs]):.3f}" for runs in (control, treated)),
                     _paired_cell(d)])
    lines += ["", "mean greedy EM of each arm at each evaluation, and llds minus grpo on the same seeds: mean [95% t "
                  "interval] (seeds higher / lower) (not pre-registered):", ""]
    lines += report.markdown_table(["step", *GOOD_LR_ARMS, "llds minus grpo"], rows)
    return lines


def good_lr_spread() -> list[str]:
    """Issue 56's study against its registration's power assumption (not pre-registered): the primary endpoint's
    spread per arm (sd of the last-3 EM over seeds), the arms' correlation across seeds, the paired differences' sd
    and estimate, the MDE at that sd, and the paired seeds that sd needs for an MDE of TARGET_MDE; with every seed
    and without those whose control run collapsed for good (GRPO seed 4)."""
    control, treated = _paired_arms(load(os.path.join("good_lr", "study")), GOOD_LR_ARMS, "good_lr/study")
    collapsed = [c.seed for c in control if c.lasting_collapse]
    rows = []
    for label, skipped in (("all", []), (f"without seed {', '.join(map(str, collapsed))}", collapsed)):
        pairs = [(c.last3_em, t.last3_em) for c, t in zip(control, treated) if c.seed not in skipped]
        control_em, treated_em = (np.array(column) for column in zip(*pairs))
        d = treated_em - control_em
        sd = float(d.std(ddof=1))
        needed = next(n for n in itertools.count(2) if _mde(sd, n) <= TARGET_MDE)
        rows.append([f"{len(d)}, {label}", f"{control_em.std(ddof=1):.3f}", f"{treated_em.std(ddof=1):.3f}",
                     f"{np.corrcoef(control_em, treated_em)[0, 1]:.3f}", f"{sd:.3f}", _paired_cell(d),
                     f"{_mde(sd, len(d)):.3f}", str(needed)])
    lines = ["good-learning-rate study: the primary endpoint's spread against the registration's assumption (not "
             "pre-registered)", ""]
    lines += report.markdown_table(
        ["seeds", *(f"{name}: sd of the last-3 EM" for name in GOOD_LR_ARMS), "correlation of the arms across seeds",
         "sd of the paired differences", "llds minus grpo: mean [95% t interval] (higher / lower)",
         "MDE at that sd", f"paired seeds for an MDE of {TARGET_MDE} at that sd"], rows)
    return lines


def _trained_per_trajectory(result, first: int, last: int) -> float:
    """A run's trained tokens (its loss masks': each step's tokens per second times its seconds, a count) per
    trajectory trained, over steps first-last (inclusive)."""
    span = range(first, last + 1)
    seconds, rates, trajectories = (dict(zip(*result.curves[m])) for m in (STEP_S, TOKENS_PER_S, TRAJECTORIES))
    return sum(round(rates[s] * seconds[s]) for s in span) / sum(trajectories[s] for s in span)


def partial_study() -> list[str]:
    """Issue 59's comparison (not pre-registered): per seed each arm's trained tokens per trajectory in steps 1-5,
    and in step 1 (no carried conversation yet), mean rollout seconds (steps 2 on), searches sent and final EM; the
    paired differences of the trained tokens per trajectory, and the rollout seconds without the seeds whose partial
    run sent no search (seed 1)."""
    control, treated = _paired_arms(load("partial_study"), PARTIAL_ARMS, "partial_study")
    searchless = [t.seed for t in treated if not sum(t.curves[SEARCHES][1])]
    first, last = EARLY
    total = max(control[0].curves[STEP_S][0])
    rows = [[str(c.seed), *(f"{_trained_per_trajectory(r, first, last):.1f}" for r in (c, t)),
             *(f"{_trained_per_trajectory(r, first, first):.1f}" for r in (c, t)),
             *(f"{r.rollout_s:.3f}" for r in (c, t)), f"{t.rollout_s / c.rollout_s:.2f}",
             *(f"{sum(r.curves[SEARCHES][1]):,.0f}" for r in (c, t)), *(f"{r.final_em:.3f}" for r in (c, t))]
            for c, t in zip(control, treated)]
    lines = ["synchronous vs partial comparison, per seed (not pre-registered)", ""]
    lines += report.markdown_table(
        ["seed", *(f"{name}: trained tokens per trajectory, steps {first}-{last}" for name in PARTIAL_ARMS),
         *(f"{name}: trained tokens per trajectory, step {first}" for name in PARTIAL_ARMS),
         *(f"{name}: rollout seconds per step" for name in PARTIAL_ARMS),
         f"rollout seconds, {PARTIAL_ARMS[1]} / {PARTIAL_ARMS[0]}",
         *(f"{name}: searches sent, {total} steps" for name in PARTIAL_ARMS),
         *(f"{name}: final EM" for name in PARTIAL_ARMS)], rows)
    differences = (  # (endpoint, its value of a run, the seeds left out)
        (f"trained tokens per trajectory, steps {first}-{last}", lambda r: _trained_per_trajectory(r, first, last), []),
        (f"trained tokens per trajectory, step {first}", lambda r: _trained_per_trajectory(r, first, first), []),
        (f"trained tokens per trajectory, steps {last + 1}-{total}",
         lambda r: _trained_per_trajectory(r, last + 1, total), []),
        (f"rollout seconds per step, without seed {', '.join(map(str, searchless))}", lambda r: r.rollout_s,
         searchless))
    rows = []
    for label, value, skipped in differences:
        d = np.array([value(t) - value(c) for c, t in zip(control, treated) if c.seed not in skipped])
        rows.append([label, str(len(d)), _paired_cell(d), f"{stats.sign_flip_p(d):.4f}"])
    lines += ["", f"{PARTIAL_ARMS[1]} minus {PARTIAL_ARMS[0]} on the same seeds (not pre-registered):", ""]
    lines += report.markdown_table(
        ["endpoint", "seeds", "mean [95% t interval] (higher / lower)", "exact sign-flip p, two-sided"], rows)
    ratios = [np.mean([getattr(t, m) for t in treated]) / np.mean([getattr(c, m) for c in control])
              for m in ("tokens_per_s", "rollout_s", "step_s")]
    lines += ["", f"- {PARTIAL_ARMS[1]} / {PARTIAL_ARMS[0]}, means over seeds: trained tokens per second, rollout "
                  "seconds, seconds per step: " + " ".join(f"{ratio:.3f}" for ratio in ratios)]
    return lines


def _power(sd: float, n: int, effect: float) -> float:
    """Monte Carlo power of the two-sided paired t test at 0.05 with n differences of this sd, against `effect`."""
    draws = np.random.default_rng(0).normal(effect, sd, size=(POWER_DRAWS, n))
    t = draws.mean(axis=1) / (draws.std(axis=1, ddof=1) / np.sqrt(n))
    return float(np.mean(np.abs(t) > stats.t_quantile(0.95, n - 1)))


def trees() -> list[str]:
    results = load("tree_study")
    em = {(r.arm, r.seed): dict(zip(*r.curves[EVAL_EM])) for r in results}
    seeds = sorted({r.seed for r in results})
    evaluations = sorted(s for s in em[("llds", seeds[0])] if s > 0)
    lines = ["tree study (not pre-registered)", "", "mean greedy EM of each arm at each evaluation:", ""]
    names = ("llds", *TREE_ARMS)
    lines += report.markdown_table(["step", *names], [
        [str(step)] + [f"{np.mean([em[(name, s)][step] for s in seeds]):.3f}" for name in names]
        for step in evaluations])
    lines += ["", "paired differences minus llds: mean [95% t interval] (seeds higher / lower):", ""]
    rows = []
    for step in evaluations:
        cells = [str(step)]
        for name in TREE_ARMS:
            cells.append(_paired_cell(np.array([em[(name, s)][step] - em[("llds", s)][step] for s in seeds])))
        rows.append(cells)
    lines += report.markdown_table(["step", *(f"{name} minus llds" for name in TREE_ARMS)], rows)
    final = {(r.arm, r.seed): r.final_em for r in results}
    d = np.array([final[("llds_trees_wide", s)] - final[("llds", s)] for s in seeds])
    sd = d.std(ddof=1)
    step_s = {name: np.mean([r.step_s for r in results if r.arm == name]) for name in names}
    lines += ["", f"- llds_trees_wide minus llds, final EM: sd of the paired differences {sd:.4f}; power of the paired "
                  f"t test at 0.05 against a true difference of {MARGIN}: {_power(sd, len(seeds), MARGIN):.2f}, "
                  f"against the observed {d.mean():+.4f}: {_power(sd, len(seeds), d.mean()):.2f}",
              "- seconds per step over the chains': " + ", ".join(
                  f"{name} {step_s[name] / step_s['llds']:.3f}" for name in TREE_ARMS)]
    return lines


def main() -> int:
    print("\n".join(late_collapse() + [""] + trees() + [""] + long_horizon_calibration() + [""] + good_lr_design()
                    + [""] + good_lr_study() + [""] + good_lr_spread() + [""] + partial_study()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
