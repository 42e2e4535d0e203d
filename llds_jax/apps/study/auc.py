"""Early warning judged by step-matched AUC (issue 40): how well does a per-step diagnostic, a few steps before a run
collapses, tell that run apart from the runs that never collapse, read at the same step?

For a signal (a metric of llds_jax.apps.study.outcomes.CURVES, with the direction in which it warns) and a lead h:
- a run's *score* at step s is the mean of its logged values at steps s - TRAILING_STEPS + 1 ... s (a step without
  a value, e.g. an LLD rate on a step with no correct trajectory, is skipped; no value at all: no score), times the
  direction (+1: higher warns, -1: lower warns);
- each run with a collapse step c (llds_jax.apps.study.stats; c - h >= 1) gives a *positive* score at c - h, and is
  paired with every run of the same setting that did not collapse, scored at the same step c - h (a *negative*);
  a run that collapsed by its final EM alone has no step and is in neither;
- AUC = the share of pairs whose positive score is above the negative one, ties counted 1/2 (Mann-Whitney): 1 is a
  perfect warning, 0.5 no better than chance.
"Pooled" takes the pairs of every lead of LEADS together. Runs are not independent: the arms of one seed share its
world, warm start and first batch, and often collapse in lockstep. So the interval resamples *seeds*: a seed drawn
k times weighs each of its runs k times, and a pair weighs the product of its two runs' weights (a 95% percentile
interval over BOOTSTRAP_RESAMPLES draws, numpy's default_rng(BOOTSTRAP_SEED)). The same draws give the interval of
each signal's pooled AUC minus each baseline's: the reward drop and the KL to the reference, which any monitor
already has.
"""
from __future__ import annotations

import csv
import dataclasses
import json
import os
from collections.abc import Sequence

import numpy as np

from llds_jax.train import report
from llds_jax.apps.study import stats
from llds_jax.apps.study.outcomes import DELTA_TRAJ, GRAD_NORM, LIKELIHOOD, LLD_RATE, REF_KL, REWARD, RunResult

TRAILING_STEPS = 3
LEADS = (3, 4, 5)
# signal -> (direction: +1 when a high value warns, -1 when a low one does; words)
SIGNALS: dict[str, tuple[int, str]] = {
    LLD_RATE: (1, "LLD rate, high"),
    DELTA_TRAJ: (-1, "Delta_traj of correct trajectories, low"),
    LIKELIHOOD: (-1, "token-mean log-prob of correct trajectories, low"),
    GRAD_NORM: (1, "grad norm, high"),
    REWARD: (-1, "train reward, low (baseline)"),
    REF_KL: (1, "k3 KL to the reference, high (baseline)"),
}
BASELINES = (REWARD, REF_KL)


def trailing_mean(steps: Sequence[int], values: Sequence[float], at: int) -> float | None:
    """Mean of the values logged at steps at - TRAILING_STEPS + 1 ... at (None when there is none)."""
    window = [v for s, v in zip(steps, values) if at - TRAILING_STEPS < s <= at]
    return float(np.mean(window)) if window else None


@dataclasses.dataclass(frozen=True)
class Pairs:
    """The step-matched pairs of one signal in one setting: for pair i, the seeds of its positive and negative runs
    and their direction-signed scores (arrays of [P])."""
    positive_seed_p: np.ndarray
    negative_seed_p: np.ndarray
    positive_p: np.ndarray
    negative_p: np.ndarray

    @staticmethod
    def concat(parts: Sequence["Pairs"]) -> "Pairs":
        return Pairs(*(np.concatenate([getattr(p, f.name) for p in parts]) for f in dataclasses.fields(Pairs)))

    def wins(self) -> np.ndarray:
        """[P] 1 where the positive score is above the negative one, 1/2 on a tie, else 0."""
        return (self.positive_p > self.negative_p) + 0.5 * (self.positive_p == self.negative_p)

    def auc(self) -> float | None:
        """The share of pairs won (None without pairs)."""
        return float(self.wins().mean()) if self.positive_p.size else None

    def resampled_auc(self, seeds: Sequence[int], counts_bn: np.ndarray) -> np.ndarray:
        """[B] the AUC under each of B seed resamples: counts_bn[b, i] is how often draw b took seeds[i]; a pair
        weighs the product of its two seeds' counts (NaN for a draw that leaves no pair any weight)."""
        index = {seed: i for i, seed in enumerate(seeds)}
        weight_bp = (counts_bn[:, [index[int(s)] for s in self.positive_seed_p]] *
                     counts_bn[:, [index[int(s)] for s in self.negative_seed_p]])
        total_b = weight_bp.sum(axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(total_b > 0, weight_bp @ self.wins() / total_b, np.nan)


def matched_pairs(results: Sequence[RunResult], signal: str, lead: int) -> Pairs:
    """The pairs of `signal` at `lead` steps before each collapse, over `results` (one setting's runs)."""
    direction = SIGNALS[signal][0]
    negatives = [r for r in results if not r.collapsed]
    columns: list[list[float]] = [[], [], [], []]
    for positive in results:
        if positive.collapse_step is None or positive.collapse_step - lead < 1:
            continue
        at = positive.collapse_step - lead
        score = trailing_mean(*positive.curves[signal], at)
        if score is None:
            continue
        for negative in negatives:
            other = trailing_mean(*negative.curves[signal], at)
            if other is not None:
                for column, value in zip(columns, (positive.seed, negative.seed, direction * score,
                                                   direction * other)):
                    column.append(value)
    return Pairs(np.array(columns[0], dtype=np.int64), np.array(columns[1], dtype=np.int64),
                 np.array(columns[2], dtype=np.float64), np.array(columns[3], dtype=np.float64))


@dataclasses.dataclass(frozen=True)
class Row:
    """A signal's AUCs in one setting: per lead of LEADS (None without pairs), pooled over them with its seed
    bootstrap interval, and pooled minus each baseline's pooled AUC (BASELINES order) with intervals from the same
    draws; `pairs` per lead; `seeds`: how many seeds the setting's runs have."""
    setting: str
    signal: str
    by_lead: list[float | None]
    pairs: list[int]
    pooled: float | None
    low: float | None
    high: float | None
    minus_baseline: list[float | None]
    minus_low: list[float | None]
    minus_high: list[float | None]
    seeds: int


def _interval(values_b: np.ndarray) -> tuple[float | None, float | None]:
    """95% percentile interval of the finite values of `values_b` (None, None when there is none)."""
    kept = values_b[np.isfinite(values_b)]
    if not kept.size:
        return None, None
    low, high = np.quantile(kept, [0.025, 0.975])
    return float(low), float(high)


def rows(results: Sequence[RunResult], resamples: int = stats.BOOTSTRAP_RESAMPLES,
         seed: int = stats.BOOTSTRAP_SEED) -> list[Row]:
    """Per setting (order of appearance) and signal (SIGNALS order) of the runs with curves."""
    found = []
    for setting in dict.fromkeys(r.setting for r in results):
        runs = [r for r in results if r.setting == setting and r.has_curves]
        seeds = sorted({r.seed for r in runs})
        draws_bn = np.random.default_rng(seed).integers(0, max(len(seeds), 1), size=(resamples, len(seeds)))
        counts_bn = np.stack([np.bincount(d, minlength=len(seeds)) for d in draws_bn]).astype(np.float64)
        by_lead = {signal: [matched_pairs(runs, signal, lead) for lead in LEADS] for signal in SIGNALS}
        pooled = {signal: Pairs.concat(parts) for signal, parts in by_lead.items()}
        boot_b = {signal: pairs.resampled_auc(seeds, counts_bn) for signal, pairs in pooled.items()}
        for signal in SIGNALS:
            point = pooled[signal].auc()
            minus = [None if point is None or pooled[base].auc() is None else point - pooled[base].auc()
                     for base in BASELINES]
            intervals = [_interval(boot_b[signal] - boot_b[base]) for base in BASELINES]
            found.append(Row(setting, signal, [p.auc() for p in by_lead[signal]],
                             [len(p.positive_p) for p in by_lead[signal]], point, *_interval(boot_b[signal]),
                             minus, [i[0] for i in intervals], [i[1] for i in intervals], len(seeds)))
    return found


def _number(value: float | None, signed: bool = False) -> str:
    return "—" if value is None else (f"{value:+.2f}" if signed else f"{value:.2f}")


def _bracket(low: float | None, high: float | None, signed: bool = False) -> str:
    return "" if low is None else f" [{_number(low, signed)}, {_number(high, signed)}]"


def markdown(found: Sequence[Row]) -> list[str]:
    """The AUC table as markdown lines, then how it is computed."""
    header = ["setting", "signal", *(f"AUC {lead} steps before" for lead in LEADS), "pairs per lead",
              "pooled AUC [95% CI, seeds resampled]",
              *(f"minus {SIGNALS[base][1].split(',')[0]} [95% CI]" for base in BASELINES)]
    lines = report.markdown_table(header, [
        [r.setting, SIGNALS[r.signal][1], *(_number(a) for a in r.by_lead), " / ".join(map(str, r.pairs)),
         _number(r.pooled) + _bracket(r.low, r.high),
         *(_number(m, True) + _bracket(lo, hi, True) if base != r.signal else "—"
           for base, m, lo, hi in zip(BASELINES, r.minus_baseline, r.minus_low, r.minus_high))]
        for r in found])
    seeds = sorted({r.seeds for r in found})
    return lines + ["", f"Each collapsed run's {TRAILING_STEPS}-step trailing mean {', '.join(map(str, LEADS))} steps "
                        f"before its collapse step against every non-collapsed run of its setting at the same step "
                        f"(ties 1/2); intervals resample the {'/'.join(map(str, seeds))} seeds, not the runs "
                        f"(llds_jax/apps/study/auc.py)."]


def write(results: Sequence[RunResult], out: str) -> list[str]:
    """Writes auc.md, auc.csv (one row per setting, signal and lead, and the pooled one) and auc.json into `out`;
    returns their paths."""
    os.makedirs(out, exist_ok=True)
    found = rows(results)
    paths = [os.path.join(out, f"auc.{ext}") for ext in ("md", "csv", "json")]
    with open(paths[0], "w") as f:
        f.write("\n".join(markdown(found)) + "\n")
    with open(paths[1], "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["setting", "signal", "lead", "pairs", "auc", "low", "high"])
        for r in found:
            for lead, pairs, value in zip(LEADS, r.pairs, r.by_lead):
                writer.writerow([r.setting, r.signal, lead, pairs, "" if value is None else value, "", ""])
            writer.writerow([r.setting, r.signal, "pooled", sum(r.pairs), *("" if v is None else v
                                                                           for v in (r.pooled, r.low, r.high))])
    with open(paths[2], "w") as f:
        json.dump({"trailing_steps": TRAILING_STEPS, "leads": list(LEADS), "baselines": list(BASELINES),
                   "signals": {s: {"direction": d, "words": w} for s, (d, w) in SIGNALS.items()},
                   "rows": [dataclasses.asdict(r) for r in found]}, f, indent=2)
    return paths
