"""What one finished run of the study shows, read from its own files: the final greedy test EM
(`eval/final_step_N/results.json`, N = train.total_steps), collapse (llds_jax.apps.study.stats) from the train reward of
`metrics.jsonl`, the mean LLD rate and the curves the study plots."""
from __future__ import annotations

import dataclasses

import numpy as np

from llds_jax import report
from llds_jax.apps.study import stats
from llds_jax.apps.study.plan import FINAL_EVAL, Run, StudyError

REWARD = "reward/mean"              # share of correct trajectories of the step's rollout batch
LIKELIHOOD = "lld/logp_mean_correct"  # per-trajectory token-mean log-prob of the correct ones, before the updates
LLD_RATE = "lld/rate"               # share of correct trajectories whose log-likelihood fell over the step's updates
CURVES = (REWARD, LIKELIHOOD, LLD_RATE)


@dataclasses.dataclass(frozen=True)
class RunResult:
    """One run's numbers. `lld_rate_mean`: mean of `lld/rate` over the steps that have it (the metric is null on a
    step without a correct trajectory; None when no step has it). `curves`: metric -> (steps, values)."""
    setting: str
    arm: str
    seed: int
    final_em: float
    collapse_step: int | None
    collapsed: bool
    lld_rate_mean: float | None
    curves: dict[str, tuple[list[int], list[float]]]

    @property
    def name(self) -> str:
        """As the run's (llds_jax.apps.study.plan.Run.name): SETTING/ARM/seed_K."""
        return f"{self.setting}/{self.arm}/seed_{self.seed}"


def read_result(run: Run) -> RunResult:
    """The numbers of a finished run (StudyError, naming the folder, when its final evaluation is missing)."""
    try:
        logged = report.read_run(run.run_dir)
    except report.ReportError as e:
        raise StudyError(f"{run.name}: {e}") from None
    final_em = logged.final_em_points().get(run.total_steps)
    if final_em is None:
        raise StudyError(f"{run.name}: no final evaluation in {run.run_dir}/eval/"
                         f"{FINAL_EVAL.format(steps=run.total_steps)}/results.json")
    curves = {metric: logged.series(metric) for metric in CURVES}
    step = stats.collapse_step(*curves[REWARD])
    rates = curves[LLD_RATE][1]
    return RunResult(run.setting, run.arm, run.seed, final_em, step, stats.collapsed(step, final_em),
                     float(np.mean(rates)) if rates else None, curves)
