"""What one finished run of the study shows, read from its own files: the final greedy test EM
(`eval/final_step_N/results.json`, N = train.total_steps), collapse (llds_jax.apps.study.stats) from the train reward of
`metrics.jsonl`, the mean LLD rate and the per-step metrics the study plots and keeps (`CURVES`, in `steps.csv.gz`)."""
from __future__ import annotations

import dataclasses

import numpy as np

from llds_jax.train import report
from llds_jax.apps.study import stats
from llds_jax.apps.study.plan import FINAL_EVAL, Run, StudyError

REWARD = "reward/mean"              # share of correct trajectories of the step's rollout batch
LIKELIHOOD = "lld/logp_mean_correct"  # per-trajectory token-mean log-prob of the correct ones, before the updates
LLD_RATE = "lld/rate"               # share of correct trajectories whose log-likelihood fell over the step's updates
DELTA_TRAJ = "lld/delta_traj_correct"  # mean change of the correct trajectories' log-likelihood over the updates
GRAD_NORM = "actor/grad_norm"       # gradient norm before clipping, mean over the step's updates
REF_KL = "actor/ref_kl_k3"          # k3 KL to the reference policy
EVAL_EM = "eval/em_mean"            # greedy test EM of the evaluations during training (train.eval_every)
EVAL_EM_TWO_HOP = "eval/em_two_hop"  # the same evaluations' EM on the two-hop test questions alone
SAMPLED_TOKENS = "rollout/sampled_tokens"  # tokens the step's rollout generated (the budget; docs/tree-rollouts.md)
SEARCHES = "rollout/searches"       # queries the step's rollout sent
TRAJECTORIES = "rollout/trajectories"  # trajectories the step's rollout obtained
STEP_S = "perf/step_s"              # the step's wall seconds
ROLLOUT_S = "perf/rollout_s"        # the wall seconds of the step's rollout (a part of STEP_S)
TOKENS_PER_S = "perf/tokens_per_s"  # the step's trained tokens (its loss mask's) per wall second of the step
LAST_EVALUATIONS = 3                # last3_em and last3_two_hop_em: the mean of this many last evaluations
# The per-step metrics a RunResult holds: the plots read the first three, the collapse rule REWARD.
CURVES = (REWARD, LIKELIHOOD, LLD_RATE, DELTA_TRAJ, GRAD_NORM, REF_KL)
# Held (and kept in steps.csv.gz) only by runs that logged them: a study without evaluations during training keeps
# the files of CURVES alone.
OPTIONAL_CURVES = (EVAL_EM, EVAL_EM_TWO_HOP, SAMPLED_TOKENS, SEARCHES, TRAJECTORIES, STEP_S, ROLLOUT_S,
                   TOKENS_PER_S)


@dataclasses.dataclass(frozen=True)
class RunResult:
    """One run's numbers. `lld_rate_mean`: mean of `lld/rate` over the steps that have it (the metric is null on a
    step without a correct trajectory; None when no step has it). `curves`: metric -> (steps, values) for every
    metric of CURVES, steps ascending (both empty when the run did not log it, or when read from a runs.csv without
    its steps file); a metric of OPTIONAL_CURVES only when the run logged it."""
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

    @property
    def peak_em(self) -> float | None:
        """The highest greedy test EM of the evaluations during training (step > 0) and the final one; None for a
        run without evaluations during training."""
        periodic = [em for step, em in zip(*self.curves.get(EVAL_EM, ([], []))) if step > 0]
        return max([*periodic, self.final_em]) if periodic else None

    def _last_evaluations(self, metric: str) -> float | None:
        periodic = [em for step, em in zip(*self.curves.get(metric, ([], []))) if step > 0]
        return float(np.mean(periodic[-LAST_EVALUATIONS:])) if len(periodic) >= LAST_EVALUATIONS else None

    @property
    def last3_em(self) -> float | None:
        """The mean greedy test EM of the last LAST_EVALUATIONS evaluations during training (step > 0; with
        train.eval_every dividing train.total_steps the last of them is at the last step, as the final evaluation);
        None for a run with fewer."""
        return self._last_evaluations(EVAL_EM)

    @property
    def last3_two_hop_em(self) -> float | None:
        """As `last3_em`, on the two-hop test questions alone (EVAL_EM_TWO_HOP); None for a run with fewer such
        evaluations or none logged."""
        return self._last_evaluations(EVAL_EM_TWO_HOP)

    @property
    def lasting_collapse(self) -> bool | None:
        """llds_jax.apps.study.stats.lasting_collapse of the run's train reward and final EM (None: no rewards)."""
        steps, rewards = self.curves[REWARD]
        return stats.lasting_collapse(steps, rewards, self.final_em) if rewards else None

    @property
    def lasting_decline(self) -> bool | None:
        """llds_jax.apps.study.stats.lasting_decline of the run's train reward (None: no rewards)."""
        steps, rewards = self.curves[REWARD]
        return stats.lasting_decline(steps, rewards) if rewards else None

    @property
    def tokens_generated(self) -> float | None:
        """Tokens the run's rollouts generated over all its steps; None for a run that did not log them."""
        tokens = self.curves.get(SAMPLED_TOKENS, ([], []))[1]
        return float(sum(tokens)) if tokens else None

    @property
    def searches_per_trajectory(self) -> float | None:
        """Searches the run's rollouts sent per trajectory obtained, over all its steps (training rollouts, not the
        greedy evaluation); None for a run that did not log them."""
        searches, trajectories = (self.curves.get(m, ([], []))[1] for m in (SEARCHES, TRAJECTORIES))
        return float(sum(searches) / sum(trajectories)) if searches and trajectories else None

    @property
    def step_s(self) -> float | None:
        """Mean wall seconds per step from step 2 on (step 1 compiles); None for a run that did not log them."""
        seconds = [s for step, s in zip(*self.curves.get(STEP_S, ([], []))) if step > 1]
        return float(np.mean(seconds)) if seconds else None

    @property
    def rollout_s(self) -> float | None:
        """Mean wall seconds of a step's rollout from step 2 on (step 1 compiles); None for a run that did not log
        them."""
        seconds = [s for step, s in zip(*self.curves.get(ROLLOUT_S, ([], []))) if step > 1]
        return float(np.mean(seconds)) if seconds else None

    @property
    def tokens_per_s(self) -> float | None:
        """Trained tokens per wall second from step 2 on (step 1 compiles): the steps' trained tokens (each step's
        tokens/s times its seconds) over their seconds, so a long step weighs as its time; None for a run that did not
        log both."""
        seconds = dict(zip(*self.curves.get(STEP_S, ([], []))))
        rates = [(rate, seconds[step]) for step, rate in zip(*self.curves.get(TOKENS_PER_S, ([], [])))
                 if step > 1 and step in seconds]
        return float(sum(r * s for r, s in rates) / sum(s for _, s in rates)) if rates else None

    @property
    def has_curves(self) -> bool:
        """Whether any per-step metric has a value (not so for a run read from a runs.csv without its steps)."""
        return any(steps for steps, _ in self.curves.values())


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
    curves.update({metric: logged.series(metric) for metric in OPTIONAL_CURVES if logged.series(metric)[0]})
    return result_of(run.setting, run.arm, run.seed, final_em, curves)


def result_of(setting: str, arm: str, seed: int, final_em: float,
              curves: dict[str, tuple[list[int], list[float]]]) -> RunResult:
    """A run's numbers from its final EM and its curves (metric -> (steps, values), every metric of CURVES and those
    of OPTIONAL_CURVES it logged):
    collapse from the REWARD curve, the mean LLD rate from the LLD_RATE one."""
    step = stats.collapse_step(*curves[REWARD])
    rates = curves[LLD_RATE][1]
    return RunResult(setting, arm, seed, final_em, step, stats.collapsed(step, final_em),
                     float(np.mean(rates)) if rates else None, curves)
