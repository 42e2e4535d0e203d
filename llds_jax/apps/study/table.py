"""The study's tables: one row per setting x arm over its seeds, written as `table.md`, `table.csv` and `table.json`
(which also holds every run's own numbers, as does `runs.csv`, which `read_runs` reads back); and the paired table
(llds_jax.apps.study.paired: each arm minus each control on the same seeds), `paired.md`, `paired.csv`,
`paired.json`."""
from __future__ import annotations

import csv
import dataclasses
import json
import os
from collections.abc import Mapping, Sequence

import numpy as np

from llds_jax.train import report
from llds_jax.apps.study import paired, stats
from llds_jax.apps.study.outcomes import CURVES, LLD_RATE, REWARD, RunResult
from llds_jax.apps.study.plan import ARMS, StudyError

DEFINITIONS = {
    "final_em": "greedy test EM (mean over data sources) of the final evaluation after the last step",
    "em_interval": f"95% percentile bootstrap interval of the mean final EM over seeds "
                   f"({stats.BOOTSTRAP_RESAMPLES} resamples, numpy default_rng({stats.BOOTSTRAP_SEED}))",
    "collapsed": f"train {REWARD} < {stats.COLLAPSE_REWARD} on {stats.COLLAPSE_STEPS} consecutive steps, or final "
                 f"EM < {stats.COLLAPSE_EM}",
    "collapse_step": f"first of the first {stats.COLLAPSE_STEPS} consecutive steps of train {REWARD} < "
                     f"{stats.COLLAPSE_REWARD} (none when only the final EM says collapsed)",
    "vs_grpo": "the arm's final EM minus GRPO's on the same seeds (same world, warm start and first rollout batch), "
               "mean over those seeds with its 95% percentile bootstrap interval (as for em_interval)",
    "time_to_collapse": "median over seeds of each run's step of collapse, a run without one (not collapsed, or "
                        "collapsed by the final-EM rule only) counted as its last step + 1",
    "lld_rate_mean": f"mean over seeds of each run's mean {LLD_RATE} over its steps (share of correct "
                     "trajectories whose log-likelihood fell over the step's updates)",
}


@dataclasses.dataclass(frozen=True)
class Row:
    """A setting x arm over its seeds; per-seed lists in seed order (None in `collapse_steps`: not collapsed or
    collapsed by the final-EM rule only; in `lld_rates`: no LLD rate logged)."""
    setting: str
    arm: str
    seeds: list[int]
    final_em: list[float]
    em_mean: float
    em_low: float
    em_high: float
    collapsed: int
    collapse_steps: list[int | None]
    lld_rates: list[float | None]
    lld_rate_mean: float | None
    time_to_collapse: float | None = None
    vs_grpo: list[float] = dataclasses.field(default_factory=list)
    vs_grpo_seeds: list[int] = dataclasses.field(default_factory=list)
    vs_grpo_mean: float | None = None
    vs_grpo_low: float | None = None
    vs_grpo_high: float | None = None


def rows(results: Sequence[RunResult], total_steps: Mapping[str, int] | None = None) -> list[Row]:
    """One row per (setting, arm), in the order they first appear in `results`; an arm other than grpo is also
    compared with grpo seed by seed in its setting (`vs_grpo`, over the seeds both have). `total_steps`: run name ->
    its number of steps, for the median time to collapse (None when a run of the row is not in it)."""
    total_steps = total_steps or {}
    groups: dict[tuple[str, str], list[RunResult]] = {}
    for result in results:
        groups.setdefault((result.setting, result.arm), []).append(result)
    table = []
    for (setting, arm), group in groups.items():
        group = sorted(group, key=lambda r: r.seed)
        em = [r.final_em for r in group]
        low, high = stats.bootstrap_interval(em)
        rates = [r.lld_rate_mean for r in group]
        known = [rate for rate in rates if rate is not None]
        table.append(Row(setting, arm, [r.seed for r in group], em, float(np.mean(em)), low, high,
                         sum(r.collapsed for r in group), [r.collapse_step for r in group], rates,
                         float(np.mean(known)) if known else None, _time_to_collapse(group, total_steps)))
    by_key = {(row.setting, row.arm): row for row in table}
    return [_paired(row, by_key.get((row.setting, "grpo"))) for row in table]


def _time_to_collapse(group: Sequence[RunResult], total_steps: Mapping[str, int]) -> float | None:
    if any(r.name not in total_steps for r in group):
        return None
    return float(np.median([total_steps[r.name] + 1 if r.collapse_step is None else r.collapse_step for r in group]))


def _paired(row: Row, grpo: Row | None) -> Row:
    if grpo is None or row.arm == "grpo":
        return row
    grpo_em = dict(zip(grpo.seeds, grpo.final_em))
    pairs = [(seed, em - grpo_em[seed]) for seed, em in zip(row.seeds, row.final_em) if seed in grpo_em]
    if not pairs:
        return row
    seeds, diffs = (list(x) for x in zip(*pairs))
    low, high = stats.bootstrap_interval(diffs)
    return dataclasses.replace(row, vs_grpo=diffs, vs_grpo_seeds=seeds, vs_grpo_mean=float(np.mean(diffs)),
                               vs_grpo_low=low, vs_grpo_high=high)


def _num(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f}"


def _vs_grpo(row: Row) -> str:
    if row.vs_grpo_mean is None:
        return "—"
    return f"{row.vs_grpo_mean:+.3f} [{row.vs_grpo_low:+.3f}, {row.vs_grpo_high:+.3f}] ({len(row.vs_grpo)} seeds)"


def _steps(row: Row) -> str:
    steps = [f"{step} (seed {seed})" for seed, step in zip(row.seeds, row.collapse_steps) if step is not None]
    return ", ".join(steps) or "—"


def markdown(table: Sequence[Row]) -> str:
    """table.md: the rows, then the definitions of the columns."""
    lines = report.markdown_table(
        ["setting", "arm", "seeds", "final EM mean [95% CI]", "final EM per seed", "collapsed", "steps to collapse",
         "time to collapse, median", "mean LLD rate", "EM minus grpo, same seeds [95% CI]"],
        [[row.setting, f"{row.arm}: {ARMS[row.arm].description}" if row.arm in ARMS else row.arm,
          str(len(row.seeds)), f"{row.em_mean:.3f} [{row.em_low:.3f}, {row.em_high:.3f}]",
          " ".join(f"{em:.3f}" for em in row.final_em), f"{row.collapsed}/{len(row.seeds)}", _steps(row),
          "—" if row.time_to_collapse is None else f"{row.time_to_collapse:g}", _num(row.lld_rate_mean), _vs_grpo(row)] for row in table])
    paired_rows = [row for row in table if row.vs_grpo]
    if paired_rows:
        lines += ["", "Each arm minus grpo, seed by seed (the paired differences of the last column):", ""]
        lines += report.markdown_table(
            ["setting", "arm", "minus grpo, per seed", "above grpo"],
            [[row.setting, row.arm, " ".join(_signed(d) for d in row.vs_grpo) +
              f" (seeds {','.join(map(str, row.vs_grpo_seeds))})",
              f"{sum(d > 0 for d in row.vs_grpo)} of {len(row.vs_grpo)}"] for row in paired_rows])
    lines += ["", "Seeds in each row: " + "; ".join(f"{row.setting}/{row.arm}: {', '.join(map(str, row.seeds))}"
                                                    for row in table), ""]
    lines += [f"- **{name}**: {text}" for name, text in DEFINITIONS.items()]
    return "\n".join(lines) + "\n"


# The columns of runs.csv: one run's numbers (RunResult's fields but its curves).
RUN_FIELDS = ("setting", "arm", "seed", "final_em", "collapse_step", "collapsed", "lld_rate_mean")


def _csv_list(values: Sequence) -> str:
    return ";".join("" if v is None else str(v) for v in values)


def write(table: Sequence[Row], results: Sequence[RunResult], out: str) -> list[str]:
    """Writes table.md, table.csv, table.json and runs.csv into `out`; returns their paths."""
    os.makedirs(out, exist_ok=True)
    paths = [os.path.join(out, name) for name in ("table.md", "table.csv", "table.json", "runs.csv")]
    with open(paths[0], "w") as f:
        f.write(markdown(table))
    with open(paths[1], "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["setting", "arm", "n_seeds", "seeds", "em_mean", "em_ci_low", "em_ci_high", "em_per_seed",
                         "collapsed", "collapse_steps", "lld_rate_mean", "vs_grpo_mean", "vs_grpo_ci_low",
                         "vs_grpo_ci_high", "vs_grpo_per_seed", "time_to_collapse"])
        for row in table:
            writer.writerow([row.setting, row.arm, len(row.seeds), _csv_list(row.seeds), row.em_mean, row.em_low,
                             row.em_high, _csv_list(row.final_em), row.collapsed, _csv_list(row.collapse_steps),
                             "" if row.lld_rate_mean is None else row.lld_rate_mean,
                             *("" if v is None else v for v in (row.vs_grpo_mean, row.vs_grpo_low,
                                                                 row.vs_grpo_high)), _csv_list(row.vs_grpo),
                             "" if row.time_to_collapse is None else row.time_to_collapse])
    runs = [{field: getattr(result, field) for field in RUN_FIELDS} for result in results]
    with open(paths[2], "w") as f:
        json.dump({"definitions": DEFINITIONS, "rows": [dataclasses.asdict(row) for row in table], "runs": runs}, f,
                  indent=2)
    with open(paths[3], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=RUN_FIELDS)
        writer.writeheader()
        writer.writerows(runs)
    return paths


# runs.csv column -> (parse its text, what it must be); other columns are text.
_RUN_PARSERS = {
    "seed": (int, "an integer"),
    "final_em": (float, "a number"),
    "collapse_step": (lambda text: None if text == "" else int(text), "an integer or empty"),
    "collapsed": (lambda text: {"True": True, "False": False}[text], "True or False"),
    "lld_rate_mean": (lambda text: None if text == "" else float(text), "a number or empty"),
}


def read_runs(path: str) -> list[RunResult]:
    """The runs of a `runs.csv` written by `write`: each run's numbers, without curves (every curve empty); a study
    run in parts on machines whose run folders were not kept reports its earlier runs from it. StudyError naming the
    file, line and column of a missing column or a bad value."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = [name for name in RUN_FIELDS if name not in (reader.fieldnames or ())]
        if missing:
            raise StudyError(f"{path} line 1: runs.csv needs the columns {', '.join(RUN_FIELDS)}; missing "
                             f"{', '.join(missing)}")
        results = []
        for record in reader:
            values = {}
            for name in RUN_FIELDS:
                parse, expected = _RUN_PARSERS.get(name, (str, "text"))
                text = record[name] or ""
                try:
                    values[name] = parse(text)
                except (KeyError, ValueError):
                    raise StudyError(f"{path} line {reader.line_num}: column {name} must be {expected}, got "
                                     f"{text!r}") from None
            results.append(RunResult(**values, curves={metric: ([], []) for metric in CURVES}))
    return results


# Definitions of the endpoints a study reports only when asked (`--endpoints`): older reports keep their text.
_OPTIONAL_ENDPOINT_DEFINITIONS = {
    "peak_em": "the highest greedy test EM of a run's evaluations during training (`train.eval_every`) and its "
               "final one; a run without evaluations during training is left out",
    "lld_rate_common": "each run's mean LLD rate over the steps where both runs of the pair logged one (a step with "
                       "no correct trajectory has none), so both means average the same steps",
    "tokens_generated": "tokens a run's training rollouts generated over all its steps (`rollout/sampled_tokens`)",
    "searches_per_trajectory": "searches a run's training rollouts sent per trajectory obtained, over all its steps",
    "step_s": "a run's mean wall seconds per step from step 2 on (`perf/step_s`; step 1 compiles)",
    "rollout_s": "a run's mean wall seconds of a step's rollout from step 2 on (`perf/rollout_s`)",
    "tokens_per_s": "a run's trained tokens (the loss mask's) per wall second over steps 2 on: the sum of each step's "
                    "`perf/tokens_per_s` x `perf/step_s` over the sum of their `perf/step_s`",
}


def _paired_definitions(comparisons: Sequence[paired.Comparison], controls: Sequence[str]) -> dict[str, str]:
    asked = {c.endpoint for c in comparisons}
    return {**_base_paired_definitions(comparisons, controls),
            **{paired.ENDPOINTS[e]: text for e, text in _OPTIONAL_ENDPOINT_DEFINITIONS.items() if e in asked}}


def _base_paired_definitions(comparisons: Sequence[paired.Comparison], controls: Sequence[str]) -> dict[str, str]:
    return {
        "arm minus control": "per seed both arms ran (same world, warm start and first rollout batch), the arm's "
                             "value minus the control's: collapse (1: collapsed, 0: not; its sign-flip test is McNemar's "
                             "exact test), final EM, or the run's mean LLD rate (a run that logged "
                             f"none is left out); controls: {', '.join(controls) or 'none'} (each against every "
                             "other arm of its setting; two controls once, the later listed minus the earlier)",
        "seeds": "how many seeds are paired (and which)",
        "bootstrap CI": f"95% percentile bootstrap interval of the mean difference ({stats.BOOTSTRAP_RESAMPLES} "
                        f"resamples, numpy default_rng({stats.BOOTSTRAP_SEED}))",
        "t CI": "95% paired t interval: mean -/+ t(0.975, n-1) sd / sqrt(n), the t quantile computed exactly "
                "(Abramowitz & Stegun 26.7.3-4); none with one seed",
        "sign-flip p": f"exact two-sided paired permutation test: the share of the 2^n sign assignments of the n "
                       f"differences whose |sum| reaches the observed one, at least 2/2^n: 0.125 with 4 seeds, 0.0078 "
                       f"with 8 (exact up to n = {stats.SIGN_FLIP_EXACT_N}; beyond, {stats.BOOTSTRAP_RESAMPLES} "
                       f"random assignments, numpy default_rng({stats.BOOTSTRAP_SEED}))",
        "Holm p": f"the sign-flip p Holm-Bonferroni adjusted over all {len(comparisons)} comparisons of this table "
                  "(every setting, pair and endpoint)",
        "higher / lower / equal": "how many of the paired seeds have the arm above, below, equal to the control",
    }


def _signed(value: float) -> str:
    return f"{value:+.3f}"


def _paired_cells(c: paired.Comparison) -> list[str]:
    return [c.setting, c.arm, c.control, f"{len(c.seeds)} ({','.join(map(str, c.seeds))})", _signed(c.mean),
            f"[{_signed(c.boot_low)}, {_signed(c.boot_high)}]",
            "—" if c.t_low is None else f"[{_signed(c.t_low)}, {_signed(c.t_high)}]", f"{c.sign_flip_p:.4f}",
            f"{c.holm_p:.4f}", f"{c.higher} / {c.lower} / {c.equal}"]


def paired_tables(comparisons: Sequence[paired.Comparison]) -> list[str]:
    """The paired tables as markdown lines: per endpoint with comparisons, a title line and one row per
    comparison."""
    lines = []
    for endpoint, label in paired.ENDPOINTS.items():
        chosen = [c for c in comparisons if c.endpoint == endpoint]
        if chosen:
            lines += [f"{label}: arm minus control, same seeds", ""]
            lines += report.markdown_table(
                ["setting", "arm", "control", "seeds", "mean difference", "95% bootstrap CI", "95% t CI",
                 "sign-flip p (exact)", "Holm p", "seeds higher / lower / equal"],
                [_paired_cells(c) for c in chosen])
            lines.append("")
    return lines


def paired_markdown(comparisons: Sequence[paired.Comparison], controls: Sequence[str]) -> str:
    """paired.md: the paired tables, then the definitions of their columns."""
    lines = paired_tables(comparisons) or ["No pair of an arm and a control shares a seed.", ""]
    lines += [f"- **{name}**: {text}" for name, text in _paired_definitions(comparisons, controls).items()]
    return "\n".join(lines) + "\n"


def write_paired(comparisons: Sequence[paired.Comparison], controls: Sequence[str], out: str) -> list[str]:
    """Writes paired.md, paired.csv and paired.json into `out`; returns their paths."""
    os.makedirs(out, exist_ok=True)
    paths = [os.path.join(out, name) for name in ("paired.md", "paired.csv", "paired.json")]
    with open(paths[0], "w") as f:
        f.write(paired_markdown(comparisons, controls))
    with open(paths[1], "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["setting", "arm", "control", "endpoint", "n_seeds", "seeds", "mean_difference",
                         "boot_ci_low", "boot_ci_high", "t_ci_low", "t_ci_high", "sign_flip_p", "holm_p", "higher",
                         "lower", "equal", "differences_per_seed"])
        for c in comparisons:
            writer.writerow([c.setting, c.arm, c.control, c.endpoint, len(c.seeds), _csv_list(c.seeds), c.mean,
                             c.boot_low, c.boot_high, "" if c.t_low is None else c.t_low,
                             "" if c.t_high is None else c.t_high, c.sign_flip_p, c.holm_p, c.higher, c.lower,
                             c.equal, _csv_list(c.differences)])
    with open(paths[2], "w") as f:
        json.dump({"definitions": _paired_definitions(comparisons, controls), "controls": list(controls),
                   "comparisons": [dataclasses.asdict(c) for c in comparisons]}, f, indent=2)
    return paths
