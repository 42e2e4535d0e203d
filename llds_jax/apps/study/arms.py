"""Each arm's own endpoint values in each setting: the mean over its seeds with a 95% t interval of that mean
(`stats.t_interval` of the per-seed values), the absolute numbers behind the paired differences of `paired`.
Endpoints are `paired.ENDPOINTS` but those read off a pair of runs (`lld_rate_common`); on `collapsed` the mean is
the share of seeds that collapsed."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from llds_jax.train import report
from llds_jax.apps.study import files, paired, stats
from llds_jax.apps.study.outcomes import RunResult


@dataclasses.dataclass(frozen=True)
class ArmEndpoint:
    """`endpoint` of `arm` in `setting` over `seeds` (those with a value, ascending; `values` one per seed): `mean`
    and its 95% t interval (`t_low`, `t_high`; None with one seed)."""
    setting: str
    arm: str
    endpoint: str
    seeds: list[int]
    values: list[float]
    mean: float
    t_low: float | None
    t_high: float | None


def rows(results: Sequence[RunResult], endpoints: Sequence[str]) -> list[ArmEndpoint]:
    """One ArmEndpoint per setting, arm (in the order they first appear) and endpoint of `endpoints` that is not
    pairwise and has a value in at least one of its runs."""
    out = []
    for setting, arm in dict.fromkeys((r.setting, r.arm) for r in results):
        for endpoint in endpoints:
            by_seed = {} if endpoint in paired.PAIRWISE else paired.values(results, setting, arm, endpoint)
            if not by_seed:
                continue
            seeds = sorted(by_seed)
            values = [float(by_seed[seed]) for seed in seeds]
            low, high = stats.t_interval(values) if len(values) > 1 else (None, None)
            out.append(ArmEndpoint(setting, arm, endpoint, seeds, values, float(np.mean(values)), low, high))
    return out


def _number(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3f}"


def _cell(row: ArmEndpoint) -> str:
    interval = "" if row.t_low is None else f" [{_number(row.t_low)}, {_number(row.t_high)}]"
    return _number(row.mean) + interval


def markdown(table: Sequence[ArmEndpoint]) -> list[str]:
    """The table as markdown lines: a row per setting and arm, a column per endpoint in the order asked ("mean [95% t
    interval]";
    "—" where the arm has no value), then a line saying what the cells are."""
    endpoints = list(dict.fromkeys(row.endpoint for row in table))
    cells = {(row.setting, row.arm, row.endpoint): row for row in table}
    lines = report.markdown_table(
        ["setting", "arm", "seeds", *(paired.ENDPOINTS[e] for e in endpoints)],
        [[setting, arm, str(max(len(row.seeds) for row in table if (row.setting, row.arm) == (setting, arm))),
          *(_cell(cells[setting, arm, e]) if (setting, arm, e) in cells else "—" for e in endpoints)]
         for setting, arm in dict.fromkeys((row.setting, row.arm) for row in table)])
    return lines + ["", "Each cell: the arm's mean over its seeds [95% t interval of that mean] (on collapse: the "
                        "share of seeds that collapsed; llds_jax.apps.study.arms)."]


def write(table: Sequence[ArmEndpoint], out: str) -> list[str]:
    """Writes arms.md and arms.json into `out`; returns their paths."""
    return files.write_markdown_and_json(out, "arms", markdown(table), [dataclasses.asdict(row) for row in table])
