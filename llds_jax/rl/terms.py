"""Loss terms registered by name, their common inputs and the masked aggregation they share.

A loss term is `fn(inputs: LossInputs, cfg: ObjectiveConfig) -> scalar`; `ObjectiveConfig.weighted_terms()` says which
names are summed with which coefficients. A new term (e.g. an LLDS variant) is a new function decorated with
`@register_loss_term("name")`, selected from the config, with no change to the loss or train step.

A term that needs statistics of the whole rollout batch (LLDS-MA's beta comes from the mean search count) registers
a hook, `register_loss_term("name", batch_statistics=hook)` with `hook(batch: RolloutBatch, cfg) -> {name: scalar}`:
the train step calls the hooks of the configured terms once per rollout batch (`batch_statistics`) and every
micro-batch's `LossInputs.batch_stats` holds the results. An LLDS variant that reuses the "llds" term registers its
hook too (`llds.llds_batch_statistics`).
"""
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from llds_jax.registry import Registry
from llds_jax.config.sections import ObjectiveConfig


class LossInputs(NamedTuple):
    """Per-token arrays of one micro-batch, aligned to token positions (column t is about token t).

    Attributes:
      logp_bt: [B, T] float32 log-probs under the current parameters (differentiated).
      entropy_bt: [B, T] float32 entropy of the next-token distribution that produced token t.
      old_logp_bt: [B, T] log-probs before any update of this rollout batch (frozen).
      ref_logp_bt: [B, T] log-probs under the reference model (frozen); None when the KL term is off.
      advantages_b: [B] per-trajectory advantages (frozen).
      loss_mask_bt: [B, T] 1 on model-generated tokens, 0 on prompt, observations and padding.
      action_ids_bt: [B, T] int, 0-based index of the model turn (action) a loss token belongs to; -1 elsewhere.
      answer_mask_bt: [B, T] 1 on the final <answer>...</answer> span (tags included), else 0.
      batch_stats: name -> scalar statistics of the whole rollout batch from the terms' hooks (`batch_statistics`).
      sampler_logp_bt: [B, T] float32 log-probs the rollout's sampler reported for the sampled tokens, 0 off model
        tokens (frozen); None unless objective.tis_cap > 0 (truncated importance sampling).
      segment_first_bt: [B, T] int, each token's segment (`RolloutBatch.segment_first_bt`); None: a row is one.
    """

    logp_bt: jax.Array
    entropy_bt: jax.Array
    old_logp_bt: jax.Array
    ref_logp_bt: jax.Array | None
    advantages_b: jax.Array
    loss_mask_bt: jax.Array
    action_ids_bt: jax.Array
    answer_mask_bt: jax.Array
    batch_stats: Mapping[str, jax.Array] = {}
    sampler_logp_bt: jax.Array | None = None
    segment_first_bt: jax.Array | None = None


AGGREGATIONS: Registry[Callable[[jax.Array, jax.Array], jax.Array]] = Registry("objective.aggregation")


@AGGREGATIONS.register("token-mean")
def _token_mean(x_bt: jax.Array, mask_bt: jax.Array) -> jax.Array:
    return jnp.sum(x_bt * mask_bt) / jnp.maximum(jnp.sum(mask_bt), 1.0)


@AGGREGATIONS.register("seq-mean-token-mean")
def _seq_mean_token_mean(x_bt: jax.Array, mask_bt: jax.Array) -> jax.Array:
    count_b = jnp.sum(mask_bt, axis=-1)
    seq_mean_b = jnp.sum(x_bt * mask_bt, axis=-1) / jnp.maximum(count_b, 1.0)
    has_tokens_b = (count_b > 0).astype(jnp.float32)
    return jnp.sum(seq_mean_b * has_tokens_b) / jnp.maximum(jnp.sum(has_tokens_b), 1.0)


def aggregate(x_bt: jax.Array, mask_bt: jax.Array, mode: str) -> jax.Array:
    """Masked mean of per-token values.

    "token-mean": `sum(x * m) / sum(m)` over every token of the micro-batch. "seq-mean-token-mean": the token mean of
    each trajectory, averaged over the trajectories that have loss tokens. An empty mask gives 0.
    """
    return AGGREGATIONS[mode](x_bt, mask_bt.astype(jnp.float32))


LossTerm = Callable[[LossInputs, ObjectiveConfig], jax.Array]
BatchStatistics = Callable[[Any, ObjectiveConfig], dict[str, float]]  # (RolloutBatch, cfg) -> name -> scalar
LOSS_TERMS: Registry[LossTerm] = Registry("objective.llds.variant")
BATCH_STATISTICS: Registry[BatchStatistics] = Registry("objective.llds.variant")


def register_loss_term(name: str, batch_statistics: BatchStatistics | None = None
                       ) -> Callable[[LossTerm], LossTerm]:
    """Decorator registering `fn(inputs, cfg) -> scalar` under `name` in `LOSS_TERMS`, with the hook computing the
    whole-batch statistics it reads from `inputs.batch_stats` (see the module docstring) in `BATCH_STATISTICS`."""

    def register(fn: LossTerm) -> LossTerm:
        LOSS_TERMS.register(name)(fn)
        if batch_statistics is not None:
            BATCH_STATISTICS.register(name)(batch_statistics)
        return fn

    return register


def batch_statistics(batch: Any, cfg: ObjectiveConfig) -> dict[str, float]:
    """What the hooks of the terms in `cfg.weighted_terms()` compute from `batch` (a host RolloutBatch)."""
    stats: dict[str, float] = {}
    for name, _ in cfg.weighted_terms():
        if name in BATCH_STATISTICS:
            stats.update(BATCH_STATISTICS[name](batch, cfg))
    return stats
