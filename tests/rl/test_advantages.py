"""GRPO group advantages against a per-group NumPy loop written from the spec."""
import jax
import numpy as np

from llds_jax.rl.advantages import ADVANTAGES, grpo_advantages, tree_grpo_advantages


def reference_advantages(rewards, uids):
    """Per group: (r - mean) / (std_unbiased + 1e-6); a group of one gets mean 0, std 1."""
    out = np.zeros(len(rewards))
    for uid in set(uids.tolist()):
        idx = np.flatnonzero(uids == uid)
        r = rewards[idx]
        mean, std = (0.0, 1.0) if len(r) == 1 else (r.mean(), r.std(ddof=1))
        out[idx] = (r - mean) / (std + 1e-6)
    return out


def test_matches_reference_on_mixed_groups_inside_jit():
    rng = np.random.default_rng(0)
    # Non-contiguous, unsorted, large uids; groups of 5, 3, 1 (singleton), 4 with all-equal rewards, 2.
    uids = np.array([907, 12, 907, 5, 12, 907, 40, 40, 12, 907, 40, 40, 907, 3, 3])
    rewards = rng.integers(0, 2, len(uids)).astype(np.float32)
    rewards[uids == 40] = 1.0
    rewards[uids == 3] = [0.3, 0.9]
    got = jax.jit(grpo_advantages)(rewards, uids)
    want = reference_advantages(rewards, uids)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(got)[uids == 40] == 0.0)  # all-equal group: A = 0 (preserved by LLDS)
    np.testing.assert_allclose(np.asarray(got)[uids == 5], rewards[uids == 5] / (1 + 1e-6))  # singleton


def test_uses_unbiased_std():
    got = np.asarray(grpo_advantages(np.array([0.0, 1.0]), np.array([0, 0])))
    # ddof=1: std = 0.7071 -> A = +-0.7071; ddof=0 would give +-1.
    np.testing.assert_allclose(got, [-np.sqrt(0.5), np.sqrt(0.5)], rtol=1e-5)


def reference_tree_advantages(rewards, prompts, trees):
    """Tree-GRPO, written from docs/tree-rollouts.md: the GRPO advantage over the prompt's leaves plus, within each
    tree of two or more leaves, (r - mean) / (std_unbiased + 1e-6) over that tree's leaves."""
    intra = np.zeros(len(rewards))
    for tree in set(trees.tolist()):
        idx = np.flatnonzero(trees == tree)
        if len(idx) > 1:
            r = rewards[idx]
            intra[idx] = (r - r.mean()) / (r.std(ddof=1) + 1e-6)
    return reference_advantages(rewards, prompts) + intra


# Two prompts of 2 trees x (1 + 1 x 2) leaves each (Tree-GRPO's M = 2, L = 1, N = 2): a leaf list in tree order.
TREE_PROMPTS = np.repeat([70, 3], 6)
TREE_IDS = np.repeat([0, 1, 2, 3], 3)
TREE_REWARDS = np.array([1, 0, 0, 1, 1, 1, 0, 0, 0, 1, 0, 1], np.float32)


def test_tree_advantages_match_the_oracle_on_hand_built_trees():
    got = np.asarray(jax.jit(tree_grpo_advantages)(TREE_REWARDS, TREE_PROMPTS, TREE_IDS))
    np.testing.assert_allclose(got, reference_tree_advantages(TREE_REWARDS, TREE_PROMPTS, TREE_IDS), rtol=1e-5,
                               atol=1e-5)
    # Hand values, prompt 70: rewards 1 0 0 | 1 1 1 (mean 2/3, std sqrt(4/15)); tree 0: mean 1/3, std sqrt(1/3);
    # tree 1 all equal: intra 0. The first leaf: (1 - 2/3) / sqrt(4/15) + (1 - 1/3) / sqrt(1/3) = 0.6455 + 1.1547.
    np.testing.assert_allclose(got[0], (1 / 3) / np.sqrt(4 / 15) + (2 / 3) / np.sqrt(1 / 3), rtol=1e-5)
    np.testing.assert_allclose(got[3:6], (1 / 3) / np.sqrt(4 / 15), rtol=1e-5)


def test_tree_advantages_equal_the_released_codes_sum_on_trees_of_several_leaves():
    """AMAP-ML/Tree-GRPO's `tree` estimator: its GRPO over the prompt plus its GRPO over the tree (both with the
    group-of-one rule mean 0, std 1). With every tree of two or more leaves the rule never applies to trees."""
    released = reference_advantages(TREE_REWARDS, TREE_PROMPTS) + reference_advantages(TREE_REWARDS, TREE_IDS)
    np.testing.assert_allclose(np.asarray(tree_grpo_advantages(TREE_REWARDS, TREE_PROMPTS, TREE_IDS)), released,
                               rtol=1e-5, atol=1e-5)


def test_chains_as_trees_of_one_leaf_get_grpo_advantages_bitwise():
    rng = np.random.default_rng(1)
    prompts = np.repeat(np.arange(16), 5)
    rewards = rng.integers(0, 2, len(prompts)).astype(np.float32)
    chains = np.arange(len(prompts))
    tree = jax.jit(tree_grpo_advantages)(rewards, prompts, chains)
    np.testing.assert_array_equal(np.asarray(tree), np.asarray(jax.jit(grpo_advantages)(rewards, prompts)))
    for name in ADVANTAGES.names():
        np.testing.assert_array_equal(np.asarray(jax.jit(ADVANTAGES[name])(rewards, prompts, chains)), np.asarray(tree),
                                      err_msg=name)
