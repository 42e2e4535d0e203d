"""The study's paired comparisons: in each setting, each arm minus each control arm on the seeds both ran (same
world, warm start and first rollout batch), for each endpoint (final EM, mean LLD rate), with a bootstrap and a t
interval of the mean difference, the exact sign-flip p-value and its Holm adjustment over every comparison reported.

Controls: a list of arm names (default: every arm whose name starts with `grpo`, in the order they first appear).
Each control of a setting is compared with every other arm of it; two controls are compared once, the one later in
the list minus the earlier (the mirrored pair would be the same test)."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from llds_jax.apps.study import stats
from llds_jax.apps.study.outcomes import LLD_RATE, RunResult
from llds_jax.apps.study.plan import StudyError

# RunResult field -> what the report calls it; a run whose field is None (no LLD rate logged) is left out of it.
# On `collapsed`, `lasting_collapse` and `lasting_decline` (1 yes, 0 no; llds_jax.apps.study.stats) the exact
# sign-flip test is McNemar's exact test of the discordant pairs.
# `lld_rate_common` is read off each pair of runs: each run's mean LLD rate over the steps where both have one (the
# LLD rate exists only on steps with a correct trajectory, so two runs' plain means average different steps).
ENDPOINTS = {"collapsed": "collapse (1: collapsed)", "lasting_collapse": "lasting collapse (1: yes)",
             "lasting_decline": "lasting decline (1: yes)", "final_em": "final EM",
             "last3_em": "greedy EM, mean of the last 3 evaluations",
             "last3_two_hop_em": "two-hop greedy EM, mean of the last 3 evaluations", "peak_em": "peak greedy EM",
             "lld_rate_mean": "mean LLD rate", "lld_rate_common": "mean LLD rate on common steps",
             "tokens_generated": "tokens generated", "searches_per_trajectory": "searches per trajectory",
             "step_s": "seconds per step", "rollout_s": "rollout seconds per step",
             "tokens_per_s": "trained tokens per second"}
DEFAULT_ENDPOINTS = ("final_em", "lld_rate_mean")
PAIRWISE = ("lld_rate_common",)  # endpoints that exist only for a pair of runs
CONTROL_PREFIX = "grpo"


@dataclasses.dataclass(frozen=True)
class Comparison:
    """`arm` minus `control` in `setting` on `endpoint` (a key of ENDPOINTS), over `seeds` (those both runs have a
    value for), ascending. `differences`: one per seed. `boot_*`: 95% percentile bootstrap interval of their mean;
    `t_*`: 95% paired t interval (None with one seed); `sign_flip_p`: exact two-sided sign-flip p-value;
    `holm_p`: it Holm-adjusted over every comparison of the report; `higher`, `lower`, `equal`: how many seeds'
    differences are > 0, < 0, = 0."""
    setting: str
    arm: str
    control: str
    endpoint: str
    seeds: list[int]
    differences: list[float]
    mean: float
    boot_low: float
    boot_high: float
    t_low: float | None
    t_high: float | None
    sign_flip_p: float
    holm_p: float
    higher: int
    lower: int
    equal: int


def default_controls(results: Sequence[RunResult]) -> list[str]:
    """Every arm of `results` whose name starts with CONTROL_PREFIX, in the order they first appear."""
    return [arm for arm in dict.fromkeys(r.arm for r in results) if arm.startswith(CONTROL_PREFIX)]


def pairs(arms: Sequence[str], controls: Sequence[str]) -> list[tuple[str, str]]:
    """(arm, control) pairs of one setting's `arms`: for each control among them (in `controls` order), every
    other arm (in `arms` order) but a control earlier in `controls`."""
    present = [control for control in controls if control in arms]
    return [(arm, control) for index, control in enumerate(present) for arm in arms
            if arm != control and arm not in present[:index]]


def values(results: Sequence[RunResult], setting: str, arm: str, endpoint: str) -> dict[int, float]:
    """seed -> `endpoint` of each run of `arm` in `setting` that has a value for it (not a PAIRWISE one)."""
    return {r.seed: getattr(r, endpoint) for r in results
            if r.setting == setting and r.arm == arm and getattr(r, endpoint) is not None}


def _common_step_lld_rates(results: Sequence[RunResult], setting: str, arm: str,
                           control: str) -> tuple[dict[int, float], dict[int, float]]:
    """Per seed both ran with a step both logged an LLD rate on: each one's mean LLD rate over those steps."""
    runs = {(r.arm, r.seed): r for r in results if r.setting == setting and r.arm in (arm, control)}
    arm_values, control_values = {}, {}
    for (name, seed), run in runs.items():
        other = runs.get((control, seed))
        if name != arm or other is None:
            continue
        mine, theirs = dict(zip(*run.curves[LLD_RATE])), dict(zip(*other.curves[LLD_RATE]))
        common = sorted(set(mine) & set(theirs))
        if common:
            arm_values[seed] = float(np.mean([mine[s] for s in common]))
            control_values[seed] = float(np.mean([theirs[s] for s in common]))
    return arm_values, control_values


def compare(setting: str, arm: str, control: str, endpoint: str, arm_values: dict[int, float],
            control_values: dict[int, float]) -> Comparison | None:
    """The comparison of `arm_values` with `control_values` (seed -> value) on the seeds both have (None when they
    share none); `holm_p` is left at the unadjusted p (`comparisons` adjusts it over the family)."""
    seeds = sorted(set(arm_values) & set(control_values))
    if not seeds:
        return None
    d_n = np.array([arm_values[seed] - control_values[seed] for seed in seeds])
    t_low, t_high = stats.t_interval(d_n) if d_n.size > 1 else (None, None)
    p = stats.sign_flip_p(d_n)
    return Comparison(setting, arm, control, endpoint, seeds, [float(d) for d in d_n], float(d_n.mean()),
                      *stats.bootstrap_interval(d_n), t_low, t_high, p, p, int((d_n > 0).sum()),
                      int((d_n < 0).sum()), int((d_n == 0).sum()))


def parse_endpoints(text: str) -> tuple[str, ...]:
    """`collapsed,final_em` -> the endpoints of the paired table (keys of ENDPOINTS), in ENDPOINTS order."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [name for name in names if name not in ENDPOINTS]
    if unknown or not names:
        raise StudyError(f"--endpoints: {', '.join(map(repr, unknown)) or 'none given'}; known: "
                         f"{', '.join(ENDPOINTS)}")
    return tuple(endpoint for endpoint in ENDPOINTS if endpoint in names)


def comparisons(results: Sequence[RunResult], controls: Sequence[str] | None = None,
                endpoints: Sequence[str] = DEFAULT_ENDPOINTS) -> list[Comparison]:
    """Every comparison of `results`, per endpoint (of `endpoints`), setting (order of appearance), control, then
    arm (`pairs`), each with `holm_p` adjusted over all of them (one family: every setting, pair and endpoint).
    `controls`: arm names (None: `default_controls`)."""
    controls = default_controls(results) if controls is None else list(controls)
    settings = list(dict.fromkeys(r.setting for r in results))
    found = []
    for endpoint in endpoints:
        for setting in settings:
            arms = list(dict.fromkeys(r.arm for r in results if r.setting == setting))
            for arm, control in pairs(arms, controls):
                if endpoint in PAIRWISE:
                    both = _common_step_lld_rates(results, setting, arm, control)
                else:
                    both = values(results, setting, arm, endpoint), values(results, setting, control, endpoint)
                comparison = compare(setting, arm, control, endpoint, *both)
                if comparison is not None:
                    found.append(comparison)
    adjusted = stats.holm([c.sign_flip_p for c in found])
    return [dataclasses.replace(c, holm_p=p) for c, p in zip(found, adjusted)]
