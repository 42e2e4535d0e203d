"""Outcome advantages: rewards normalized within groups of trajectories (`objective.advantages`).

GRPO (`grpo_advantages`): `A_i = (r_i - mean(r)) / (std(r) + eps)` over the group of prompt i's samples, with the
unbiased std (ddof = 1, like `torch.std`); a group of one sample gets mean 0 and std 1 (the reference code's rule).

Tree-GRPO (`tree_grpo_advantages`, Ji et al., arXiv 2509.21240; docs/tree-rollouts.md): the leaves of a prompt's
trees are its group; each leaf gets the GRPO advantage over all of the prompt's leaves (inter-tree) plus the
same normalization over the leaves of its own tree (intra-tree), as the released code's `tree` estimator adds them
(verl/trainer/ppo/ray_trainer_ts.py at AMAP-ML/Tree-GRPO 90b1709). One rule differs, for trees of a single leaf
(chains): their intra-tree advantage is 0 here, where the released code's group-of-one rule gives r / (1 + eps). A
tree of one leaf compares nothing with nothing, and with this rule chains (every trajectory its own tree) get GRPO's
advantages exactly; every tree of a tree rollout with at least one expansion has two or more leaves, where the two
agree.

Vectorized with segment sums, so they run inside `jit` on any id values.
"""
from collections.abc import Callable

import jax
import jax.numpy as jnp

from llds_jax.registry import Registry

GRPO_EPS = 1e-6
ADVANTAGES: Registry[Callable[[jax.Array, jax.Array, jax.Array], jax.Array]] = Registry("objective.advantages")
"""`objective.advantages` -> `fn(rewards_b, group_ids_b, tree_ids_b) -> advantages_b`."""


def _normalized(rewards_b: jax.Array, ids_b: jax.Array, eps: float, zero_singletons: bool) -> jax.Array:
    """`(r - mean) / (std + eps)` within each id's group (unbiased std). A group of one: 0 with `zero_singletons`,
    else mean 0 and std 1 (r / (1 + eps))."""
    num = rewards_b.shape[0]
    # Dense group index in [0, B): valid inside jit because the number of distinct ids is at most B.
    _, group_b = jnp.unique(ids_b, size=num, return_inverse=True)
    group_b = group_b.reshape(num)  # per-group arrays `_e`: E groups, at most B
    count_e = jax.ops.segment_sum(jnp.ones_like(rewards_b), group_b, num_segments=num)
    mean_e = jax.ops.segment_sum(rewards_b, group_b, num_segments=num) / jnp.maximum(count_e, 1.0)
    sq_dev_b = (rewards_b - mean_e[group_b]) ** 2
    var_e = jax.ops.segment_sum(sq_dev_b, group_b, num_segments=num) / jnp.maximum(count_e - 1.0, 1.0)
    singleton_b = count_e[group_b] < 2
    mean_b = jnp.where(singleton_b, 0.0, mean_e[group_b])
    std_b = jnp.where(singleton_b, 1.0, jnp.sqrt(var_e[group_b]))
    normalized_b = (rewards_b - mean_b) / (std_b + eps)
    return jnp.where(singleton_b, 0.0, normalized_b) if zero_singletons else normalized_b


def _checked(rewards_b, *ids_b) -> tuple[jax.Array, ...]:
    rewards_b = jnp.asarray(rewards_b, jnp.float32)
    ids_b = tuple(jnp.asarray(ids) for ids in ids_b)
    if rewards_b.ndim != 1 or any(ids.shape != rewards_b.shape for ids in ids_b):
        raise ValueError(f"rewards and ids must all be [B]; got {rewards_b.shape} and "
                         f"{', '.join(str(ids.shape) for ids in ids_b)}")
    return (rewards_b, *ids_b)


def grpo_advantages(rewards_b: jax.Array, group_ids_b: jax.Array, eps: float = GRPO_EPS) -> jax.Array:
    """Group-normalized advantages, one per trajectory.

    Args:
      rewards_b: [B] outcome rewards (e.g. exact match, 0/1).
      group_ids_b: [B] integer id of each trajectory's prompt (the per-prompt uid); any values, any order.
      eps: added to the std (1e-6 in the reference code).

    Returns:
      [B] float32 advantages; broadcast them to every token of their trajectory.
    """
    rewards_b, group_ids_b = _checked(rewards_b, group_ids_b)
    return _normalized(rewards_b, group_ids_b, eps, zero_singletons=False)


@ADVANTAGES.register("grpo")
def _grpo(rewards_b: jax.Array, group_ids_b: jax.Array, tree_ids_b: jax.Array) -> jax.Array:
    """GRPO over the prompts' groups; the tree ids play no part."""
    del tree_ids_b
    return grpo_advantages(rewards_b, group_ids_b)


@ADVANTAGES.register("tree_grpo")
def tree_grpo_advantages(rewards_b: jax.Array, group_ids_b: jax.Array, tree_ids_b: jax.Array,
                         eps: float = GRPO_EPS) -> jax.Array:
    """Tree-GRPO's advantages (module docstring): inter-tree (GRPO over the prompt's group) plus intra-tree (over
    the leaves of each tree; 0 for a tree of one leaf).

    Args:
      rewards_b: [B] outcome rewards of the leaves.
      group_ids_b: [B] the prompt of each leaf.
      tree_ids_b: [B] the tree of each leaf, unique over the batch (not only within a prompt).
      eps: added to both stds.

    Returns:
      [B] float32 advantages.
    """
    rewards_b, group_ids_b, tree_ids_b = _checked(rewards_b, group_ids_b, tree_ids_b)
    return (_normalized(rewards_b, group_ids_b, eps, zero_singletons=False)
            + _normalized(rewards_b, tree_ids_b, eps, zero_singletons=True))
