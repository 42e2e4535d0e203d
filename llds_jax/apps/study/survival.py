"""Time to collapse with censoring (issue 40): a run that has not collapsed by its last step is *censored* there,
not given a made-up collapse step.

A run's time (llds_jax.apps.study.stats for collapse): its collapse step when it has one (an event); its last step
when it collapsed by its final greedy EM alone (an event at the final evaluation: the reward rule never fired, so
the step is unknown, and it is written as such); else its last step, censored (`T+`: no collapse in T steps).

Per arm: the Kaplan-Meier estimate of the share of runs not yet collapsed after each step, and its median time to
collapse (the first step at which that share is <= 1/2; "not reached" when it stays above).

Paired, each arm against each control on the same seeds (the primary test of issue 40's registration): per seed,
the arm *lasted longer* when its time is later, or when the control collapsed and the arm was censored; *shorter*
the other way; a *tie* when both are censored or both collapsed at the same step. The exact two-sided sign test of
longer vs shorter over the untied seeds (`stats.sign_flip_p` of +1/-1 differences, which is that binomial test),
Holm-adjusted over every comparison of the table. With 8 seeds the smallest p is 2/2^8 = 0.0078.
"""
from __future__ import annotations

import csv
import dataclasses
import json
import os
from collections.abc import Mapping, Sequence

from llds_jax.train import report
from llds_jax.apps.study import paired, stats
from llds_jax.apps.study.outcomes import RunResult


@dataclasses.dataclass(frozen=True)
class Time:
    """A run's time to collapse: `step`, and whether it collapsed there (`event`) or was censored (`event` False:
    no collapse in `step` steps). `by_final_em`: an event known from the final evaluation alone."""
    step: int
    event: bool
    by_final_em: bool = False

    def __str__(self) -> str:
        return f"{self.step}{'' if self.event else '+'}{' by final EM' if self.by_final_em else ''}"


def time_of(result: RunResult, total_steps: int) -> Time:
    """The time of one run whose last step is `total_steps`."""
    if result.collapse_step is not None:
        return Time(result.collapse_step, True)
    return Time(total_steps, result.collapsed, by_final_em=result.collapsed)


def kaplan_meier(times: Sequence[Time]) -> list[tuple[int, float]]:
    """(step, share not collapsed after it) at each step with an event, ascending."""
    curve, share = [], 1.0
    for step in sorted({t.step for t in times if t.event}):
        at_risk = sum(t.step >= step for t in times)
        events = sum(t.step == step and t.event for t in times)
        share *= 1 - events / at_risk
        curve.append((step, share))
    return curve


def median_time(times: Sequence[Time]) -> int | None:
    """The Kaplan-Meier median: the first step at which the share not collapsed is <= 1/2 (None: not reached)."""
    return next((step for step, share in kaplan_meier(times) if share <= 0.5), None)


def longer(arm: Time, control: Time) -> int:
    """+1 when `arm` lasted longer than `control`, -1 when shorter, 0 for a tie (both censored, or both collapsed
    at the same step). Both runs share their horizon (same setting)."""
    if not arm.event and not control.event:
        return 0
    if not arm.event or not control.event:
        return 1 if not arm.event else -1
    return (arm.step > control.step) - (arm.step < control.step)


@dataclasses.dataclass(frozen=True)
class ArmRow:
    """One arm's times in one setting: per seed (ascending), events, and the Kaplan-Meier median."""
    setting: str
    arm: str
    seeds: list[int]
    times: list[str]
    events: int
    median: int | None
    horizon: int


@dataclasses.dataclass(frozen=True)
class PairedRow:
    """`arm` against `control` on `seeds` (both ran): seeds where the arm lasted longer, shorter, tied; the exact
    sign-test p over the untied ones (1.0 when every seed ties) and its Holm adjustment."""
    setting: str
    arm: str
    control: str
    seeds: list[int]
    longer: int
    shorter: int
    ties: int
    p: float
    holm_p: float


def _times(results: Sequence[RunResult], total_steps: Mapping[str, int], setting: str, arm: str) -> dict[int, Time]:
    return {r.seed: time_of(r, total_steps[r.name]) for r in results if r.setting == setting and r.arm == arm}


def tables(results: Sequence[RunResult], total_steps: Mapping[str, int],
           controls: Sequence[str] | None = None) -> tuple[list[ArmRow], list[PairedRow]]:
    """Every arm's row, then every (arm, control) comparison (llds_jax.apps.study.paired.pairs) with the Holm
    adjustment over all of them. `total_steps`: run name -> its last step; `controls` None: paired's default."""
    controls = paired.default_controls(results) if controls is None else list(controls)
    arm_rows, found = [], []
    for setting in dict.fromkeys(r.setting for r in results):
        arms = list(dict.fromkeys(r.arm for r in results if r.setting == setting))
        for arm in arms:
            times = _times(results, total_steps, setting, arm)
            seeds = sorted(times)
            arm_rows.append(ArmRow(setting, arm, seeds, [str(times[s]) for s in seeds],
                                   sum(t.event for t in times.values()), median_time(list(times.values())),
                                   max(t.step for t in times.values())))
        for arm, control in paired.pairs(arms, controls):
            a, c = _times(results, total_steps, setting, arm), _times(results, total_steps, setting, control)
            seeds = sorted(set(a) & set(c))
            if not seeds:
                continue
            signs = [longer(a[s], c[s]) for s in seeds]
            decided = [float(x) for x in signs if x]
            p = stats.sign_flip_p(decided) if decided else 1.0
            found.append(PairedRow(setting, arm, control, seeds, signs.count(1), signs.count(-1), signs.count(0),
                                   p, p))
    adjusted = stats.holm([r.p for r in found]) if found else []
    return arm_rows, [dataclasses.replace(r, holm_p=p) for r, p in zip(found, adjusted)]


def markdown(arm_rows: Sequence[ArmRow], paired_rows: Sequence[PairedRow]) -> list[str]:
    """Both tables as markdown lines."""
    lines = report.markdown_table(
        ["setting", "arm", "seeds", "time to collapse per seed (T+: none in T steps)", "collapsed",
         "median time to collapse (Kaplan-Meier)"],
        [[r.setting, r.arm, str(len(r.seeds)), " ".join(f"{t} (seed {s})" for s, t in zip(r.seeds, r.times)),
          f"{r.events}/{len(r.seeds)}", "not reached" if r.median is None else str(r.median)] for r in arm_rows])
    lines += ["", *report.markdown_table(
        ["setting", "arm", "control", "seeds", "arm lasted longer", "shorter", "tied", "exact sign p", "Holm p"],
        [[r.setting, r.arm, r.control, str(len(r.seeds)), str(r.longer), str(r.shorter), str(r.ties),
          f"{r.p:.4f}", f"{r.holm_p:.4f}"] for r in paired_rows])]
    return lines + ["", "A run without a collapse is censored at its last step; a collapse known from the final EM "
                        "alone is an event at the last step (llds_jax/apps/study/survival.py)."]


def write(results: Sequence[RunResult], total_steps: Mapping[str, int], out: str,
          controls: Sequence[str] | None = None) -> list[str]:
    """Writes survival.md, survival.csv (one row per run: setting, arm, seed, step, event, by_final_em) and
    survival.json (both tables) into `out`; returns their paths."""
    os.makedirs(out, exist_ok=True)
    arm_rows, paired_rows = tables(results, total_steps, controls)
    paths = [os.path.join(out, f"survival.{ext}") for ext in ("md", "csv", "json")]
    with open(paths[0], "w") as f:
        f.write("\n".join(markdown(arm_rows, paired_rows)) + "\n")
    with open(paths[1], "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["setting", "arm", "seed", "step", "event", "by_final_em"])
        for r in results:
            t = time_of(r, total_steps[r.name])
            writer.writerow([r.setting, r.arm, r.seed, t.step, t.event, t.by_final_em])
    with open(paths[2], "w") as f:
        json.dump({"arms": [dataclasses.asdict(r) for r in arm_rows],
                   "paired": [dataclasses.asdict(r) for r in paired_rows]}, f, indent=2)
    return paths
