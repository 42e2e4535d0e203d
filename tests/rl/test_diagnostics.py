"""LLD diagnostics against NumPy loops over trajectories and actions."""
import jax
import jax.numpy as jnp
import numpy as np

from llds_jax.config.sections import LLDSConfig, ObjectiveConfig
from llds_jax.rl.diagnostics import importance_ess, likelihood_metrics, lld_metrics, update_metrics
from llds_jax.rl.llds import action_ids_from_loss_mask
from llds_jax.rl.terms import LossInputs


def test_likelihood_metrics(make_rollout):
    roll = make_rollout(5, 12, 24, 50)
    rng = np.random.default_rng(0)
    m = roll.loss_mask_bt
    old = -rng.uniform(0.1, 3.0, m.shape)
    sampler = old + rng.normal(0, 0.1, m.shape)
    correct = roll.rewards_b > 0
    ids = np.asarray(action_ids_from_loss_mask(jnp.asarray(m)))
    got = jax.jit(likelihood_metrics)(old, m, ids, correct, sampler)

    sums = [(old[b] * m[b]).sum() for b in range(12)]
    means = [(old[b] * m[b]).sum() / m[b].sum() for b in range(12)]
    first = [old[b][(ids[b] == 0)].mean() for b in range(12)]
    later = [old[b][ids[b] > 0].mean() for b in range(12) if (ids[b] > 0).any()]
    assert 0 < len(later) < 12 and 0 < correct.sum() < 12
    want = {
        "lld/logp_sum_correct": np.mean([s for s, c in zip(sums, correct) if c]),
        "lld/logp_sum_incorrect": np.mean([s for s, c in zip(sums, correct) if not c]),
        "lld/logp_mean_correct": np.mean([s for s, c in zip(means, correct) if c]),
        "lld/logp_mean_incorrect": np.mean([s for s, c in zip(means, correct) if not c]),
        "lld/logp_mean_first_action": np.mean(first),
        "lld/logp_mean_later_actions": np.mean(later),
        "lld/sampler_gap": ((old - sampler) * m).sum() / m.sum(),
        "lld/sampler_abs_gap": (np.abs(old - sampler) * m).sum() / m.sum(),
        "lld/is_ess": ess_oracle(old - sampler, m),
    }
    assert set(got) == set(want)
    for key, value in want.items():
        np.testing.assert_allclose(float(got[key]), value, rtol=1e-5, err_msg=key)


def ess_oracle(log_w_bt, mask_bt):
    """(sum w)^2 / (N sum w^2) over the masked tokens, in float64."""
    w = np.exp(np.asarray(log_w_bt, np.float64)[np.asarray(mask_bt) > 0])
    return w.sum() ** 2 / (len(w) * (w ** 2).sum())


def test_importance_ess_against_numpy():
    rng = np.random.default_rng(3)
    mask = (rng.uniform(size=(6, 40)) < 0.6).astype(np.float32)
    for scale in (0.0, 0.05, 1.0, 4.0):
        log_w = rng.normal(0, scale, mask.shape).astype(np.float32)
        got = float(jax.jit(importance_ess)(log_w, mask))
        np.testing.assert_allclose(got, ess_oracle(log_w, mask), rtol=1e-5, err_msg=str(scale))
    assert float(importance_ess(np.zeros((2, 3), np.float32), np.ones((2, 3)))) == 1.0  # equal weights
    # One token carries all the weight: 1/N. Huge log-weights do not overflow; masked-out ones do not count.
    log_w = np.array([[400.0, 0.0, 0.0, 900.0]], np.float32)
    assert float(importance_ess(log_w, np.array([[1, 1, 1, 0]]))) == np.float32(1 / 3)


def test_lld_rate_counts_strict_decreases_and_ties_apart():
    m = np.array([[0, 1, 1, 0], [0, 1, 0, 1], [0, 0, 1, 1], [0, 1, 1, 1]], np.float32)
    old = np.full((4, 4), -1.0, np.float32)
    new = old + np.array([[9, 0.5, 0.2, 9], [0, -0.5, 9, 0.1], [0, 0, -0.1, 0.1], [0, 0.3, 0.3, 0.3]], np.float32)
    correct = np.array([True, True, True, False])
    delta_b, got = lld_metrics(new, old, m, correct)
    np.testing.assert_allclose(np.asarray(delta_b), [0.7, -0.4, 0.0, 0.9], atol=1e-6)
    np.testing.assert_allclose(float(got["lld/delta_traj_correct"]), 0.1, atol=1e-6)
    np.testing.assert_allclose(float(got["lld/rate"]), 1 / 3, rtol=1e-6)  # Delta < 0 for 1 of 3 correct: a tie is
    np.testing.assert_allclose(float(got["lld/tie_share"]), 1 / 3, rtol=1e-6)  # not a displacement, it has its share


def test_gate_share_and_preserved_delta():
    # Row 0 (A = 1): action 0 net -0.4, action 1 net +0.2. Row 1 (A = -1): ignored. Row 2 (A = 0): one action +0.3.
    m = np.array([[0, 1, 1, 0, 1, 1], [0, 1, 1, 0, 0, 0], [0, 0, 1, 1, 0, 0]], np.float32)
    delta = np.array([[0, -0.5, 0.1, 0, 0.3, -0.1], [0, 1, 1, 0, 0, 0], [0, 0, 0.2, 0.1, 0, 0]], np.float32)
    logp = np.full(m.shape, -1.0, np.float32)
    inputs = LossInputs(logp_bt=logp, entropy_bt=np.ones_like(m), old_logp_bt=logp + delta, ref_logp_bt=logp,
                        advantages_b=np.array([1.0, -1.0, 0.0], np.float32), loss_mask_bt=m,
                        action_ids_bt=action_ids_from_loss_mask(m), answer_mask_bt=np.zeros_like(m))
    got = update_metrics(inputs, ObjectiveConfig())
    np.testing.assert_allclose(float(got["llds/gate_share"]), 2 / 3, rtol=1e-6)  # 2 of 3 preserved actions fired
    np.testing.assert_allclose(float(got["llds/preserved_delta"]), 0.1 / 6, rtol=1e-5)
    np.testing.assert_allclose(float(got["actor/approx_kl"]), (0.1 + 2.0) / 8, rtol=1e-5)
    token_gate = update_metrics(inputs, ObjectiveConfig(llds=LLDSConfig(gate="token")))
    assert float(token_gate["llds/gate_share"]) == 1.0
