"""LLDS: the likelihood-preserving regularizer of arXiv 2512.04220 (gates, answer-span weights, the loss term).

`llds = aggregate(g * w * max(0, delta))` with `delta = old_logp - logp` (> 0: the token got less likely). The gate g
keeps tokens of preserved trajectories (A >= 0) and, for the "action" / "response" gates, only where the net delta
summed over the token's action / trajectory is positive. g is a stop-gradient, so on a gated token that lost
likelihood the gradient is `-(w / sum(m)) * grad logp`.
"""
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from llds_jax.registry import Registry
from llds_jax.config.sections import LLDSConfig, ObjectiveConfig
from llds_jax.rl.terms import LossInputs, aggregate, register_loss_term


def action_ids_from_loss_mask(loss_mask_bt: jax.Array) -> jax.Array:
    """Action ids from a loss mask: each maximal run of 1s is one action, numbered 0, 1, ... per row; -1 elsewhere."""
    mask_bt = loss_mask_bt > 0
    previous_bt = jnp.pad(mask_bt[:, :-1], ((0, 0), (1, 0)))
    starts_bt = mask_bt & ~previous_bt
    return jnp.where(mask_bt, jnp.cumsum(starts_bt, axis=-1) - 1, -1).astype(jnp.int32)


def action_sums(x_bt: jax.Array, action_ids_bt: jax.Array, loss_mask_bt: jax.Array) -> jax.Array:
    """Per-row sums of `x * m` over each action: [B, A] (A = T actions, at most one per token) where [b, a] is the
    sum over action a of row b.

    Tokens with m = 0 or an action id outside [0, T) do not count.
    """
    time = x_bt.shape[1]
    valid_bt = (loss_mask_bt > 0) & (action_ids_bt >= 0) & (action_ids_bt < time)
    slot_bt = jnp.where(valid_bt, action_ids_bt, time)  # slot T collects what does not count, then is dropped
    x_bt = jnp.where(valid_bt, x_bt * loss_mask_bt, 0.0)
    sums_ba = jax.vmap(lambda x_t, s_t: jax.ops.segment_sum(x_t, s_t, num_segments=time + 1))(x_bt, slot_bt)
    return sums_ba[:, :time]


def _per_token_action_sum(x_bt, action_ids_bt, loss_mask_bt):
    """Each token's action sum of `x * m` (0 on tokens outside any action)."""
    time = x_bt.shape[1]
    sums_ba = jnp.pad(action_sums(x_bt, action_ids_bt, loss_mask_bt), ((0, 0), (0, 1)))
    slot_bt = jnp.where((action_ids_bt >= 0) & (action_ids_bt < time), action_ids_bt, time)
    return jnp.take_along_axis(sums_ba, slot_bt, axis=1)


GATES: Registry[Callable[[jax.Array, jax.Array, jax.Array, jax.Array | None], jax.Array]] = Registry(
    "objective.llds.gate")
"""`objective.llds.gate` -> the test `fn(delta_bt, loss_mask_bt, action_ids_bt, segment_first_bt) -> [B, T] bool` of
`llds_gate`."""


@GATES.register("action")
def _action_gate(delta_bt, loss_mask_bt, action_ids_bt, segment_first_bt):
    del segment_first_bt  # an action lies inside one segment
    return _per_token_action_sum(delta_bt, action_ids_bt, loss_mask_bt) > 0


@GATES.register("response")
def _response_gate(delta_bt, loss_mask_bt, action_ids_bt, segment_first_bt):
    """The net delta over the token's response: its row, or its segment (a segment is a response)."""
    del action_ids_bt
    if segment_first_bt is None:
        return jnp.sum(delta_bt * loss_mask_bt, axis=-1, keepdims=True) > 0
    return _per_token_action_sum(delta_bt, segment_first_bt, loss_mask_bt) > 0


@GATES.register("token")
def _token_gate(delta_bt, loss_mask_bt, action_ids_bt, segment_first_bt):
    del action_ids_bt, segment_first_bt
    return jnp.ones_like(delta_bt, dtype=bool)


def llds_gate(gate: str, delta_bt, loss_mask_bt, advantages_b, action_ids_bt, segment_first_bt=None) -> jax.Array:
    """The gate g_t in {0, 1}: `m_t * 1[A >= 0] * test`, test per `gate` ("action", "response" or "token": one of
    `GATES`, which `llds_jax.checks` checks objective.llds.gate against).

    Args:
      delta_bt: [B, T] old_logp - logp (treated as a constant).
      loss_mask_bt: [B, T] loss mask m.
      advantages_b: [B] advantages; trajectories with A >= 0 are preserved.
      action_ids_bt: [B, T] action ids (0-based per row, -1 off actions).
      segment_first_bt: [B, T] int, each token's segment (the index of its first token; `RolloutBatch.
        segment_first_bt`), or None: each row is one response.

    Returns:
      [B, T] float32 gate, a stop-gradient.
    """
    delta_bt = jax.lax.stop_gradient(delta_bt)
    mask_bt = loss_mask_bt.astype(jnp.float32)
    preserve_b1 = (jax.lax.stop_gradient(advantages_b) >= 0)[:, None]
    fired_bt = GATES[gate](delta_bt, mask_bt, action_ids_bt, segment_first_bt)
    return (mask_bt * preserve_b1 * fired_bt).astype(jnp.float32)


ANSWER_WEIGHTINGS: Registry[Callable[[LLDSConfig, jax.Array], jax.Array]] = Registry(
    "objective.llds.answer_weighting")
"""`objective.llds.answer_weighting` -> `fn(cfg, V) -> beta` of `answer_beta`."""


@ANSWER_WEIGHTINGS.register("none")
def _no_answer_weighting(cfg: LLDSConfig, mean_searches: jax.Array) -> jax.Array:
    del mean_searches
    return jnp.float32(cfg.lam)


@ANSWER_WEIGHTINGS.register("fixed")
def _fixed_answer_weighting(cfg: LLDSConfig, mean_searches: jax.Array) -> jax.Array:
    del mean_searches
    return jnp.float32(cfg.answer_beta)


@ANSWER_WEIGHTINGS.register("adaptive")
def _adaptive_answer_weighting(cfg: LLDSConfig, mean_searches: jax.Array) -> jax.Array:
    return cfg.adaptive_c * jnp.maximum(mean_searches - 1.0, 0.0)


@ANSWER_WEIGHTINGS.register("adaptive_paper")
def _adaptive_paper_answer_weighting(cfg: LLDSConfig, mean_searches: jax.Array) -> jax.Array:
    return jnp.minimum(mean_searches / 2.0, 1.0) * cfg.lam


def answer_beta(cfg: LLDSConfig, mean_searches: jax.Array | float) -> jax.Array:
    """beta of LLDS-MA for a rollout batch.

    Args:
      cfg: the LLDS config (its answer_weighting picks the formula).
      mean_searches: V, the mean number of <search> actions per trajectory over the whole rollout batch.

    Returns:
      scalar beta; with answer_weighting "none" it is lambda, so every token keeps w = lambda.
    """
    return ANSWER_WEIGHTINGS[cfg.answer_weighting](cfg, jnp.asarray(mean_searches, jnp.float32))


def llds_weight(cfg: LLDSConfig, answer_mask_bt: jax.Array, beta: jax.Array | float) -> jax.Array:
    """w per token: lambda, and min(beta, lambda) on the answer span (`answer_beta`: lambda itself when LLDS-MA is
    off, so every token keeps lambda). [B, T] float32."""
    lam = jnp.float32(cfg.lam)
    return jnp.where(answer_mask_bt > 0, jnp.minimum(jnp.asarray(beta, jnp.float32), lam), lam)


def llds_batch_statistics(batch, cfg: ObjectiveConfig) -> dict[str, float]:
    """`answer_beta`: beta of LLDS-MA (`answer_beta`) from the mean of the rollout batch's `search_count_b`."""
    return {"answer_beta": float(answer_beta(cfg.llds, float(np.mean(batch.search_count_b))))}


@register_loss_term("llds", batch_statistics=llds_batch_statistics)
def llds_loss(inputs: LossInputs, cfg: ObjectiveConfig) -> jax.Array:
    """`aggregate(g * w * max(0, old_logp - logp))`; with token-mean the denominator is sum(m) (all loss tokens)."""
    delta_bt = inputs.old_logp_bt - inputs.logp_bt
    gate_bt = llds_gate(cfg.llds.gate, delta_bt, inputs.loss_mask_bt, inputs.advantages_b, inputs.action_ids_bt,
                        inputs.segment_first_bt)
    weight_bt = llds_weight(cfg.llds, inputs.answer_mask_bt, inputs.batch_stats["answer_beta"])
    return aggregate(gate_bt * weight_bt * jnp.maximum(delta_bt, 0.0), inputs.loss_mask_bt, cfg.aggregation)
