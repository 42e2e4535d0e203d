"""The per-micro-batch objective against an independent NumPy implementation of docs/method.md.

The NumPy oracle below is written from the spec with explicit loops over rows and actions; it calls none of our code.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from llds_jax.model import Transformer
from llds_jax.bounds import ConfigError
from llds_jax.config.sections import LLDSConfig, ObjectiveConfig
from llds_jax.rl.llds import action_ids_from_loss_mask, answer_beta, llds_batch_statistics, llds_loss
from llds_jax.rl.logprobs import model_token_logp
from llds_jax.rl.losses import objective_loss
from llds_jax.rl.terms import LOSS_TERMS, LossInputs, batch_statistics, register_loss_term

# ----------------------------------------------------------------------------------------------------------------------
# NumPy oracle, from the spec.


def np_actions(loss_mask):
    """Per row, the list of actions: each a list of token positions of one maximal run of m = 1."""
    rows = []
    for m_t in loss_mask:
        actions, current = [], []
        for t, m in enumerate(m_t):
            if m > 0:
                current.append(t)
            elif current:
                actions.append(current)
                current = []
        if current:
            actions.append(current)
        rows.append(actions)
    return rows


def np_mean_m(x, m, aggregation):
    if aggregation == "token-mean":
        return (x * m).sum() / m.sum()
    seq = [(x[b] * m[b]).sum() / m[b].sum() for b in range(len(m)) if m[b].sum() > 0]
    return float(np.mean(seq))


def np_gate(gate, delta, m, adv):
    g = np.zeros_like(delta)
    for b, actions in enumerate(np_actions(m)):
        if adv[b] < 0:
            continue
        if gate == "token":
            g[b] = m[b]
        elif gate == "response":
            if (delta[b] * m[b]).sum() > 0:
                g[b] = m[b]
        else:
            for action in actions:
                if delta[b, action].sum() > 0:
                    g[b, action] = 1.0
    return g


def np_weight(llds, answer, mean_searches):
    lam = llds.lam
    if llds.answer_weighting == "none":
        return np.full(answer.shape, lam)
    beta = {
        "fixed": llds.answer_beta,
        "adaptive": llds.adaptive_c * max(mean_searches - 1.0, 0.0),
        "adaptive_paper": min(mean_searches / 2.0, 1.0) * lam,
    }[llds.answer_weighting]
    return np.where(answer > 0, min(beta, lam), lam)


def np_objective(cfg, logp, ent, old, ref, adv, m, answer, mean_searches):
    """Returns (total, {term: value})."""
    a = adv[:, None]
    rho = np.minimum(np.exp(logp - old), cfg.ratio_cap)
    pg_t = np.maximum(-a * rho, -a * np.clip(rho, 1 - cfg.clip_ratio, 1 + cfg.clip_ratio))
    if cfg.kl_estimator == "k1":
        kl_t = logp - ref
    elif cfg.kl_estimator == "abs":
        kl_t = np.abs(logp - ref)
    elif cfg.kl_estimator == "mse":
        kl_t = 0.5 * (logp - ref) ** 2
    else:
        d = ref - logp
        kl_t = np.clip(np.exp(d) - d - 1, -cfg.kl_clamp, cfg.kl_clamp)
    delta = old - logp
    g = np_gate(cfg.llds.gate, delta, m, adv)
    w = np_weight(cfg.llds, answer, mean_searches)
    terms = {
        "policy": np_mean_m(pg_t, m, cfg.aggregation),
        "entropy": np_mean_m(ent, m, cfg.aggregation),
        "kl": np_mean_m(kl_t, m, cfg.aggregation),
        "llds": np_mean_m(g * w * np.maximum(0.0, delta), m, cfg.aggregation),
    }
    total = terms["policy"] - cfg.entropy_coef * terms["entropy"] + cfg.kl_coef * terms["kl"]
    if cfg.llds.enabled:
        total += terms["llds"]
    return total, terms


# ----------------------------------------------------------------------------------------------------------------------


def random_inputs(make_rollout, seed=0, batch=6, time=20):
    """Float64 arrays of a random micro-batch: several actions per row, observation gaps, padding, A of every sign,
    one ratio above the cap and one k3 value above the clamp."""
    roll = make_rollout(seed, batch, time, 50)
    rng = np.random.default_rng(seed + 1)
    m = roll.loss_mask_bt.astype(np.float64)
    old = -rng.uniform(0.05, 3.0, (batch, time))
    logp = old + rng.normal(0.0, 0.3, (batch, time))
    ref = logp + rng.normal(0.0, 0.3, (batch, time))
    adv = np.array([1.2, 0.0, -0.7, 0.5, -1.3, 0.0])[:batch]
    t0 = np.flatnonzero(m[2])[0]
    logp[2, t0] = old[2, t0] + 6.0        # ratio e^6 > 100 where A < 0 (the unclipped branch): capped
    t1 = np.flatnonzero(m[-1])[-1]
    ref[-1, t1] = logp[-1, t1] + 15.0     # k3 = e^15 - 16 > 10: clamped
    ent = rng.uniform(0.0, 4.0, (batch, time))
    assert len({len(a) for a in np_actions(m)} - {0}) > 1  # rows with different numbers of actions
    return dict(logp=logp, ent=ent, old=old, ref=ref, adv=adv, m=m, answer=roll.answer_mask_bt.astype(np.float64),
                mean_searches=float(roll.search_count_b.mean()))


def to_loss_inputs(x, cfg, logp=None, mean_searches=None):
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    mean_searches = x["mean_searches"] if mean_searches is None else mean_searches
    return LossInputs(
        logp_bt=f32(x["logp"]) if logp is None else logp, entropy_bt=f32(x["ent"]), old_logp_bt=f32(x["old"]),
        ref_logp_bt=f32(x["ref"]), advantages_b=f32(x["adv"]), loss_mask_bt=f32(x["m"]),
        action_ids_bt=action_ids_from_loss_mask(jnp.asarray(x["m"])), answer_mask_bt=f32(x["answer"]),
        batch_stats={"answer_beta": answer_beta(cfg.llds, mean_searches)})


CASES = {
    "default": ObjectiveConfig(),
    "gate_response": ObjectiveConfig(llds=LLDSConfig(gate="response")),
    "gate_token": ObjectiveConfig(llds=LLDSConfig(gate="token")),
    "kl_k1": ObjectiveConfig(kl_estimator="k1"),
    "kl_abs": ObjectiveConfig(kl_estimator="abs"),
    "kl_mse": ObjectiveConfig(kl_estimator="mse"),
    "seq_mean_ma_fixed": ObjectiveConfig(aggregation="seq-mean-token-mean",
                                         llds=LLDSConfig(answer_weighting="fixed", answer_beta=0.05)),
    "ma_adaptive": ObjectiveConfig(llds=LLDSConfig(answer_weighting="adaptive", lam=0.3)),
    "ma_adaptive_paper": ObjectiveConfig(llds=LLDSConfig(answer_weighting="adaptive_paper")),
    "coefficients_no_llds": ObjectiveConfig(clip_ratio=0.3, entropy_coef=0.01, kl_coef=0.05,
                                            llds=LLDSConfig(enabled=False)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_objective_matches_numpy_oracle(case, make_rollout):
    cfg = CASES[case]
    x = random_inputs(make_rollout)
    want_total, want_terms = np_objective(cfg, x["logp"], x["ent"], x["old"], x["ref"], x["adv"], x["m"],
                                          x["answer"], x["mean_searches"])
    total, terms = jax.jit(objective_loss, static_argnums=1)(to_loss_inputs(x, cfg), cfg)
    np.testing.assert_allclose(float(total), want_total, atol=1e-5, rtol=1e-5)
    for name, value in terms.items():
        np.testing.assert_allclose(float(value), want_terms[name], atol=1e-5, rtol=1e-5, err_msg=name)
    assert want_terms["llds"] > 0 or not cfg.llds.enabled  # the LLDS path is exercised


@pytest.mark.parametrize("mean_searches, beta", [(1.0, 0.0), (1.5, 0.1), (3.0, 0.4)])
def test_adaptive_beta_code_formula(mean_searches, beta):
    cfg = LLDSConfig(answer_weighting="adaptive")
    np.testing.assert_allclose(float(answer_beta(cfg, mean_searches)), beta, rtol=1e-6)
    np.testing.assert_allclose(float(answer_beta(dataclasses.replace(cfg, answer_weighting="adaptive_paper"),
                                                 mean_searches)), min(mean_searches / 2, 1) * 0.2, rtol=1e-6)


def test_action_ids_are_the_maximal_runs_of_the_loss_mask(make_rollout):
    m = random_inputs(make_rollout)["m"]
    ids = np.asarray(action_ids_from_loss_mask(jnp.asarray(m)))
    want = np.full(m.shape, -1)
    for b, actions in enumerate(np_actions(m)):
        for a, positions in enumerate(actions):
            want[b, positions] = a
    np.testing.assert_array_equal(ids, want)


def test_llds_gradient_is_minus_w_over_sum_m_grad_logp_on_gated_tokens(tiny_model_cfg, make_rollout):
    """jax.grad of the LLDS term through a tiny model == -(w / sum m) grad logp summed over gated tokens with delta > 0,
    and d llds / d logp is exactly that coefficient on those tokens and 0 elsewhere."""
    cfg = ObjectiveConfig(llds=LLDSConfig(answer_weighting="fixed", answer_beta=0.05))
    roll = make_rollout(3, 6, 20, tiny_model_cfg.vocab_size)
    m = roll.loss_mask_bt.astype(np.float64)
    rng = np.random.default_rng(0)
    delta = rng.normal(0, 0.05, m.shape)  # old_logp = logp + delta
    x = dict(ent=np.zeros_like(m), ref=np.zeros_like(m), adv=np.array([1.0, 0.0, -1.0, 0.3, 0.0, -0.2]), m=m,
             answer=roll.answer_mask_bt, mean_searches=0.0)
    gate = np_gate("action", delta, m, x["adv"])
    coef_bt = -(np_weight(cfg.llds, x["answer"], 0.0) / m.sum()) * gate * (delta > 0)
    assert (coef_bt != 0).sum() >= 5 and ((gate > 0) & (delta < 0)).any()  # gated tokens of both signs present

    def llds_of(logp_bt):
        inputs = to_loss_inputs(dict(x, logp=logp_bt, old=logp_bt), cfg)
        return llds_loss(inputs._replace(logp_bt=logp_bt, old_logp_bt=jax.lax.stop_gradient(logp_bt) + delta), cfg)

    # d llds / d logp (any logp: the loss depends on it through delta only).
    d_logp = jax.grad(llds_of)(jnp.asarray(rng.normal(-2.0, 0.5, m.shape), jnp.float32))
    np.testing.assert_allclose(np.asarray(d_logp), coef_bt, atol=1e-7, rtol=1e-5)

    # d llds / d params through a tiny model == vjp of its logp with that coefficient.
    graphdef, params = nnx.split(Transformer(tiny_model_cfg, rngs=nnx.Rngs(1)))

    def logp_fn(p):
        return model_token_logp(nnx.merge(graphdef, p), roll.tokens_bt, roll.mask_bt, time_chunk=8)[0]

    @jax.jit
    def grads(p):
        return jax.grad(lambda q: llds_of(logp_fn(q)))(p), jax.vjp(logp_fn, p)[1](jnp.asarray(coef_bt, jnp.float32))[0]

    got, want = grads(params)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-6, rtol=1e-4)
    assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(got)) > 1e-4


# ----------------------------------------------------------------------------------------------------------------------
# Gate semantics on a hand-built micro-batch.
#
# row 0 (A = +1): action 0 deltas [-0.5, +0.2, -0.1] (net -0.4, one token lost likelihood), observation (delta +5,
#   m = 0), action 1 deltas [+0.3, -0.1] (net +0.2); trajectory net -0.2.
# row 1 (A = 0):  action 0 deltas [+0.4, -0.1] (net +0.3), action 1 deltas [-0.2, +0.1] (net -0.1); trajectory +0.2.
# row 2 (A = -1): deltas [+1, +1]: never preserved.
# sum(m) = 5 + 4 + 2 = 11.
T = 12
ROWS = {
    0: (1.0, {1: -0.5, 2: 0.2, 3: -0.1, 6: 0.3, 7: -0.1}, {4: 5.0, 5: 5.0}),
    1: (0.0, {1: 0.4, 2: -0.1, 5: -0.2, 6: 0.1}, {3: 5.0, 4: 5.0}),
    2: (-1.0, {1: 1.0, 2: 1.0}, {}),
}


def hand_built_inputs(cfg):
    m = np.zeros((3, T))
    delta = np.zeros((3, T))
    for row, (_, loss_tokens, observation) in ROWS.items():
        for t, d in loss_tokens.items():
            m[row, t], delta[row, t] = 1.0, d
        for t, d in observation.items():
            delta[row, t] = d
    delta[:, -1] = 3.0  # padding
    logp = np.full((3, T), -1.0)
    x = dict(logp=logp, ent=np.zeros((3, T)), old=logp + delta, ref=logp, m=m, answer=np.zeros((3, T)),
             adv=np.array([r[0] for r in ROWS.values()]), mean_searches=0.0)
    return x, to_loss_inputs(x, cfg)


def llds_and_grad(gate):
    cfg = ObjectiveConfig(llds=LLDSConfig(gate=gate))
    x, inputs = hand_built_inputs(cfg)
    value, grad = jax.value_and_grad(lambda lp: llds_loss(inputs._replace(logp_bt=lp), cfg))(inputs.logp_bt)
    return float(value), np.asarray(grad)


LAM, SUM_M = 0.2, 11.0


def test_action_gate_spares_an_action_with_net_negative_delta():
    value, grad = llds_and_grad("action")
    np.testing.assert_allclose(value, LAM * (0.3 + 0.4) / SUM_M, rtol=1e-6)
    assert grad[0, 2] == 0.0  # the +0.2 token of row 0's net-negative action is not penalized
    assert grad[1, 6] == 0.0  # nor the +0.1 token of row 1's net-negative action
    np.testing.assert_allclose(grad[0, 6], -LAM / SUM_M, rtol=1e-6)
    np.testing.assert_allclose(grad[1, 1], -LAM / SUM_M, rtol=1e-6)
    assert np.count_nonzero(grad) == 2


def test_token_gate_penalizes_every_token_that_lost_likelihood():
    value, grad = llds_and_grad("token")
    np.testing.assert_allclose(value, LAM * (0.2 + 0.3 + 0.4 + 0.1) / SUM_M, rtol=1e-6)
    np.testing.assert_allclose(grad[0, 2], -LAM / SUM_M, rtol=1e-6)
    assert np.count_nonzero(grad) == 4  # never observations, padding or the A < 0 row


def test_response_gate_follows_the_trajectory_sum():
    value, grad = llds_and_grad("response")
    np.testing.assert_allclose(value, LAM * (0.4 + 0.1) / SUM_M, rtol=1e-6)  # row 1 only (net +0.2); row 0 net -0.2
    assert np.count_nonzero(grad[0]) == 0
    np.testing.assert_allclose(grad[1, [1, 6]], -LAM / SUM_M, rtol=1e-6)  # incl. its net-negative action's token
    assert np.count_nonzero(grad) == 2


# ----------------------------------------------------------------------------------------------------------------------


def test_a_registered_variant_plugs_in_by_name(make_rollout):
    @register_loss_term("llds_times_three_test", batch_statistics=llds_batch_statistics)
    def tripled(inputs, cfg):
        return 3.0 * LOSS_TERMS["llds"](inputs, cfg)

    base = ObjectiveConfig()
    variant = ObjectiveConfig(llds=LLDSConfig(variant="llds_times_three_test"))
    x = random_inputs(make_rollout)
    base_total, base_terms = objective_loss(to_loss_inputs(x, base), base)
    total, terms = objective_loss(to_loss_inputs(x, variant), variant)
    np.testing.assert_allclose(float(total), float(base_total + 2 * base_terms["llds"]), rtol=1e-6)
    assert set(terms) == {"policy", "entropy", "kl", "llds_times_three_test"}
    with pytest.raises(ConfigError, match="objective.llds.variant must be one of .*got 'no_such_term'"):
        LOSS_TERMS["no_such_term"]
    assert batch_statistics(make_rollout(0, 4, 8, 50), variant) == batch_statistics(make_rollout(0, 4, 8, 50), base)


@pytest.mark.parametrize("llds_cfg, beta", [
    (LLDSConfig(answer_weighting="adaptive_paper", lam=0.2), 0.75 * 0.2),   # min(V / 2, 1) * lambda, V = 1.5
    (LLDSConfig(answer_weighting="adaptive", adaptive_c=0.1), 0.1 * 0.5),   # c * max(V - 1, 0)
    (LLDSConfig(answer_weighting="fixed", answer_beta=0.05), 0.05),
    (LLDSConfig(answer_weighting="none", lam=0.2), 0.2),
])
def test_llds_beta_comes_from_the_whole_batch_through_the_terms_hook(make_rollout, llds_cfg, beta):
    batch = dataclasses.replace(make_rollout(0, 4, 8, 50), search_count_b=np.array([0, 1, 2, 3], np.float32))
    stats = batch_statistics(batch, ObjectiveConfig(llds=llds_cfg))
    assert list(stats) == ["answer_beta"]
    np.testing.assert_allclose(stats["answer_beta"], beta, rtol=1e-6)
    assert batch_statistics(batch, ObjectiveConfig(llds=dataclasses.replace(llds_cfg, enabled=False))) == {}


@pytest.mark.parametrize("make, key", [
    (lambda: ObjectiveConfig(temperature=0.0), "rollout.temperature"),  # the run key it takes
    (lambda: LLDSConfig(lam=-0.1), "llds.lam"),
])
def test_config_errors_name_the_key(make, key):  # (names of implementations: tests/rl/test_registries.py)
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        make()


def test_defaults_are_the_code_exact_values():
    cfg = ObjectiveConfig()
    assert (cfg.clip_ratio, cfg.ratio_cap, cfg.entropy_coef, cfg.kl_coef, cfg.kl_estimator, cfg.kl_clamp,
            cfg.aggregation) == (0.2, 100.0, 0.001, 0.001, "low_var_kl", 10.0, "token-mean")
    assert (cfg.llds.enabled, cfg.llds.lam, cfg.llds.gate, cfg.llds.answer_weighting) == (True, 0.2, "action", "none")
