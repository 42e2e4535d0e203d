"""The study's wall-time estimate, printed before it runs anything, and the timings it learns it from.

Unit: machine-seconds, the wall time a job adds when the machine runs only it. A job that took S seconds while
`--jobs J` ran at once counts S / J (the J jobs are assumed to share the machine evenly), so the measured rates
include whatever running several at once gains. Until the study has timed a job of a kind, the constants below are
used: they were measured on the 2-core machine running one job at a time, nothing else running (where and when:
docs/evidence.md, "Budget"). A loaded machine is slower.

Each finished job appends a line to `OUT/timings.jsonl`: {"job", "kind" ("run" or "warm_start"), "setting",
"steps", "seconds", "jobs", "status", "built" (warm start: its folder was not there before)}.
"""
from __future__ import annotations

import dataclasses
import json
import os
import statistics
from collections.abc import Mapping, Sequence

from llds_jax.apps.study.plan import Run

RUN_STEP_S = 8.7      # machine-seconds per step of a 20-step demo run, start-up, compilation and evaluations included
WARM_START_S = 290.0  # machine-seconds to build one seed's world and warm start
TIMINGS_FILE = "timings.jsonl"


@dataclasses.dataclass(frozen=True)
class Rates:
    """Machine-seconds per run step (by setting; `step_s` for a setting not timed yet) and per warm start built;
    `source` says where each came from."""
    step_s: float
    step_s_by_setting: Mapping[str, float]
    warm_start_s: float
    source: str

    def run_s(self, run: Run) -> float:
        return run.total_steps * self.step_s_by_setting.get(run.setting, self.step_s)


def read_timings(out: str) -> list[dict]:
    """The records of OUT/timings.jsonl (none when it does not exist yet)."""
    path = os.path.join(out, TIMINGS_FILE)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def append_timing(out: str, record: Mapping) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, TIMINGS_FILE), "a") as f:
        f.write(json.dumps(record) + "\n")


def rates(timings: Sequence[Mapping]) -> Rates:
    """Medians over the successful timed jobs (per setting for runs), else the constants."""
    per_step: dict[str, list[float]] = {}
    for t in timings:
        if t["kind"] == "run" and t["status"] == 0 and t["steps"] > 0:
            per_step.setdefault(t["setting"], []).append(t["seconds"] / t["jobs"] / t["steps"])
    built = [t["seconds"] / t["jobs"] for t in timings if t["kind"] == "warm_start" and t["status"] == 0
             and t["built"]]
    by_setting = {setting: statistics.median(values) for setting, values in per_step.items()}
    all_steps = [v for values in per_step.values() for v in values]
    step_s = statistics.median(all_steps) if all_steps else RUN_STEP_S
    warm_s = statistics.median(built) if built else WARM_START_S
    source = (f"per step: {f'measured, {len(all_steps)} run(s)' if all_steps else 'constant'}; "
              f"per warm start: {f'measured, {len(built)} built' if built else 'constant'}")
    return Rates(step_s, by_setting, warm_s, source)


def estimate_s(runs: Sequence[Run], warm_starts: int, rates_: Rates) -> float:
    """Estimated wall seconds of `runs` and `warm_starts` worlds + warm starts to build."""
    return sum(rates_.run_s(run) for run in runs) + warm_starts * rates_.warm_start_s

