"""GRPO group advantages against a per-group NumPy loop written from the spec."""
import jax
import numpy as np

from llds_jax.rl.advantages import grpo_advantages


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
