"""Drawing each sequence's next token from its logits, under jit (the rollout's step program,
`llds_jax.rollout.runner`, calls it once per decode iteration).

Log-probs are those of the sampling distribution over the full vocabulary: log_softmax(logits / temperature) in
float32, what the learner recomputes. Top-k / top-p only restrict which tokens can be drawn; the log-probs are not
renormalized over the kept set. Greedy decoding reports temperature-1 log-probs. Top-p without top-k takes the
nucleus by bisection (`nucleus`): no sort of the vocabulary.

Dimension letters (docs/architecture.md, "Dimension letters"): B rows (sequences sampling), O candidate tokens
(the top_k most likely), V vocabulary.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from llds_jax import parallel
from llds_jax.rollout import nucleus
from llds_jax.rollout.config import SamplingConfig


def sample_tokens(logits_bv: jax.Array, key_b: jax.Array, cfg: SamplingConfig) -> tuple[jax.Array, jax.Array]:
    """Draws one token per row. Returns (tokens int32 [B], log-probs float32 [B]).

    The log-prob is log_softmax(logits / temperature) over the full vocabulary at the drawn token (temperature 1
    when greedy); top-k and top-p only restrict the candidates. With top_k, top-p's nucleus is taken among the k
    sorted candidates; without it, over the whole vocabulary by bisection (`nucleus`: no sort), ties at the nucleus'
    smallest probability all kept.
    """
    # Each row's whole vocabulary on one device: left split over the vocabulary, XLA's CPU compiler partitions the
    # CDF's cumsum into a reduce-window over the whole vocabulary per output (O(V^2) per row). The rows are split
    # over every mesh axis, so that the chips of a tensor-parallel rollout each draw a share of them rather than all
    # of them.
    logits_bv = parallel.constrain(logits_bv.astype(jnp.float32), "sampled_rows", None)
    if cfg.greedy:
        tokens_b = jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
        return _back_to_rows(tokens_b, _logp_of(jax.nn.log_softmax(logits_bv, axis=-1), tokens_b))
    scaled_bv = logits_bv / cfg.temperature
    logp_bv = jax.nn.log_softmax(scaled_bv, axis=-1)
    if cfg.top_k:
        candidates_bo, index_bo = jax.lax.top_k(scaled_bv, min(cfg.top_k, scaled_bv.shape[-1]))  # most likely first
        if cfg.top_p < 1:
            probs_bo = jax.nn.softmax(candidates_bo, axis=-1)
            mass_before_bo = jnp.cumsum(probs_bo, axis=-1) - probs_bo
            candidates_bo = jnp.where(mass_before_bo < cfg.top_p, candidates_bo, -jnp.inf)
        choice_b = _inverse_cdf_draw(key_b, jax.nn.softmax(candidates_bo, axis=-1))
        tokens_b = jnp.take_along_axis(index_bo, choice_b[:, None], axis=1)[:, 0]
    else:
        probs_bv = jax.nn.softmax(scaled_bv, axis=-1)
        if cfg.top_p < 1:
            probs_bv = nucleus.nucleus_probs(probs_bv, cfg.top_p)
        tokens_b = _inverse_cdf_draw(key_b, probs_bv)
    return _back_to_rows(tokens_b, _logp_of(logp_bv, tokens_b))


def _back_to_rows(tokens_b: jax.Array, logp_b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The drawn tokens and their log-probs laid out as the batch's rows (gathering B numbers), so that the
    sampling's layout does not spread to the rest of the decode step."""
    return parallel.constrain(tokens_b, "batch"), parallel.constrain(logp_b, "batch")


def _inverse_cdf_draw(key_b: jax.Array, weights_bo: jax.Array) -> jax.Array:
    """One categorical draw per row with probabilities proportional to weights_bo (float32 >= 0, a row's sum > 0),
    by inverting the CDF with a single uniform per row: the draw is the index in [0, K) of the first cumulative
    weight >= u x the row's total.

    Gumbel-max (`jax.random.categorical`) needs K random numbers per row, which at a 152k vocabulary costs more
    than a decode step's forward pass; this needs one. Zero weights are never drawn.
    """
    cdf_bo = jnp.cumsum(weights_bo, axis=-1)
    u_b = 1.0 - jax.vmap(lambda key: jax.random.uniform(key, dtype=jnp.float32))(key_b)  # in (0, 1]
    below_bo = cdf_bo < (u_b * cdf_bo[:, -1])[:, None]
    return jnp.sum(below_bo, axis=-1, dtype=jnp.int32)


def _logp_of(logp_bv: jax.Array, tokens_b: jax.Array) -> jax.Array:
    return jnp.take_along_axis(logp_bv, tokens_b[:, None], axis=1)[:, 0]
