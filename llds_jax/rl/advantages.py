"""GRPO outcome advantages: rewards normalized within each prompt's group of samples.

`A_i = (r_i - mean(r)) / (std(r) + eps)` per group, with the unbiased std (ddof = 1, like `torch.std`); a group of one
sample gets mean 0 and std 1. Vectorized with segment sums, so it runs inside `jit` on any group-id values.
"""
import jax
import jax.numpy as jnp

GRPO_EPS = 1e-6


def grpo_advantages(rewards_b: jax.Array, group_ids_b: jax.Array, eps: float = GRPO_EPS) -> jax.Array:
    """Group-normalized advantages, one per trajectory.

    Args:
      rewards_b: [B] outcome rewards (e.g. exact match, 0/1).
      group_ids_b: [B] integer id of each trajectory's prompt (the per-prompt uid); any values, any order.
      eps: added to the std (1e-6 in the reference code).

    Returns:
      [B] float32 advantages; broadcast them to every token of their trajectory.
    """
    rewards_b = jnp.asarray(rewards_b, jnp.float32)
    group_ids_b = jnp.asarray(group_ids_b)
    if rewards_b.ndim != 1 or rewards_b.shape != group_ids_b.shape:
        raise ValueError(
            f"rewards_b and group_ids_b must both be [B]; got {rewards_b.shape} and {group_ids_b.shape}")
    num = rewards_b.shape[0]
    # Dense group index in [0, B): valid inside jit because the number of distinct ids is at most B.
    _, group_b = jnp.unique(group_ids_b, size=num, return_inverse=True)
    group_b = group_b.reshape(num)
    count_g = jax.ops.segment_sum(jnp.ones_like(rewards_b), group_b, num_segments=num)
    mean_g = jax.ops.segment_sum(rewards_b, group_b, num_segments=num) / jnp.maximum(count_g, 1.0)
    sq_dev_b = (rewards_b - mean_g[group_b]) ** 2
    var_g = jax.ops.segment_sum(sq_dev_b, group_b, num_segments=num) / jnp.maximum(count_g - 1.0, 1.0)
    singleton_b = count_g[group_b] < 2
    mean_b = jnp.where(singleton_b, 0.0, mean_g[group_b])
    std_b = jnp.where(singleton_b, 1.0, jnp.sqrt(var_g[group_b]))
    return (rewards_b - mean_b) / (std_b + eps)
