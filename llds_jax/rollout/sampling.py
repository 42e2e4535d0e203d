"""Drawing each sequence's next token from its logits, under jit (the rollout's step program,
`llds_jax.rollout.runner`, calls it once per decode iteration).

Log-probs are those of the sampling distribution over the full vocabulary: log_softmax(logits / temperature) in
float32, what the learner recomputes. Top-k / top-p only restrict which tokens can be drawn; the log-probs are not
renormalized over the kept set. Greedy decoding reports temperature-1 log-probs. Top-p takes the nucleus by
bisection (`nucleus`): no sort of the vocabulary (with top_k, among the k candidates).

A row's token and log-prob depend on its own logits and key alone, not on the other rows of its batch or the
batch's size (the engine's scheduling-independence): max, argmax, top_k and elementwise arithmetic do not depend on
an order, and every sum over a row is exact in integers (`nucleus`: fixed point), where a float32 sum's last bits
depend on how XLA tiles the reduction for the batch's shape. The sums: the softmax's normalizer Z = sum of
exp(x - max) (each term in units of 2**-51, so within V x 2**-51 of the float32 terms' sum, Z >= 1, then rounded to
float32), the nucleus's masses (`nucleus`: units of 2**-43, its rule and precision) and the draw's CDF. The
probabilities are exp(x - max) / Z; the log-prob at a token is (x - max) - log Z.

The draw inverts the CDF with one uniform per row, the CDF the exact running sum of the kept probabilities rounded
to float32 (`nucleus.mass_words`): a kept token is drawn with its share of the kept mass to within float32 rounding of
the cumulative, as a float32 cumsum would give; a token whose probability is below 2**-43 never is.

Dimension letters (docs/architecture.md, "Dimension letters"): B rows (sequences sampling), O candidate tokens
(the top_k most likely, or the vocabulary), V vocabulary, I chunks of the candidates and C candidates per chunk
(the draw's).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from llds_jax import parallel
from llds_jax.rollout import nucleus
from llds_jax.rollout.config import SamplingConfig


_WEIGHT_LEAD_BITS = 12  # a weight exp(x - max) <= 1: its leading word <= 2**12, a row's sum of them fits an int32
_WEIGHT_WORDS = 4  # units of 2**-(12 + 3 x 13) = 2**-51
_DRAW_CHUNK = 512  # candidates per chunk of the draw's CDF (`_inverse_cdf_draw`)


def sample_tokens(logits_bv: jax.Array, key_b: jax.Array, cfg: SamplingConfig) -> tuple[jax.Array, jax.Array]:
    """Draws one token per row. Returns (tokens int32 [B], log-probs float32 [B]), each row's independent of the
    other rows (module docstring).

    The log-prob is log_softmax(logits / temperature) over the full vocabulary at the drawn token (temperature 1
    when greedy); top-k and top-p only restrict the candidates. Top-p's nucleus is taken by bisection (`nucleus`:
    no sort, ties at the nucleus' smallest probability all kept), over the whole vocabulary, or with top_k among
    the k candidates.
    """
    # Each row's whole vocabulary on one device: the nucleus' and the draw's passes reduce over it (and left split
    # over the vocabulary, XLA's CPU compiler partitioned a cumsum over it into a reduce-window over the whole
    # vocabulary per output, O(V^2) per row). The rows are split over every mesh axis, so that the chips of a
    # tensor-parallel rollout each draw a share of them rather than all of them.
    logits_bv = parallel.constrain(logits_bv.astype(jnp.float32), "sampled_rows", None)
    if cfg.greedy:
        tokens_b = jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
        return _back_to_rows(tokens_b, _logp_of(*_normalized(logits_bv), tokens_b))
    shifted_bv, total_b = _normalized(logits_bv / cfg.temperature)
    if cfg.top_k:
        candidates_bo, index_bo = jax.lax.top_k(shifted_bv, min(cfg.top_k, shifted_bv.shape[-1]))
        choice_b = _draw(key_b, _probs(*_normalized(candidates_bo)), cfg.top_p)
        tokens_b = jnp.take_along_axis(index_bo, choice_b[:, None], axis=1)[:, 0]
    else:
        tokens_b = _draw(key_b, _probs(shifted_bv, total_b), cfg.top_p)
    return _back_to_rows(tokens_b, _logp_of(shifted_bv, total_b, tokens_b))


def _normalized(x_bv: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each row of logits less its max (float32 [B, V]) and its softmax normalizer Z = sum of exp(x - max) (float32
    [B], >= 1), summed exactly (module docstring)."""
    shifted_bv = x_bv - jnp.max(x_bv, axis=-1, keepdims=True)
    words_bv = nucleus.fixed_point(jnp.exp(shifted_bv), _WEIGHT_LEAD_BITS, _WEIGHT_WORDS)
    return shifted_bv, nucleus.to_float(nucleus.exact_sums(words_bv), _WEIGHT_LEAD_BITS)


def _probs(shifted_bv: jax.Array, total_b: jax.Array) -> jax.Array:
    """The softmax of `_normalized`'s parts: exp(x - max) / Z (float32 [B, V])."""
    return jnp.exp(shifted_bv) / total_b[:, None]


def _logp_of(shifted_bv: jax.Array, total_b: jax.Array, tokens_b: jax.Array) -> jax.Array:
    """The log-softmax at each row's token, of `_normalized`'s parts: (x - max) - log Z (float32 [B])."""
    return jnp.take_along_axis(shifted_bv, tokens_b[:, None], axis=1)[:, 0] - jnp.log(total_b)


def _draw(key_b: jax.Array, probs_bo: jax.Array, top_p: float) -> jax.Array:
    """One draw per row among its candidates' probabilities (float32 [B, O]), from the nucleus when top_p < 1: the
    index in [0, O) of the token drawn."""
    if top_p < 1:
        probs_bo = nucleus.nucleus_probs(probs_bo, top_p)
    return _inverse_cdf_draw(key_b, probs_bo)


def _back_to_rows(tokens_b: jax.Array, logp_b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The drawn tokens and their log-probs laid out as the batch's rows (gathering B numbers), so that the
    sampling's layout does not spread to the rest of the decode step."""
    return parallel.constrain(tokens_b, "batch"), parallel.constrain(logp_b, "batch")


def _inverse_cdf_draw(key_b: jax.Array, probs_bo: jax.Array) -> jax.Array:
    """One categorical draw per row with probabilities proportional to probs_bo (float32 >= 0, a row's sum in
    (0, 2)), by inverting the CDF with a single uniform per row: the draw is the first index i in [0, O) whose
    cumulative mass F(i) (the exact mass of tokens 0 .. i, `nucleus.mass_words`, rounded to float32) is >= u x
    F(O - 1). In two levels, without a cumsum over the row: the masses of chunks of C candidates (one pass), the
    first chunk whose end reaches the target, then the token within it.

    Gumbel-max (`jax.random.categorical`) needs O random numbers per row, which at a 152k vocabulary costs more
    than a decode step's forward pass; this needs one. Zero probabilities are never drawn: F is flat across them.
    """
    rows, candidates = probs_bo.shape
    chunk = min(_DRAW_CHUNK, candidates)
    chunks = -(-candidates // chunk)
    probs_bic = jnp.pad(probs_bo, ((0, 0), (0, chunks * chunk - candidates))).reshape(rows, chunks, chunk)
    chunk_words_bi = nucleus.mass_words(probs_bic)
    end_words_bi, ends_bi = _running_mass([0, 0], chunk_words_bi)  # F at each chunk's last candidate
    u_b = 1.0 - jax.vmap(lambda key: jax.random.uniform(key, dtype=jnp.float32))(key_b)  # in (0, 1]
    target_b1 = (u_b * ends_bi[:, -1])[:, None]
    chunk_b = jnp.sum(ends_bi < target_b1, axis=-1, dtype=jnp.int32)  # F(O - 1) >= the target: some chunk
    before_words_b1 = [jnp.take_along_axis(end - own, chunk_b[:, None], axis=1)  # the mass before the chunk
                       for end, own in zip(end_words_bi, chunk_words_bi)]
    in_chunk_bc = jnp.take_along_axis(probs_bic, chunk_b[:, None, None], axis=1)[:, 0]
    _, cdf_bc = _running_mass(before_words_b1, nucleus.prob_words(in_chunk_bc))
    return chunk * chunk_b + jnp.sum(cdf_bc < target_b1, axis=-1, dtype=jnp.int32)


def _running_mass(start_words: list, words: list[jax.Array]) -> tuple[list[jax.Array], jax.Array]:
    """The exact running mass along the last axis from `start_words` (ints, or int32 [B, 1] words), adding `words`
    (`nucleus.prob_words` or their sums, int32 [B, n] each): its carried words and its float32 value [B, n]."""
    running = nucleus.carried([start + jnp.cumsum(word, axis=-1) for start, word in zip(start_words, words)])
    return running, nucleus.to_float(running, nucleus.PROB_LEAD_BITS)
