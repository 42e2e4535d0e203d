"""LLD as an early warning of collapse: does a signal cross a fixed threshold at least LEAD_STEPS steps before a run
collapses, and how often does it cross in runs that never collapse (issue 33's lead-lag test)?

The rules were fixed before the collapse-regime study ran (docs/evidence.md, "Pre-registration"); they are
sign and ratio thresholds with a meaning of their own, not values tuned on runs:
- `lld/rate` >= 0.5: at least half of the step's correct trajectories lost log-likelihood over its updates;
- `lld/delta_traj_correct` < 0: the correct trajectories' summed log-likelihood fell on average;
- `actor/grad_norm` >= 2x the median of the run's first BASELINE_STEPS logged values.
A signal *warns* at the first step where its rule holds on WARN_STEPS consecutive logged values (a step without a
value, e.g. an LLD rate on a step with no correct trajectory, is skipped, not a break).

Per run (collapse step from llds_jax.apps.study.stats; a run that collapsed by its final EM alone has no step and is
left out): a collapsed run whose signal warned at least LEAD_STEPS steps before the collapse step is *caught*, else
*missed*; a run that did not collapse and warned is a *false alarm*, else *quiet*. Precision = caught / (caught +
false alarms), recall = caught / (caught + missed); both None when their denominator is 0.
"""
from __future__ import annotations

import csv
import dataclasses
import json
import os
from collections.abc import Callable, Sequence

import numpy as np

from llds_jax.train import report
from llds_jax.apps.study.outcomes import DELTA_TRAJ, GRAD_NORM, LLD_RATE, RunResult

WARN_STEPS = 2       # consecutive logged values on which a rule must hold
LEAD_STEPS = 2       # a warning counts when it comes at least this many steps before the collapse step
BASELINE_STEPS = 5   # the gradient-norm rule's baseline: median of the run's first this many logged values
GRAD_NORM_FACTOR = 2.0

Rule = Callable[[np.ndarray], np.ndarray]  # [S] a run's logged values -> [S] bool: the rule holds at each


def _lld_rate_rule(values_s: np.ndarray) -> np.ndarray:
    return values_s >= 0.5


def _delta_traj_rule(values_s: np.ndarray) -> np.ndarray:
    return values_s < 0


def _grad_norm_rule(values_s: np.ndarray) -> np.ndarray:
    baseline = np.median(values_s[:BASELINE_STEPS]) if values_s.size else 0.0
    return values_s >= GRAD_NORM_FACTOR * baseline


# signal (a metric of outcomes.CURVES) -> (its rule, the rule in words)
SIGNALS: dict[str, tuple[Rule, str]] = {
    LLD_RATE: (_lld_rate_rule, "LLD rate >= 0.5"),
    DELTA_TRAJ: (_delta_traj_rule, "mean Delta_traj of correct trajectories < 0"),
    GRAD_NORM: (_grad_norm_rule, f"grad norm >= {GRAD_NORM_FACTOR:g}x its median over the first {BASELINE_STEPS} "
                                 f"steps"),
}


def warning_step(steps: Sequence[int], values: Sequence[float], rule: Rule) -> int | None:
    """The step at which `rule` first holds on WARN_STEPS consecutive values (the step of the last of them), or
    None. `steps` ascending, one value each."""
    holds_s = rule(np.asarray(values, dtype=np.float64))
    run = 0
    for step, holds in zip(steps, holds_s):
        run = run + 1 if holds else 0
        if run >= WARN_STEPS:
            return int(step)
    return None


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One run's reading for one signal: `kind` is "caught", "missed", "false alarm" or "quiet"; `lead` the steps
    from the warning to the collapse (caught runs only)."""
    run: str
    signal: str
    warned_at: int | None
    collapse_step: int | None
    kind: str
    lead: int | None


def classify(result: RunResult, signal: str) -> Outcome | None:
    """The reading of `result` for `signal` (None for a run that collapsed without a collapse step)."""
    if result.collapsed and result.collapse_step is None:
        return None
    warned = warning_step(*result.curves[signal], SIGNALS[signal][0])
    if result.collapse_step is None:
        return Outcome(result.name, signal, warned, None, "quiet" if warned is None else "false alarm", None)
    lead = None if warned is None else result.collapse_step - warned
    caught = lead is not None and lead >= LEAD_STEPS
    return Outcome(result.name, signal, warned, result.collapse_step, "caught" if caught else "missed",
                   lead if caught else None)


@dataclasses.dataclass(frozen=True)
class Summary:
    """A signal's readings over a set of runs, counted by kind, with precision, recall and the median lead of the
    caught runs (None where undefined)."""
    scope: str
    signal: str
    runs: int
    caught: int
    missed: int
    false_alarms: int
    quiet: int
    precision: float | None
    recall: float | None
    median_lead: float | None


def summarize(results: Sequence[RunResult], scope: str, signal: str) -> Summary:
    """The readings of every run of `results` that has a collapse step or did not collapse."""
    found = [o for o in (classify(r, signal) for r in results) if o is not None]
    count = {kind: sum(o.kind == kind for o in found) for kind in ("caught", "missed", "false alarm", "quiet")}
    leads = [o.lead for o in found if o.lead is not None]
    return Summary(scope, signal, len(found), count["caught"], count["missed"], count["false alarm"],
                   count["quiet"], _share(count["caught"], count["caught"] + count["false alarm"]),
                   _share(count["caught"], count["caught"] + count["missed"]),
                   float(np.median(leads)) if leads else None)


def _share(part: int, whole: int) -> float | None:
    return part / whole if whole else None


def summaries(results: Sequence[RunResult]) -> list[Summary]:
    """Per setting (every arm's runs together) and per signal, then over all settings."""
    settings = list(dict.fromkeys(r.setting for r in results))
    scopes = [(s, [r for r in results if r.setting == s]) for s in settings]
    if len(settings) > 1:
        scopes.append(("all settings", list(results)))
    return [summarize(runs, scope, signal) for scope, runs in scopes for signal in SIGNALS]


def _number(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def markdown(found: Sequence[Summary]) -> list[str]:
    """The lead-lag table as markdown lines, then the rules."""
    lines = report.markdown_table(
        ["scope", "signal (rule)", "runs", "caught", "missed", "false alarms", "quiet", "precision", "recall",
         "median lead (steps)"],
        [[s.scope, f"{s.signal} ({SIGNALS[s.signal][1]})", str(s.runs), str(s.caught), str(s.missed),
          str(s.false_alarms), str(s.quiet), _number(s.precision), _number(s.recall), _number(s.median_lead)]
         for s in found])
    return lines + ["", f"A signal warns when its rule holds on {WARN_STEPS} consecutive logged steps; a collapsed run "
                        f"is caught when the warning comes at least {LEAD_STEPS} steps before its collapse step "
                        f"(llds_jax/apps/study/early_warning.py)."]


def write(results: Sequence[RunResult], out: str) -> list[str]:
    """Writes early_warning.md, early_warning.csv (one row per run and signal) and early_warning.json (the
    summaries and the rules) into `out`; returns their paths."""
    os.makedirs(out, exist_ok=True)
    found = summaries(results)
    paths = [os.path.join(out, f"early_warning.{ext}") for ext in ("md", "csv", "json")]
    with open(paths[0], "w") as f:
        f.write("\n".join(markdown(found)) + "\n")
    with open(paths[1], "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["run", "signal", "warned_at", "collapse_step", "kind", "lead"])
        for outcome in (classify(r, signal) for r in results for signal in SIGNALS):
            if outcome is not None:
                writer.writerow(["" if v is None else v for v in dataclasses.astuple(outcome)])
    with open(paths[2], "w") as f:
        json.dump({"rules": {signal: words for signal, (_, words) in SIGNALS.items()}, "warn_steps": WARN_STEPS,
                   "lead_steps": LEAD_STEPS, "summaries": [dataclasses.asdict(s) for s in found]}, f, indent=2)
    return paths
