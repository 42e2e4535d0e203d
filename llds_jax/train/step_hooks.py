"""What runs after each training step, from a list (tunix's `metric_fns`): the built-in hooks, and between them the
hooks `train.hooks` names (`STEP_HOOKS`, a registry: llds_jax.registry). A new diagnostic is one function registered
there (`@STEP_HOOKS.register("my_hook")`, e.g. in the module of the application the config's `app` key
names, which loads before the config is checked) and named in the config.

A `StepHook` gets the `FinishedStep`: the step, its state, metrics and trajectories, and the run's `StepContext` (the
typed run config, the run folder, the tokenizer, whether this process writes, the periodic evaluation), never the
trainer. Hooks run on every process (a hook that writes checks `run.is_main`), in order, after the step's updates
and before the watchdog's check of the updated params and the checkpoint (the trainer's loop saves after them, on
`train.checkpoint_every`, the last step or a stop): the periodic evaluation (its metrics join the step's), the
named hooks, the step's metrics record, the transcripts (`step_hooks`). A named hook can add to `metrics` (they
join the record).
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any, Optional

from etils import epath
from flax import nnx

from llds_jax.config.sections import RunConfig
from llds_jax.registry import Registry
from llds_jax.rl.train_step import TrainState
from llds_jax.rollout.trajectory import Trajectory
from llds_jax.train import evaluation
from llds_jax.train.metrics import MetricsWriter
from llds_jax.train.preemption import StepInterrupted

log = logging.getLogger(__name__)

# (params, the evaluation's output folder, this host's stop request or None) -> the evaluation's metrics.
Evaluate = Callable[[nnx.State, epath.Path, Optional[Callable[[], bool]]], dict[str, float]]


@dataclasses.dataclass(frozen=True)
class StepContext:
    """What a step hook may use of its run, the same every step.

    Attributes:
      config: the typed run config.
      run_dir: the run folder (local or gs://).
      tokenizer: the run's tokenizer (a Hugging Face tokenizer: transcripts).
      is_main: whether this process writes the run's files (process 0).
      evaluate: the periodic evaluation (`train.eval_max_examples` questions of data.eval_files, greedy; its
        `eval/em_*` and `eval/searches_*` metrics; its files in the folder given); None without evaluation files.
    """

    config: RunConfig
    run_dir: epath.Path
    tokenizer: Any
    is_main: bool
    evaluate: Optional[Evaluate]


@dataclasses.dataclass
class FinishedStep:
    """A step whose updates are done. `run`: the run's `StepContext`; `metrics`: the step's metrics (the record
    `write_metrics` writes); `trajectories`: this host's; `stopping`: this host's stop request when a stop may end
    the step's work (`train.stop_within_step`), else None."""

    run: StepContext
    step: int
    state: TrainState
    metrics: dict[str, float]
    trajectories: list[Trajectory]
    writer: MetricsWriter
    stopping: Optional[Callable[[], bool]]


StepHook = Callable[[FinishedStep], None]
STEP_HOOKS: Registry[StepHook] = Registry("train.hooks")


def evaluate(done: FinishedStep) -> None:
    """Every `train.eval_every` steps (with evaluation files): the evaluation of `train.eval_max_examples`
    questions, its metrics added to the step's; a stop request abandons it (the step is then saved without them)."""
    run, step = done.run, done.step
    every = run.config.train.eval_every
    if not (every and step % every == 0 and run.evaluate is not None):
        return
    try:
        done.metrics.update(run.evaluate(done.state.params, run.run_dir / "eval" / f"step_{step}", done.stopping))
    except StepInterrupted:
        log.warning("stop requested during the evaluation after step %d: abandoned it", step)


def write_metrics(done: FinishedStep) -> None:
    """The step's metrics record (console, JSONL, TensorBoard: llds_jax.train.metrics)."""
    done.writer.write(done.step, done.metrics)


def write_transcripts(done: FinishedStep) -> None:
    """Every `train.transcripts_every` steps: the first `train.num_transcripts` trajectories as text."""
    config = done.run.config
    t = config.train
    if t.transcripts_every and done.step % t.transcripts_every == 0:
        done.writer.write_texts(done.step, {
            f"transcripts/{i}": evaluation.transcript_text(traj, done.run.tokenizer, config.reward.empty_answer)
            for i, traj in enumerate(done.trajectories[:t.num_transcripts])})


def step_hooks(names: Sequence[str]) -> tuple[StepHook, ...]:
    """The hooks of a step, in order: the evaluation, the hooks `names` (`train.hooks`), the metrics record,
    the transcripts. ConfigError naming the key for a name that is not registered."""
    return (evaluate, *(STEP_HOOKS[name] for name in names), write_metrics, write_transcripts)
