"""The study's statistics: a bootstrap interval of a mean over seeds, and the collapse rule.

Collapse (a definition, not the paper's: the paper reads collapse off its curves): a run collapsed when its training
reward (`reward/mean`, the share of correct trajectories of a step's rollout batch) is below 0.1 on 3 consecutive
steps, or when its final greedy test EM is below 0.05. Its step of collapse is the first of the first such 3 steps
(None when only the final EM says it collapsed).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

BOOTSTRAP_SEED = 0          # the interval of the same values is the same on every call
BOOTSTRAP_RESAMPLES = 10_000
COLLAPSE_REWARD = 0.1       # train reward/mean below this ...
COLLAPSE_STEPS = 3          # ... on this many consecutive steps
COLLAPSE_EM = 0.05          # or a final greedy test EM below this


def bootstrap_interval(values: Sequence[float], confidence: float = 0.95, resamples: int = BOOTSTRAP_RESAMPLES,
                       seed: int = BOOTSTRAP_SEED) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of `values` (e.g. one final EM per seed): `resamples` draws of
    len(values) values with replacement (numpy's default_rng(seed)), the (1 - confidence) / 2 and
    (1 + confidence) / 2 quantiles of their means. One value v gives (v, v)."""
    values_n = np.asarray(values, dtype=np.float64)
    if values_n.ndim != 1 or values_n.size == 0:
        raise ValueError(f"bootstrap_interval needs a non-empty list of numbers, got {values!r}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    rng = np.random.default_rng(seed)
    means_r = values_n[rng.integers(0, values_n.size, size=(resamples, values_n.size))].mean(axis=1)
    low, high = np.quantile(means_r, [(1 - confidence) / 2, (1 + confidence) / 2])
    return float(low), float(high)


def collapse_step(steps: Sequence[int], rewards: Sequence[float], threshold: float = COLLAPSE_REWARD,
                  consecutive: int = COLLAPSE_STEPS) -> int | None:
    """The first step of the first `consecutive` consecutive steps (step numbers k, k+1, ...) whose reward is below
    `threshold`; None when there is no such run of steps. `steps` ascending, one reward each."""
    if len(steps) != len(rewards):
        raise ValueError(f"collapse_step: {len(steps)} steps but {len(rewards)} rewards")
    first, length, previous = None, 0, None
    for step, reward in zip(steps, rewards):
        if reward < threshold:
            if length and step == previous + 1:
                length += 1
            else:
                first, length = step, 1
            if length >= consecutive:
                return first
        else:
            length = 0
        previous = step
    return None


def collapsed(step: int | None, final_em: float, em_threshold: float = COLLAPSE_EM) -> bool:
    """The collapse rule: a collapse step (from `collapse_step`) or a final greedy test EM below `em_threshold`."""
    return step is not None or final_em < em_threshold
