"""The rewards the trainer computes from a list (tunix's `reward_fns`): a new reward is one function passed as
`Trainer(cfg, reward_fns=(*DEFAULT_REWARD_FNS, my_reward))`; exact match alone is the default.

A `RewardFn` maps this host's trajectories of a step and the run's `reward` config section to [B] float32 rewards,
one per trajectory, named by its `__name__`. Several are summed: a trajectory's reward is the sum of the functions'
rewards (what the advantages normalize, `reward/mean` its batch mean); with more than one, each function's batch
mean is also logged as `reward/<name>`.
Evaluations score exact match whatever the training rewards (`eval/em_*`, llds_jax.train.evaluation): the
paper's metric, comparable across runs.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import ml_collections
import numpy as np

from llds_jax.rollout.trajectory import Trajectory, em_rewards

RewardFn = Callable[[Sequence[Trajectory], ml_collections.ConfigDict], np.ndarray]


def exact_match(trajectories: Sequence[Trajectory], reward_cfg: ml_collections.ConfigDict) -> np.ndarray:
    """[B] exact match (0 or 1) of each trajectory's final answer against its gold answers (`em_rewards`, with
    `reward.empty_answer`)."""
    return em_rewards(trajectories, reward_cfg.empty_answer)


DEFAULT_REWARD_FNS: tuple[RewardFn, ...] = (exact_match,)


def summed_rewards(reward_fns: Sequence[RewardFn], trajectories: Sequence[Trajectory],
                   reward_cfg: ml_collections.ConfigDict) -> tuple[np.ndarray, dict[str, float]]:
    """([B] float32 sum of the `reward_fns`' rewards, each function's batch mean by name when there are several;
    else {})."""
    if not reward_fns:
        raise ValueError("the trainer needs at least one reward function")
    rewards = {fn.__name__: np.asarray(fn(trajectories, reward_cfg), np.float32) for fn in reward_fns}
    if len(rewards) != len(reward_fns):
        raise ValueError(f"reward functions need distinct names, got {[fn.__name__ for fn in reward_fns]}")
    for name, rewards_b in rewards.items():
        if rewards_b.shape != (len(trajectories),):
            raise ValueError(f"reward {name!r} gave shape {rewards_b.shape} for {len(trajectories)} trajectories")
    total_b = np.sum(list(rewards.values()), axis=0, dtype=np.float32)
    means = {name: float(np.mean(r, dtype=np.float64)) for name, r in rewards.items()} if len(rewards) > 1 else {}
    return total_b, means
