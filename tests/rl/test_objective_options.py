"""Stability options of the GRPO objective against independent NumPy formulas: DAPO's clip-higher
(`objective.clip_ratio_high`) and verl's truncated importance sampling between sampler and trainer
(`objective.tis_cap`).

The NumPy oracle below is written from the formulas in float64, with its gradient derived by hand (and checked against
finite differences of its value); it calls none of our code.
"""
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from llds_jax import config as config_lib
from llds_jax.model import Transformer
from llds_jax.config.sections import ObjectiveConfig
from llds_jax.rl.diagnostics import update_metrics
from llds_jax.rl.llds import action_ids_from_loss_mask, answer_beta
from llds_jax.rl.losses import objective_loss, policy_loss, tis_weight
from llds_jax.rl.terms import AGGREGATIONS, LOSS_TERMS, LossInputs, aggregate
from llds_jax.rl.train_step import RLTrainStep

CLIP_HIGH, TIS_CAP = 0.28, 1.5
OPTIONS = {
    "clip_higher": dict(clip_ratio_high=CLIP_HIGH),
    "tis": dict(tis_cap=TIS_CAP),
    "both": dict(clip_ratio_high=CLIP_HIGH, tis_cap=TIS_CAP),
}

# ----------------------------------------------------------------------------------------------------------------------
# NumPy oracle, from the formulas.


def np_token_coefficients(m, aggregation):
    """c with `aggregate(x) = sum(c * x)`: m / sum(m) (token mean), or m / (count_b * rows with tokens)."""
    if aggregation == "token-mean":
        return m / m.sum()
    count_b = m.sum(axis=1, keepdims=True)
    return np.where(count_b > 0, m / np.maximum(count_b, 1.0), 0.0) / (count_b > 0).sum()


def np_policy(cfg, logp, old, sampler, adv, m):
    """(value, d value / d logp) of `aggregate(w * max(-A rho, -A clip(rho, 1 - eps, 1 + eps_high)))`, with
    rho = min(exp(logp - old), ratio_cap), eps_high = clip_ratio_high or clip_ratio, and
    w = min(exp(old - sampler), tis_cap) with tis_cap > 0, else 1 (w a constant)."""
    low = 1.0 - cfg.clip_ratio
    high = 1.0 + (cfg.clip_ratio_high if cfg.clip_ratio_high > 0 else cfg.clip_ratio)
    a = adv[:, None]
    raw = np.exp(logp - old)
    rho = np.minimum(raw, cfg.ratio_cap)
    d_rho = np.where(raw < cfg.ratio_cap, raw, 0.0)
    unclipped, clipped = -a * rho, -a * np.clip(rho, low, high)
    pg = np.maximum(unclipped, clipped)
    # Where the clipped branch is strictly larger, rho lies outside [low, high]: the clip is flat there.
    d_pg = np.where(unclipped >= clipped, -a * d_rho, 0.0)
    w = np.minimum(np.exp(old - sampler), cfg.tis_cap) if cfg.tis_cap > 0 else np.ones_like(logp)
    c = np_token_coefficients(m, cfg.aggregation)
    return float((c * w * pg).sum()), c * w * d_pg


# ----------------------------------------------------------------------------------------------------------------------


def random_inputs(make_rollout, seed=0, batch=6, time=20):
    """Float64 arrays (values representable in float32) of a random micro-batch: A of every sign, a row without loss
    tokens, the sampler's log-probs 0 off loss tokens, and tokens where each bound binds: a ratio between 1 + eps and
    1 + eps_high, ratios beyond both clips and beyond ratio_cap, importance weights above the cap, one whose exp
    overflows float32."""
    roll = make_rollout(seed, batch, time, 50)
    rng = np.random.default_rng(seed + 1)
    m = roll.loss_mask_bt.astype(np.float64)
    m[3] = 0.0
    old = -rng.uniform(0.05, 3.0, (batch, time))
    logp = old + rng.normal(0.0, 0.3, (batch, time))
    sampler = np.where(m > 0, old + rng.normal(0.0, 0.5, (batch, time)), 0.0)
    adv = np.array([1.2, 0.0, -0.7, 0.5, -1.3, 0.8])
    t0 = np.flatnonzero(m[0])
    logp[0, t0[0]] = old[0, t0[0]] + math.log(1.25)   # A > 0: clipped by the symmetric clip only
    logp[0, t0[1]] = old[0, t0[1]] + math.log(1.5)    # A > 0: clipped by both
    t2 = np.flatnonzero(m[2])
    logp[2, t2[0]] = old[2, t2[0]] + math.log(0.7)    # A < 0: clipped below
    logp[2, t2[-1]] = old[2, t2[-1]] + 6.0            # A < 0: ratio e^6 capped at 100
    t5 = np.flatnonzero(m[5])[0]
    sampler[5, t5] = old[5, t5] - 100.0               # exp(100) overflows float32: the weight is the cap
    x = dict(logp=logp, old=old, sampler=sampler, adv=adv, m=m, ref=logp + rng.normal(0.0, 0.3, (batch, time)),
             ent=rng.uniform(0.0, 4.0, (batch, time)), answer=roll.answer_mask_bt.astype(np.float64),
             mean_searches=float(roll.search_count_b.mean()))
    return {k: v.astype(np.float32).astype(np.float64) if isinstance(v, np.ndarray) else v for k, v in x.items()}


def to_loss_inputs(x, cfg, sampler=True):
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    return LossInputs(
        logp_bt=f32(x["logp"]), entropy_bt=f32(x["ent"]), old_logp_bt=f32(x["old"]), ref_logp_bt=f32(x["ref"]),
        advantages_b=f32(x["adv"]), loss_mask_bt=f32(x["m"]), action_ids_bt=action_ids_from_loss_mask(f32(x["m"])),
        answer_mask_bt=f32(x["answer"]), batch_stats={"answer_beta": answer_beta(cfg.llds, x["mean_searches"])},
        sampler_logp_bt=f32(x["sampler"]) if sampler else None)


def policy_value_and_grad(inputs, cfg):
    """The policy term and its gradient with respect to logp, jitted. (scalar, [B, T])."""
    return jax.jit(jax.value_and_grad(lambda logp_bt: policy_loss(inputs._replace(logp_bt=logp_bt), cfg)))(
        inputs.logp_bt)


def test_the_inputs_reach_every_bound(make_rollout):
    x = random_inputs(make_rollout)
    mask, a = x["m"] > 0, x["adv"][:, None]
    rho = np.exp(x["logp"] - x["old"])
    assert np.sum(mask & (a > 0) & (rho > 1.2) & (rho < 1 + CLIP_HIGH)) >= 1  # clip-higher changes these
    assert np.sum(mask & (a > 0) & (rho > 1 + CLIP_HIGH)) >= 1
    assert np.sum(mask & (a < 0) & (rho < 0.8)) >= 2
    assert np.sum(mask & (rho > 100)) == 1
    weight = np.exp(x["old"] - x["sampler"])
    assert np.sum(mask & (weight > TIS_CAP)) >= 5 and np.sum(mask & (weight < 1)) >= 5
    assert np.max(np.where(mask, x["old"] - x["sampler"], 0)) > math.log(np.finfo(np.float32).max)
    # No token within 1e-4 (relative) of a kink: the finite differences and the float32 branches are unambiguous.
    for bound in (0.8, 1.2, 1 + CLIP_HIGH, 100.0):
        assert np.min(np.abs(rho[mask] / bound - 1)) > 1e-4
    assert np.min(np.abs(weight[mask] / TIS_CAP - 1)) > 1e-4


@pytest.mark.parametrize("options", sorted(OPTIONS))
@pytest.mark.parametrize("aggregation", AGGREGATIONS.names())
def test_numpy_gradient_is_the_finite_difference_of_its_value(make_rollout, options, aggregation):
    cfg = ObjectiveConfig(aggregation=aggregation, **OPTIONS[options])
    x = random_inputs(make_rollout)
    args = (x["old"], x["sampler"], x["adv"], x["m"])
    _, grad = np_policy(cfg, x["logp"], *args)
    eps = 1e-6
    finite_difference = np.zeros_like(grad)
    for index in zip(*np.nonzero(x["m"])):
        step = np.zeros_like(grad)
        step[index] = eps
        finite_difference[index] = (np_policy(cfg, x["logp"] + step, *args)[0]
                                    - np_policy(cfg, x["logp"] - step, *args)[0]) / (2 * eps)
    np.testing.assert_allclose(grad, finite_difference, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("options", sorted(OPTIONS))
@pytest.mark.parametrize("aggregation", AGGREGATIONS.names())
def test_policy_loss_and_gradient_match_numpy(make_rollout, options, aggregation):
    cfg = ObjectiveConfig(aggregation=aggregation, **OPTIONS[options])
    x = random_inputs(make_rollout)
    want_value, want_grad = np_policy(cfg, x["logp"], x["old"], x["sampler"], x["adv"], x["m"])
    value, grad = policy_value_and_grad(to_loss_inputs(x, cfg), cfg)
    np.testing.assert_allclose(float(value), want_value, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-5, atol=1e-7)
    symmetric_value, symmetric_grad = np_policy(ObjectiveConfig(aggregation=aggregation), x["logp"], x["old"],
                                                x["sampler"], x["adv"], x["m"])
    assert abs(want_value - symmetric_value) > 1e-3 and np.abs(want_grad - symmetric_grad).max() > 1e-3


def test_tis_weight_is_a_frozen_truncated_ratio_on_loss_tokens(make_rollout):
    x = random_inputs(make_rollout)
    cfg = ObjectiveConfig(tis_cap=TIS_CAP)
    inputs = to_loss_inputs(x, cfg)
    weight_bt = np.asarray(tis_weight(inputs.old_logp_bt, inputs.sampler_logp_bt, inputs.loss_mask_bt, TIS_CAP))
    want_bt = np.where(x["m"] > 0, np.minimum(np.exp(x["old"] - x["sampler"]), TIS_CAP), 1.0)
    assert np.all(np.isfinite(weight_bt))
    np.testing.assert_allclose(weight_bt, want_bt, rtol=1e-6)

    def loss_of(old_bt, sampler_bt):
        return policy_loss(inputs._replace(old_logp_bt=old_bt, sampler_logp_bt=sampler_bt), cfg)

    d_sampler = jax.grad(loss_of, argnums=1)(inputs.old_logp_bt, inputs.sampler_logp_bt)
    assert not np.any(np.asarray(d_sampler))  # no gradient through the weight
    with pytest.raises(ValueError, match="objective.tis_cap > 0 needs sampler_logp_bt"):
        policy_loss(to_loss_inputs(x, cfg, sampler=False), cfg)


def test_update_metrics_report_the_truncated_share_and_the_asymmetric_clip_fraction(make_rollout):
    x = random_inputs(make_rollout)
    mask, a = x["m"] > 0, x["adv"][:, None]
    cfg = ObjectiveConfig(**OPTIONS["both"])
    got = update_metrics(to_loss_inputs(x, cfg), cfg)
    truncated = np.exp(x["old"] - x["sampler"]) > TIS_CAP
    np.testing.assert_allclose(float(got["actor/tis_truncated"]), truncated[mask].mean(), rtol=1e-6)
    rho = np.minimum(np.exp(x["logp"] - x["old"]), cfg.ratio_cap)
    clipped = -a * np.clip(rho, 0.8, 1 + CLIP_HIGH) > -a * rho
    np.testing.assert_allclose(float(got["actor/clip_frac"]), clipped[mask].mean(), rtol=1e-6)
    assert "actor/tis_truncated" not in update_metrics(to_loss_inputs(x, cfg), ObjectiveConfig())


# ----------------------------------------------------------------------------------------------------------------------
# Defaults: the paper's objective, bitwise.


def pre_change_policy_bt(inputs, cfg):
    """The symmetric clipped surrogate as it was written before the options existed. [B, T]."""
    advantages_b1 = jax.lax.stop_gradient(inputs.advantages_b)[:, None]
    ratio_bt = jnp.exp(jnp.minimum(inputs.logp_bt - inputs.old_logp_bt, math.log(cfg.ratio_cap)))
    clipped_bt = jnp.clip(ratio_bt, 1.0 - cfg.clip_ratio, 1.0 + cfg.clip_ratio)
    return jnp.maximum(-advantages_b1 * ratio_bt, -advantages_b1 * clipped_bt)


def pre_change_objective(inputs, cfg):
    """`objective_loss`'s total with the pre-change policy term, computed and summed in the same order (the order of
    the terms also orders the gradient's sums)."""
    def term(name):
        if name == "policy":
            return aggregate(pre_change_policy_bt(inputs, cfg), inputs.loss_mask_bt, cfg.aggregation)
        return LOSS_TERMS[name](inputs, cfg)

    values = {name: term(name) for name, _ in cfg.weighted_terms()}
    return sum(coef * values[name] for name, coef in cfg.weighted_terms())


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("aggregation", AGGREGATIONS.names())
def test_defaults_leave_the_objective_bitwise_unchanged(make_rollout, aggregation, jit):
    x = random_inputs(make_rollout)
    default = ObjectiveConfig(aggregation=aggregation)
    assert (default.clip_ratio_high, default.tis_cap) == (0.0, 0.0)
    transform = jax.jit if jit else (lambda f: f)

    def value_and_grad(objective, cfg, sampler):
        inputs = to_loss_inputs(x, cfg, sampler=sampler)
        fn = jax.value_and_grad(lambda logp_bt: objective(inputs._replace(logp_bt=logp_bt), cfg))
        return jax.tree.map(np.asarray, transform(fn)(inputs.logp_bt))

    total = lambda inputs, cfg: objective_loss(inputs, cfg)[0]  # noqa: E731
    want = value_and_grad(pre_change_objective, default, sampler=False)
    for cfg in (default, ObjectiveConfig(aggregation=aggregation, clip_ratio_high=0.0, tis_cap=0.0),
                ObjectiveConfig(aggregation=aggregation, clip_ratio_high=default.clip_ratio)):
        for sampler in (False, True):  # the sampler's log-probs are ignored with tis_cap = 0
            got = value_and_grad(total, cfg, sampler)
            np.testing.assert_array_equal(got[0], want[0])
            np.testing.assert_array_equal(got[1], want[1])
    assert np.any(want[1])


# ----------------------------------------------------------------------------------------------------------------------
# Configuration.


@pytest.mark.parametrize("changes, key", [
    (dict(clip_ratio_high=-0.1), "objective.clip_ratio_high"),
    (dict(tis_cap=0.5), "objective.tis_cap"),
    (dict(tis_cap=-2.0), "objective.tis_cap"),
    (dict(tis_cap=float("nan")), "objective.tis_cap"),
])
def test_config_errors_name_the_key(changes, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        ObjectiveConfig(**changes)
    cfg = config_lib.default_config()
    cfg.run_dir, cfg.model.path = "/tmp/run", "/tmp/model"
    for name, value in changes.items():
        cfg.objective[name] = value
    with pytest.raises(config_lib.ConfigError, match=key.replace(".", r"\.")):
        config_lib.check(cfg)


def test_run_config_options_reach_the_objective():
    cfg = config_lib.default_config()
    cfg.objective.clip_ratio_high, cfg.objective.tis_cap = CLIP_HIGH, 2.0
    objective = config_lib.typed(cfg).objective
    assert (objective.clip_ratio_high, objective.tis_cap) == (CLIP_HIGH, 2.0)
    assert objective.clip_range() == (1.0 - objective.clip_ratio, 1.0 + CLIP_HIGH)
    assert ObjectiveConfig(tis_cap=1.0).tis_cap == 1.0  # the smallest cap: weights above 1 are truncated


# ----------------------------------------------------------------------------------------------------------------------
# The train step with both options on.


@pytest.mark.slow
def test_train_step_runs_with_clip_higher_and_tis(plain_step, tiny_model_cfg, step_batch):
    """Both options compile into the update; on update 0 (rho == 1) the policy term of each micro-batch is the token
    mean of -A * min(exp(old_logp - sampler_logp), cap), and the truncated share is that of the NumPy formula."""
    cap = 2.0
    step = RLTrainStep(Transformer(tiny_model_cfg, rngs=nnx.Rngs(0)),
                       ObjectiveConfig(clip_ratio_high=CLIP_HIGH, tis_cap=cap), plain_step.update_cfg)
    rng = np.random.default_rng(0)
    sampler_bt = (step_batch.loss_mask_bt * rng.uniform(-6.0, -3.5, step_batch.loss_mask_bt.shape)).astype(np.float32)
    batch = dataclasses.replace(step_batch, sampler_logp_bt=sampler_bt)
    state = step.init_state()
    prepared = step.prepare_batch(batch)
    old_uxbt = np.asarray(step.sequence_logp(state.params, prepared), np.float64)
    laid = prepared.batch
    m_uxbt = np.asarray(laid.loss_mask_uxbt, np.float64)
    log_weight_uxbt = old_uxbt - np.asarray(laid.sampler_logp_uxbt, np.float64)
    per_micro = lambda x_uxbt: (x_uxbt * m_uxbt).sum(axis=(2, 3)) / m_uxbt.sum(axis=(2, 3))  # noqa: E731
    want_truncated_u = per_micro((log_weight_uxbt > math.log(cap)).astype(np.float64)).mean(axis=1)
    policy_uxbt = -np.asarray(laid.advantages_uxb, np.float64)[..., None] * np.minimum(np.exp(log_weight_uxbt), cap)
    want_policy_0 = per_micro(policy_uxbt)[0].mean()

    state, metrics = step.train_on_batch(state, step.reference_params(state.params), batch)
    np.testing.assert_allclose(metrics.per_update["actor/tis_truncated"], want_truncated_u, rtol=1e-6)
    assert 0 < metrics.scalars["actor/tis_truncated"] < 1
    np.testing.assert_allclose(metrics.per_update["loss/policy"][0], want_policy_0, rtol=1e-5, atol=1e-6)
    assert metrics.scalars["actor/nonfinite"] == 0 and np.all(np.isfinite(metrics.per_update["actor/loss"]))
