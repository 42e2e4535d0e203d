"""The order of events in a run (issue 40's calibration): does it learn first, and does the likelihood of its correct
trajectories fall before its reward does, as in the paper's death spiral (reward rises, then the correct responses'
likelihood sinks, then the reward collapses)?

Per run, on 3-step trailing means (llds_jax.apps.study.auc.trailing_mean) of its logged values:
- peak: the highest trailing train reward, and its step (the first such);
- halved: the first step after the peak at which the trailing reward is below half the peak;
- likelihood fell: the first step after the peak at which the trailing token-mean log-prob of the correct
  trajectories is below LIKELIHOOD_DROP (the threshold of issue 40's reading; a run with no correct trajectory for
  3 steps has no value there, which does not count as a fall);
- collapse: the study's collapse step (llds_jax.apps.study.stats);
- order: "likelihood first" when the likelihood fell before the reward halved, "reward first" when after or
  never, "same step", or "—" when the reward never halved.
A run *learned* when its peak is at least LEARNED.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

from llds_jax.train import report
from llds_jax.apps.study.auc import trailing_mean
from llds_jax.apps.study.outcomes import LIKELIHOOD, REWARD, RunResult

LIKELIHOOD_DROP = -0.15
LEARNED = 0.7


@dataclasses.dataclass(frozen=True)
class Events:
    """One run's events (steps; None: never)."""
    setting: str
    arm: str
    seed: int
    peak: float
    peak_step: int
    halved_step: int | None
    likelihood_step: int | None
    collapse_step: int | None

    @property
    def learned(self) -> bool:
        return self.peak >= LEARNED

    @property
    def order(self) -> str:
        if self.halved_step is None:
            return "—"
        if self.likelihood_step is None or self.likelihood_step > self.halved_step:
            return "reward first"
        return "likelihood first" if self.likelihood_step < self.halved_step else "same step"


def _first_after(steps: Sequence[int], values: Sequence[float], after: int, holds) -> int | None:
    for step in steps:
        if step > after:
            mean = trailing_mean(steps, values, step)
            if mean is not None and holds(mean):
                return step
    return None


def of(result: RunResult) -> Events | None:
    """The events of one run (None without reward curves)."""
    steps, rewards = result.curves[REWARD]
    if not steps:
        return None
    trailing = [(trailing_mean(steps, rewards, step), step) for step in steps]
    peak, peak_step = max(trailing, key=lambda t: (t[0], -t[1]))
    halved = _first_after(steps, rewards, peak_step, lambda mean: mean < peak / 2)
    fell = _first_after(*result.curves[LIKELIHOOD], peak_step, lambda mean: mean < LIKELIHOOD_DROP)
    return Events(result.setting, result.arm, result.seed, peak, peak_step, halved, fell, result.collapse_step)


def _step(value: int | None) -> str:
    return "—" if value is None else str(value)


def markdown(results: Sequence[RunResult]) -> list[str]:
    """The table, one row per run with curves, then per setting and arm a count line."""
    found = [s for s in map(of, results) if s is not None]
    lines = report.markdown_table(
        ["setting", "arm", "seed", "peak reward (3-step mean) at step", "reward halved at", "likelihood fell at",
         "collapse step", "order"],
        [[s.setting, s.arm, str(s.seed), f"{s.peak:.2f} at {s.peak_step}", _step(s.halved_step),
          _step(s.likelihood_step), _step(s.collapse_step), s.order] for s in found])
    lines.append("")
    for setting, arm in dict.fromkeys((s.setting, s.arm) for s in found):
        runs = [s for s in found if (s.setting, s.arm) == (setting, arm)]
        learned = [s for s in runs if s.learned]
        lines.append(f"- {setting} / {arm}: learned (peak >= {LEARNED}) in {len(learned)} of {len(runs)} runs; of "
                     f"those, collapsed {sum(s.collapse_step is not None for s in learned)}, likelihood first "
                     f"{sum(s.order == 'likelihood first' for s in learned)}")
    return lines + ["", f"3-step trailing means; the likelihood fell when the correct trajectories' token-mean log-prob "
                        f"went below {LIKELIHOOD_DROP} after the peak (llds_jax/apps/study/sequence.py)."]


def write(results: Sequence[RunResult], out: str) -> list[str]:
    """Writes sequence.md into `out`; returns its path."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "sequence.md")
    with open(path, "w") as f:
        f.write("\n".join(markdown(results)) + "\n")
    return [path]
