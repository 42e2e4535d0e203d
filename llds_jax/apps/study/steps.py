"""The per-step metrics of the study's runs in one file, `OUT/steps.csv.gz`: one row per run x step (columns
setting, arm, seed, step and each metric of llds_jax.apps.study.outcomes.CURVES, then those of OPTIONAL_CURVES some
run logged; empty where the run logged none at that step). With the runs' numbers (`runs.csv`) it is what the plots and every table are computed from, so a report
can be recomputed from these two committed files without the run folders (`--report --recorded RUNS_CSV`).

Values are written as Python's shortest round-tripping text of the float: read back, they are the same floats. The
gzip header carries no time stamp, so the same runs give the same bytes."""
from __future__ import annotations

import csv
import dataclasses
import gzip
import io
import os
from collections.abc import Mapping, Sequence

from llds_jax.apps.study.outcomes import CURVES, OPTIONAL_CURVES, RunResult, result_of
from llds_jax.apps.study.plan import StudyError

FILE = "steps.csv.gz"
KEY_FIELDS = ("setting", "arm", "seed", "step")

Curves = dict[str, tuple[list[int], list[float]]]


def _columns(results: Sequence[RunResult]) -> tuple[str, ...]:
    """The metrics of the file: every one of CURVES, then those of OPTIONAL_CURVES that some run logged."""
    return (*CURVES, *(m for m in OPTIONAL_CURVES if any(r.curves.get(m, ([], []))[0] for r in results)))


def _rows(result: RunResult, metrics: Sequence[str]) -> list[list]:
    """One run's rows: per step any metric has, [setting, arm, seed, step, value per metric of `metrics` or '']."""
    by_metric = {metric: dict(zip(*result.curves.get(metric, ([], [])))) for metric in metrics}
    steps = sorted(set().union(*by_metric.values()))
    return [[result.setting, result.arm, result.seed, step,
             *(repr(by_metric[metric][step]) if step in by_metric[metric] else "" for metric in metrics)]
            for step in steps]


def write(results: Sequence[RunResult], out: str) -> str:
    """Writes `out/steps.csv.gz`, the rows of every run of `results` in their order (none for a run without
    curves, e.g. one read from a runs.csv alone); returns its path."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, FILE)
    metrics = _columns(results)
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as packed, \
            io.TextIOWrapper(packed, encoding="utf-8", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([*KEY_FIELDS, *metrics])
        for result in results:
            writer.writerows(_rows(result, metrics))
    return path


def _parse(text: str, parse, expected: str, where: str, column: str):
    try:
        return parse(text)
    except ValueError:
        raise StudyError(f"{where}: column {column} must be {expected}, got {text!r}") from None


def read(path: str) -> dict[str, Curves]:
    """The curves in a steps file written by `write` (gzip when `path` ends in .gz, else plain CSV): run name
    (SETTING/ARM/seed_K) -> metric -> (steps ascending, values), for every metric of CURVES. StudyError naming the
    file, line and column of a missing column, a bad value or a step given twice for one run."""
    opener = gzip.open if path.endswith(".gz") else open
    curves: dict[str, Curves] = {}
    seen: set[tuple[str, int]] = set()
    with opener(path, "rt", encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        missing = [name for name in (*KEY_FIELDS, *CURVES) if name not in (reader.fieldnames or ())]
        if missing:
            raise StudyError(f"{path} line 1: a steps file needs the columns {', '.join((*KEY_FIELDS, *CURVES))}; "
                             f"missing {', '.join(missing)}")
        metrics = (*CURVES, *(m for m in OPTIONAL_CURVES if m in reader.fieldnames))
        for record in reader:
            where = f"{path} line {reader.line_num}"
            seed = _parse(record["seed"] or "", int, "an integer", where, "seed")
            step = _parse(record["step"] or "", int, "an integer", where, "step")
            name = f"{record['setting']}/{record['arm']}/seed_{seed}"
            if (name, step) in seen:
                raise StudyError(f"{where}: {name} step {step} is given twice")
            seen.add((name, step))
            run = curves.setdefault(name, {metric: ([], []) for metric in metrics})
            for metric in metrics:
                text = record[metric] or ""
                if text:
                    run[metric][0].append(step)
                    run[metric][1].append(_parse(text, float, "a number or empty", where, metric))
    return {name: {metric: _ascending(*series) for metric, series in run.items() if metric in CURVES or series[0]}
            for name, run in curves.items()}


def _ascending(steps: list[int], values: list[float]) -> tuple[list[int], list[float]]:
    order = sorted(range(len(steps)), key=steps.__getitem__)
    return [steps[i] for i in order], [values[i] for i in order]


def attach(results: Sequence[RunResult], curves: Mapping[str, Curves], path: str) -> list[RunResult]:
    """`results` (e.g. read from a runs.csv) with their curves from the steps file `path` (`read`); a run the file
    has no rows for keeps its own. StudyError naming the file and run when the file has a run `results` lacks, or
    when the collapse or mean LLD rate computed from a run's curves is not its recorded number."""
    names = {result.name for result in results}
    unknown = [name for name in curves if name not in names]
    if unknown:
        raise StudyError(f"{path}: steps of runs not in the runs file: {', '.join(unknown)}")
    attached = []
    for result in results:
        if result.name not in curves:
            attached.append(result)
            continue
        computed = result_of(result.setting, result.arm, result.seed, result.final_em, curves[result.name])
        for field in ("collapse_step", "collapsed", "lld_rate_mean"):
            if getattr(computed, field) != getattr(result, field):
                raise StudyError(f"{path}: {result.name}: {field} from its steps is {getattr(computed, field)}, "
                                 f"the runs file says {getattr(result, field)}")
        attached.append(dataclasses.replace(result, curves=computed.curves))
    return attached
