"""The training rewards, by name (tunix's `reward_fns`): `reward.functions` lists the names of `REWARDS`, a registry
(llds_jax.registry); a new reward is one function registered there (`@REWARDS.register("my_reward")`, e.g. in the
module of the application the config's `app` key names, which loads before the config is checked). Exact match
alone is the default.

A `RewardFn` maps this host's trajectories of a step and the run's `reward` config section to [B] float32 rewards,
one per trajectory. Several are summed: a trajectory's reward is the sum of the functions' rewards (what the
advantages normalize, `reward/mean` its batch mean); with more than one, each function's batch mean is also logged
as `reward/<name>`, its registered name.
Evaluations score exact match whatever the training rewards (`eval/em_*`, llds_jax.train.evaluation): the
paper's metric, comparable across runs.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from llds_jax.bounds import ConfigError
from llds_jax.config.sections import RewardConfig
from llds_jax.registry import Registry
from llds_jax.rollout.trajectory import Trajectory, em_rewards

RewardFn = Callable[[Sequence[Trajectory], RewardConfig], np.ndarray]
REWARDS: Registry[RewardFn] = Registry("reward.functions")


@REWARDS.register("exact_match")
def exact_match(trajectories: Sequence[Trajectory], reward_cfg: RewardConfig) -> np.ndarray:
    """[B] exact match (0 or 1) of each trajectory's final answer against its gold answers (`em_rewards`, with
    `reward.empty_answer`)."""
    return em_rewards(trajectories, reward_cfg.empty_answer)


def named_rewards(names: Sequence[str]) -> dict[str, RewardFn]:
    """The reward functions `names` (`reward.functions`) by name; ConfigError naming the key when there is none, a
    name is not registered or one repeats."""
    if not names:
        raise ConfigError("reward.functions names no reward function")
    if len(set(names)) != len(names):
        raise ConfigError(f"reward.functions names a function twice: {list(names)}")
    return {name: REWARDS[name] for name in names}


def summed_rewards(reward_fns: Mapping[str, RewardFn], trajectories: Sequence[Trajectory],
                   reward_cfg: RewardConfig) -> tuple[np.ndarray, dict[str, float]]:
    """([B] float32 sum of the rewards of `reward_fns` (name -> function, `named_rewards`), each function's batch
    mean by name when there are several; else {})."""
    rewards = {name: np.asarray(fn(trajectories, reward_cfg), np.float32) for name, fn in reward_fns.items()}
    for name, rewards_b in rewards.items():
        if rewards_b.shape != (len(trajectories),):
            raise ValueError(f"reward {name!r} gave shape {rewards_b.shape} for {len(trajectories)} trajectories")
    total_b = np.sum(list(rewards.values()), axis=0, dtype=np.float32)
    means = {name: float(np.mean(r, dtype=np.float64)) for name, r in rewards.items()} if len(rewards) > 1 else {}
    return total_b, means
