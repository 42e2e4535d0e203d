"""Ends a run that cannot make progress instead of letting it train on nothing for days.

Two conditions, each counted over consecutive steps and reset by one healthy step:
- a failing retriever: more than `rollout.search_failure_rate` of a step's executed searches failed (every retry
  spent; the sequences saw "Search failed" observations), `rollout.max_failed_search_steps` steps in a row. Checked
  after the rollout, before the updates train on those observations: the trainer then saves the state from before
  the step and ends with `RetrieverUnavailableError` (exit status 2; the same command resumes at that step).
- diverged parameters: `optim.max_skipped_updates` optimizer updates in a row skipped for a non-finite loss or
  gradient (a checkpoint with NaN weights, a learning rate that blew the model up). Ends with `NonFiniteError`
  naming the first parameter that holds a non-finite value (or saying that every parameter is finite); nothing is
  saved, as the state is the problem. So does a single step whose every update was skipped (issue 58: such a
  step, all 4 updates skipped from damaged weights, ended with exit status 0 and was saved over the checkpoint
  before it), naming the step.
0 turns a check off (`optim.max_skipped_updates = 0`: both of the second).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from llds_jax.rollout.trajectory import Trajectory
from llds_jax.search.types import RetrieverUnavailableError


class NonFiniteError(RuntimeError):
    """Updates were skipped `optim.max_skipped_updates` times in a row; the message names the first non-finite
    parameter."""


def search_counts(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """`{"searches": executed searches, "search_failures": those that failed}` of a batch (a search of the final
    turn is not executed and counts in neither)."""
    executed = failed = 0
    for t in trajectories:
        for turn in t.turns:
            if turn.search_error is not None:
                failed += 1
                executed += 1
            elif turn.action.kind == "search" and turn.observation is not None:
                executed += 1
    return {"searches": float(executed), "search_failures": float(failed)}


def param_name(path) -> str:
    """A parameter's dotted name from its pytree path, e.g. "layers.down_proj" (the layers' stacked tensor)."""
    parts = [str(k.key) if isinstance(k, jax.tree_util.DictKey) else str(k.idx) for k in path
             if isinstance(k, (jax.tree_util.DictKey, jax.tree_util.SequenceKey))]
    return ".".join(parts)


def first_nonfinite(params) -> str | None:
    """The name (`param_name`) of the first parameter, in `jax.tree` order, holding a NaN or an infinity; None
    when all are finite. One small reduction per parameter, fetched at once."""
    paths, leaves = zip(*jax.tree_util.tree_flatten_with_path(params)[0])
    finite = jax.device_get([jnp.isfinite(leaf).all() for leaf in leaves])
    bad = [param_name(path) for path, ok in zip(paths, finite) if not ok]
    return bad[0] if bad else None


@dataclasses.dataclass
class Watchdog:
    """The counters of the two conditions (see the module docstring)."""

    search_failure_rate: float
    max_failed_search_steps: int
    max_skipped_updates: int
    failed_search_steps: int = 0
    skipped_updates: int = 0
    step_all_skipped: int = 0  # the number of updates of the last counted step when every one was skipped, else 0

    def check_searches(self, counts: dict[str, float], last_error: str | None) -> None:
        """Counts a step's searches (`search_counts`, summed over the hosts); raises RetrieverUnavailableError
        on the `max_failed_search_steps`-th failing step in a row."""
        failing = counts["searches"] > 0 and counts["search_failures"] > self.search_failure_rate * counts["searches"]
        self.failed_search_steps = self.failed_search_steps + 1 if failing else 0
        if self.max_failed_search_steps and self.failed_search_steps >= self.max_failed_search_steps:
            raise RetrieverUnavailableError(
                f"the retriever failed more than {self.search_failure_rate:.0%} of the searches in "
                f"{self.failed_search_steps} steps in a row (rollout.search_failure_rate, "
                f"rollout.max_failed_search_steps); last error: {last_error}")

    def count_updates(self, skipped_u: np.ndarray) -> None:
        """Counts a step's skipped updates (`skipped_u`: 1 where update u was skipped, in order)."""
        skipped_u = np.asarray(skipped_u).astype(bool)
        self.step_all_skipped = len(skipped_u) if skipped_u.size and skipped_u.all() else 0
        if skipped_u.all():
            self.skipped_updates += len(skipped_u)
        else:
            self.skipped_updates = len(skipped_u) - 1 - int(np.flatnonzero(~skipped_u)[-1])

    def check_updates(self, params, step: int) -> None:
        """Raises NonFiniteError once `max_skipped_updates` updates in a row were skipped, or every update of `step`
        (the last counted by `count_updates`) was; nothing of the step may be saved after it."""
        if not self.max_skipped_updates or (self.skipped_updates < self.max_skipped_updates
                                            and not self.step_all_skipped):
            return
        where = first_nonfinite(params)
        found = (f"the parameter {where} holds non-finite values" if where is not None
                 else "every parameter is finite: the loss or its gradient is not")
        if self.skipped_updates < self.max_skipped_updates:
            raise NonFiniteError(f"every update of step {step} ({self.step_all_skipped}) was skipped for a "
                                 f"non-finite loss or gradient; {found}; step {step} is not saved")
        raise NonFiniteError(f"{self.skipped_updates} updates in a row were skipped for a non-finite loss or "
                             f"gradient (optim.max_skipped_updates={self.max_skipped_updates}); {found}")
