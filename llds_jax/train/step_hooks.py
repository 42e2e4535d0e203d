"""What runs after each training step, from a list (tunix's `metric_fns`): a new diagnostic is one function passed
as `Trainer(cfg, step_hooks=(*DEFAULT_STEP_HOOKS, my_hook))`.

A `StepHook` gets the `FinishedStep` and runs on every process (a hook that writes checks `trainer.is_main`). The
hooks run in their order, after the step's updates and before its checkpoint (the trainer's loop saves after them,
on `train.checkpoint_every`, the last step or a stop). The defaults, in this order: the periodic evaluation (its
metrics join the step's), the step's metrics record, the transcripts, the watchdog's check of the updated params.
A hook placed before `write_metrics` can add to `metrics`; one after it sees the record as written.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from llds_jax.rl.train_step import TrainState
from llds_jax.rollout.trajectory import Trajectory
from llds_jax.train import evaluation
from llds_jax.train.metrics import MetricsWriter
from llds_jax.train.preemption import PreemptionGuard, StepInterrupted

log = logging.getLogger(__name__)


@dataclasses.dataclass
class FinishedStep:
    """A step whose updates are done. `trainer`: the run's Trainer (llds_jax.train.trainer); `metrics`: the step's
    metrics (the record `write_metrics` writes); `trajectories`: this host's."""

    trainer: Any
    step: int
    state: TrainState
    metrics: dict[str, float]
    trajectories: list[Trajectory]
    writer: MetricsWriter
    guard: PreemptionGuard


StepHook = Callable[[FinishedStep], None]


def evaluate(done: FinishedStep) -> None:
    """Every `train.eval_every` steps (with evaluation files): the evaluation of `train.eval_max_examples`
    questions, its metrics added to the step's; a stop request abandons it (the step is then saved without them)."""
    trainer, step = done.trainer, done.step
    every = trainer.cfg.train.eval_every
    if not (every and step % every == 0 and trainer.eval_examples):
        return
    stopping = (lambda: done.guard.requested) if trainer.stops_within_step(done.guard) else None
    examples = trainer.eval_subset(trainer.cfg.train.eval_max_examples)
    try:
        done.metrics.update(trainer.evaluate(done.state.params, examples, trainer.run_dir / "eval" / f"step_{step}",
                                             stopping=stopping))
    except StepInterrupted:
        log.warning("stop requested during the evaluation after step %d: abandoned it", step)


def write_metrics(done: FinishedStep) -> None:
    """The step's metrics record (console, JSONL, TensorBoard: llds_jax.train.metrics)."""
    done.writer.write(done.step, done.metrics)


def write_transcripts(done: FinishedStep) -> None:
    """Every `train.transcripts_every` steps: the first `train.num_transcripts` trajectories as text."""
    trainer, t = done.trainer, done.trainer.cfg.train
    if t.transcripts_every and done.step % t.transcripts_every == 0:
        done.writer.write_texts(done.step, {
            f"transcripts/{i}": evaluation.transcript_text(traj, trainer.tokenizer, trainer.cfg.reward.empty_answer)
            for i, traj in enumerate(done.trajectories[:t.num_transcripts])})


def check_updates(done: FinishedStep) -> None:
    """The watchdog's check of the updated params (llds_jax.train.watchdog)."""
    done.trainer.watchdog.check_updates(done.state.params, done.step)


DEFAULT_STEP_HOOKS: tuple[StepHook, ...] = (evaluate, write_metrics, write_transcripts, check_updates)
