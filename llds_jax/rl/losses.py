"""GRPO loss terms (clipped policy, entropy bonus, KL to reference) and the per-micro-batch objective.

`objective_loss` sums the registered terms named by `ObjectiveConfig.weighted_terms()`:
`L = pg - entropy_coef * ent + kl_coef * kl + llds` (code-exact default, docs/method.md).
"""
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from llds_jax.registry import Registry
from llds_jax.rl import llds  # noqa: F401  (registers the "llds" term)
from llds_jax.config.sections import ObjectiveConfig
from llds_jax.rl.terms import LossInputs, aggregate, LOSS_TERMS, register_loss_term

# exp() argument bound for k3: exp(20) - 21 is far above any clamp, so the value is unchanged and the gradient
# stays finite (0) where exp would overflow.
_K3_EXP_BOUND = 20.0


def policy_ratio(logp_bt: jax.Array, old_logp_bt: jax.Array, ratio_cap: float) -> jax.Array:
    """`min(exp(logp - old_logp), ratio_cap)`, computed on the log scale so it never overflows. [B, T]."""
    return jnp.exp(jnp.minimum(logp_bt - old_logp_bt, math.log(ratio_cap)))


def sampler_log_ratio(old_logp_bt: jax.Array, sampler_logp_bt: jax.Array) -> jax.Array:
    """`old_logp - sampler_logp`: log of the trainer-over-sampler importance ratio, frozen. [B, T] float32."""
    return jax.lax.stop_gradient(old_logp_bt - sampler_logp_bt).astype(jnp.float32)


def tis_weight(old_logp_bt: jax.Array, sampler_logp_bt: jax.Array, loss_mask_bt: jax.Array,
               tis_cap: float) -> jax.Array:
    """Truncated importance weight `min(exp(old_logp - sampler_logp), tis_cap)` on loss tokens, 1 elsewhere.

    Computed on the log scale (never overflows) and frozen (no gradient). [B, T] float32.
    """
    log_ratio_bt = sampler_log_ratio(old_logp_bt, sampler_logp_bt)
    weight_bt = jnp.exp(jnp.minimum(log_ratio_bt, math.log(tis_cap)))
    return jnp.where(loss_mask_bt > 0, weight_bt, 1.0)


def clipped_policy_loss_bt(inputs: LossInputs, cfg: ObjectiveConfig) -> jax.Array:
    """Per-token `max(-A * rho, -A * clip(rho, 1 - eps, 1 + eps_high))` (`ObjectiveConfig.clip_range`), times the
    truncated importance weight (`tis_weight`) when objective.tis_cap > 0. [B, T]."""
    advantages_b1 = jax.lax.stop_gradient(inputs.advantages_b)[:, None]
    ratio_bt = policy_ratio(inputs.logp_bt, inputs.old_logp_bt, cfg.ratio_cap)
    clipped_bt = jnp.clip(ratio_bt, *cfg.clip_range())
    loss_bt = jnp.maximum(-advantages_b1 * ratio_bt, -advantages_b1 * clipped_bt)
    if not cfg.tis_cap:
        return loss_bt
    if inputs.sampler_logp_bt is None:
        raise ValueError("objective.tis_cap > 0 needs sampler_logp_bt (the sampler's log-probs)")
    return loss_bt * tis_weight(inputs.old_logp_bt, inputs.sampler_logp_bt, inputs.loss_mask_bt, cfg.tis_cap)


KL_ESTIMATORS: Registry[Callable[[jax.Array, float], jax.Array]] = Registry("objective.kl_estimator")
"""`objective.kl_estimator` -> `fn(diff_bt, clamp) -> [B, T]` of `kl_penalty_bt`, with diff = logp - ref."""


@KL_ESTIMATORS.register("k1")
def _k1(diff_bt: jax.Array, clamp: float) -> jax.Array:
    del clamp
    return diff_bt


@KL_ESTIMATORS.register("abs")
def _abs(diff_bt: jax.Array, clamp: float) -> jax.Array:
    del clamp
    return jnp.abs(diff_bt)


@KL_ESTIMATORS.register("mse")
def _mse(diff_bt: jax.Array, clamp: float) -> jax.Array:
    del clamp
    return 0.5 * diff_bt**2


@KL_ESTIMATORS.register("low_var_kl")
def _k3(diff_bt: jax.Array, clamp: float) -> jax.Array:
    d_bt = -diff_bt
    k3_bt = jnp.exp(jnp.minimum(d_bt, _K3_EXP_BOUND)) - d_bt - 1.0
    return jnp.clip(k3_bt, -clamp, clamp)


def kl_penalty_bt(logp_bt: jax.Array, ref_logp_bt: jax.Array, estimator: str, clamp: float) -> jax.Array:
    """Per-token KL(current || reference) estimate. [B, T].

    "k1": logp - ref; "abs": |logp - ref|; "mse": 0.5 (logp - ref)^2;
    "low_var_kl" (k3): with d = ref - logp, clip(exp(d) - d - 1, -clamp, clamp).
    """
    return KL_ESTIMATORS[estimator](logp_bt - ref_logp_bt, clamp)


@register_loss_term("policy")
def policy_loss(inputs: LossInputs, cfg: ObjectiveConfig) -> jax.Array:
    """Clipped surrogate, aggregated over loss tokens."""
    return aggregate(clipped_policy_loss_bt(inputs, cfg), inputs.loss_mask_bt, cfg.aggregation)


@register_loss_term("entropy")
def entropy_bonus(inputs: LossInputs, cfg: ObjectiveConfig) -> jax.Array:
    """Mean next-token entropy over loss tokens (enters the loss with a negative coefficient)."""
    return aggregate(inputs.entropy_bt, inputs.loss_mask_bt, cfg.aggregation)


@register_loss_term("kl")
def kl_loss(inputs: LossInputs, cfg: ObjectiveConfig) -> jax.Array:
    """KL to the reference model with the configured estimator, aggregated over loss tokens."""
    if inputs.ref_logp_bt is None:
        raise ValueError("objective.kl_coef > 0 needs ref_logp_bt (reference log-probs)")
    kl_bt = kl_penalty_bt(inputs.logp_bt, jax.lax.stop_gradient(inputs.ref_logp_bt), cfg.kl_estimator, cfg.kl_clamp)
    return aggregate(kl_bt, inputs.loss_mask_bt, cfg.aggregation)


def objective_loss(inputs: LossInputs, cfg: ObjectiveConfig) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The per-micro-batch loss and each term's unweighted value (keyed by term name)."""
    values = {name: LOSS_TERMS[name](inputs, cfg) for name, _ in cfg.weighted_terms()}
    loss = sum(coef * values[name] for name, coef in cfg.weighted_terms())
    return loss, values
