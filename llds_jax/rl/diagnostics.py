"""Lazy-likelihood-displacement (LLD) diagnostics: jit-friendly metrics, fetched from the device once per batch.

Three moments of a rollout batch:
- before its updates (`likelihood_metrics`): likelihood of correct vs incorrect trajectories, first vs later actions,
  gap between sampler and trainer log-probs;
- per micro-batch inside the update (`update_metrics`): gate activation share, mean delta on preserved tokens, entropy,
  clip fraction, approx KL(old, new), k3 KL to the reference, share of truncated importance weights; those that
  compare logp with old_logp (`DISPLACEMENT_METRICS`, with the LLDS loss) are 0 by construction on a batch's first
  update;
- after its updates (`lld_metrics`): Delta_traj = sum(new - old) over loss tokens, its mean for correct trajectories,
  the LLD rate (share of correct trajectories with Delta_traj < 0) and the tie share (Delta_traj == 0: e.g. updates
  too small to change the log-probs; the caller computes both log-probs in float32).
A mean over an empty set (e.g. no correct trajectory) is NaN.
"""
import math

import jax
import jax.numpy as jnp

from llds_jax.config.sections import ObjectiveConfig
from llds_jax.rl.llds import action_sums, llds_gate
from llds_jax.rl.losses import kl_penalty_bt, policy_ratio, sampler_log_ratio
from llds_jax.rl.terms import LossInputs, aggregate


# Per-update metrics that compare logp with old_logp: exactly 0 on the first update of a rollout batch (logp ==
# old_logp there), so a batch reports them over its later updates (llds_jax.rl.train_step).
DISPLACEMENT_METRICS = ("loss/llds", "llds/gate_share", "llds/preserved_delta", "actor/clip_frac", "actor/approx_kl")


def _mean_where(x_b: jax.Array, select_b: jax.Array) -> jax.Array:
    """Mean of x over the selected entries; NaN when none is selected."""
    select_b = select_b.astype(jnp.float32)
    count = jnp.sum(select_b)
    return jnp.where(count > 0, jnp.sum(x_b * select_b) / jnp.maximum(count, 1.0), jnp.nan)


def _row_token_mean(x_bt: jax.Array, mask_bt: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-row token mean of x over mask, and whether the row has any masked token. ([B], [B] bool)."""
    count_b = jnp.sum(mask_bt, axis=-1)
    return jnp.sum(x_bt * mask_bt, axis=-1) / jnp.maximum(count_b, 1.0), count_b > 0


def likelihood_metrics(
    old_logp_bt: jax.Array,
    loss_mask_bt: jax.Array,
    action_ids_bt: jax.Array,
    correct_b: jax.Array,
    sampler_logp_bt: jax.Array | None = None,
) -> dict[str, jax.Array]:
    """Likelihood of the rollout batch under the training model, before its updates.

    Args:
      old_logp_bt: [B, T] old log-probs (aligned to tokens).
      loss_mask_bt: [B, T] loss mask.
      action_ids_bt: [B, T] 0-based action ids (-1 off actions); action 0 is the first model turn.
      correct_b: [B] bool, trajectory answered correctly.
      sampler_logp_bt: optional [B, T] log-probs reported by the sampler.

    Returns:
      scalars: `lld/logp_sum_{correct,incorrect}` (mean over trajectories of the summed old_logp),
      `lld/logp_mean_{correct,incorrect}` (of the per-trajectory token mean), `lld/logp_mean_{first,later}_action`
      (per-trajectory token mean over the first / later actions, averaged over trajectories that have them) and, with
      sampler log-probs, `lld/sampler_gap` = token mean of (old - sampler) and `lld/sampler_abs_gap` of |old - sampler|,
      and `lld/is_ess` (`importance_ess`).
    """
    mask_bt = loss_mask_bt.astype(jnp.float32)
    correct_b = correct_b.astype(bool)
    has_tokens_b = jnp.sum(mask_bt, axis=-1) > 0
    sum_b = jnp.sum(old_logp_bt * mask_bt, axis=-1)
    mean_b, _ = _row_token_mean(old_logp_bt, mask_bt)
    first_mask_bt = mask_bt * (action_ids_bt == 0)
    later_mask_bt = mask_bt * (action_ids_bt > 0)
    first_b, has_first_b = _row_token_mean(old_logp_bt, first_mask_bt)
    later_b, has_later_b = _row_token_mean(old_logp_bt, later_mask_bt)
    metrics = {
        "lld/logp_sum_correct": _mean_where(sum_b, correct_b & has_tokens_b),
        "lld/logp_sum_incorrect": _mean_where(sum_b, ~correct_b & has_tokens_b),
        "lld/logp_mean_correct": _mean_where(mean_b, correct_b & has_tokens_b),
        "lld/logp_mean_incorrect": _mean_where(mean_b, ~correct_b & has_tokens_b),
        "lld/logp_mean_first_action": _mean_where(first_b, has_first_b),
        "lld/logp_mean_later_actions": _mean_where(later_b, has_later_b),
    }
    if sampler_logp_bt is not None:
        gap_bt = old_logp_bt - sampler_logp_bt
        metrics["lld/sampler_gap"] = aggregate(gap_bt, mask_bt, "token-mean")
        metrics["lld/sampler_abs_gap"] = aggregate(jnp.abs(gap_bt), mask_bt, "token-mean")
        metrics["lld/is_ess"] = importance_ess(gap_bt, mask_bt)
    return metrics


def importance_ess(log_w_bt: jax.Array, mask_bt: jax.Array) -> jax.Array:
    """The normalised effective sample size of the importance weights w = exp(log_w) over the N masked tokens:
    `(sum w)^2 / (N sum w^2)`, in [1/N, 1] (1: equal weights). With log_w = old_logp - sampler_logp these are the
    weights that correct the behaviour (sampling) policy to the one the step starts from: ~1 on a synchronous
    batch, lower the more off-policy its tokens are (rollout.partial's carried ones). Computed with the largest
    log-weight subtracted (the ratio does not change), so it never overflows; NaN without a masked token. []."""
    mask_bt = mask_bt.astype(jnp.float32)
    log_w_bt = jnp.where(mask_bt > 0, log_w_bt, -jnp.inf)
    w_bt = jnp.exp(log_w_bt - jnp.max(log_w_bt)) * mask_bt
    count = jnp.sum(mask_bt)
    return jnp.sum(w_bt) ** 2 / (count * jnp.sum(w_bt ** 2))


def update_metrics(inputs: LossInputs, cfg: ObjectiveConfig) -> dict[str, jax.Array]:
    """Per-micro-batch metrics of one update (token means over loss tokens; all stop-gradient).

    Returns:
      `llds/gate_share`: share of preserved actions (A >= 0) whose gate fired on at least one token;
      `llds/preserved_delta`: mean of old_logp - logp over preserved tokens; `actor/entropy`; `actor/clip_frac`
      (tokens where the clipped branch is taken); `actor/approx_kl` = mean(old_logp - logp);
      `actor/ref_kl_k3`: k3 KL to the reference (when reference log-probs are given); `actor/tis_truncated`: share
      of loss tokens whose importance weight exp(old_logp - sampler_logp) exceeds objective.tis_cap, so is truncated
      (when tis_cap > 0).
    """
    inputs = jax.lax.stop_gradient(inputs)
    mask_bt = inputs.loss_mask_bt.astype(jnp.float32)
    delta_bt = inputs.old_logp_bt - inputs.logp_bt
    preserved_bt = mask_bt * (inputs.advantages_b >= 0)[:, None]
    gate_bt = llds_gate(cfg.llds.gate, delta_bt, mask_bt, inputs.advantages_b, inputs.action_ids_bt,
                        inputs.segment_first_bt)
    tokens_ba = action_sums(preserved_bt, inputs.action_ids_bt, mask_bt)
    fired_ba = action_sums(gate_bt, inputs.action_ids_bt, mask_bt)
    preserved_actions = jnp.sum(tokens_ba > 0)
    ratio_bt = policy_ratio(inputs.logp_bt, inputs.old_logp_bt, cfg.ratio_cap)
    advantages_b1 = inputs.advantages_b[:, None]
    clipped_bt = (-advantages_b1 * jnp.clip(ratio_bt, *cfg.clip_range())) > (-advantages_b1 * ratio_bt)
    metrics = {
        "llds/gate_share": jnp.sum(fired_ba > 0) / jnp.maximum(preserved_actions, 1),
        "llds/preserved_delta": jnp.sum(delta_bt * preserved_bt) / jnp.maximum(jnp.sum(preserved_bt), 1.0),
        "actor/entropy": aggregate(inputs.entropy_bt, mask_bt, "token-mean"),
        "actor/clip_frac": aggregate(clipped_bt.astype(jnp.float32), mask_bt, "token-mean"),
        "actor/approx_kl": aggregate(delta_bt, mask_bt, "token-mean"),
    }
    if inputs.ref_logp_bt is not None:
        k3_bt = kl_penalty_bt(inputs.logp_bt, inputs.ref_logp_bt, "low_var_kl", cfg.kl_clamp)
        metrics["actor/ref_kl_k3"] = aggregate(k3_bt, mask_bt, "token-mean")
    if cfg.tis_cap:
        truncated_bt = sampler_log_ratio(inputs.old_logp_bt, inputs.sampler_logp_bt) > math.log(cfg.tis_cap)
        metrics["actor/tis_truncated"] = aggregate(truncated_bt.astype(jnp.float32), mask_bt, "token-mean")
    return metrics


def lld_metrics(
    new_logp_bt: jax.Array, old_logp_bt: jax.Array, loss_mask_bt: jax.Array, correct_b: jax.Array
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Likelihood displacement over a batch's updates.

    Args:
      new_logp_bt: [B, T] log-probs recomputed after the batch's updates (float32 compute: bfloat16 hides small
        changes).
      old_logp_bt: [B, T] log-probs before them, computed the same way.
      loss_mask_bt: [B, T] loss mask.
      correct_b: [B] bool.

    Returns:
      (delta_traj_b, metrics): [B] Delta_traj = sum over loss tokens of (new - old), float32 nats;
      `lld/delta_traj_correct` (its mean over correct trajectories), `lld/rate` (share of correct trajectories with
      Delta_traj < 0: likelihood strictly displaced) and `lld/tie_share` (share with Delta_traj == 0).
    """
    delta_traj_b = jnp.sum((new_logp_bt.astype(jnp.float32) - old_logp_bt.astype(jnp.float32)) * loss_mask_bt, axis=-1)
    correct_b = correct_b.astype(bool)
    return delta_traj_b, {
        "lld/delta_traj_correct": _mean_where(delta_traj_b, correct_b),
        "lld/rate": _mean_where((delta_traj_b < 0).astype(jnp.float32), correct_b),
        "lld/tie_share": _mean_where((delta_traj_b == 0).astype(jnp.float32), correct_b),
    }
