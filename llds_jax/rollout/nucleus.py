"""Nucleus (top-p) sampling's kept set over the whole vocabulary without a sort: each row's probability threshold
found by bisection on the bit pattern of float32 probabilities (`nucleus_probs`).

The nucleus of a row is the sorted rule's: in descending order of probability, keep each token whose mass before it
(the sum of the tokens ahead of it) is below top_p. With S(x) = the mass of the tokens whose probability is
strictly above x, the smallest probability kept is t = min{x : S(x) < top_p}: the first token of a run of equal
probabilities v has mass S(v) before it, so v is kept iff S(v) < top_p, and S decreases as x grows. The kept set
here is {tokens with probability >= t}; it differs from the sorted rule only where tokens tie at t, which the sorted
rule splits by their place in the order (the first ones kept) and this keeps all: the kept set depends on the
probabilities alone, not on token ids.

Bisection: non-negative float32 values are ordered as their int32 bit patterns, and softmax probabilities lie in
[0, 1], whose bit patterns are the integers 0 .. 0x3F800000 (1.0): 0x3F800001 <= 2**30 candidates. A bisection
step keeps the smallest candidate satisfying S < top_p inside its interval and halves the interval's size (n to at
most ceil(n / 2)), so BISECTION_STEPS = 30 steps narrow 2**30 candidates to the one: the threshold is exact, a
probability of the row (or 0, when the whole vocabulary's mass is below top_p). Each step is one masked sum over
the vocabulary, in float32: O(30 V) per row instead of a sort's O(V log V) with its data movement. S is summed in a
different order than a sorted cumsum, so a boundary mass within float32 rounding of top_p may fall either way.

Dimension letters: B rows, V vocabulary.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

BISECTION_STEPS = 30  # ceil(log2(0x3F800001)): the bit patterns of float32 values in [0, 1]
_ONE_BITS = 0x3F800000  # the int32 bit pattern of float32 1.0


def nucleus_threshold(probs_bv: jax.Array, top_p: float) -> jax.Array:
    """Each row's smallest kept probability t = min{x : mass of probabilities > x is below top_p} (float32 [B]).

    probs_bv: float32 [B, V] probabilities of each row (non-negative, each at most 1; a row sums to ~1).
    top_p: the nucleus mass, in (0, 1].
    """
    probs_bv = probs_bv.astype(jnp.float32)

    def mass_above_below_top_p(bits_b: jax.Array) -> jax.Array:
        x_b = jax.lax.bitcast_convert_type(bits_b, jnp.float32)
        return jnp.sum(jnp.where(probs_bv > x_b[:, None], probs_bv, 0.0), axis=-1) < top_p

    def step(_, bounds):
        lo_b, hi_b = bounds  # the answer's bit pattern lies in [lo_b, hi_b]
        mid_b = lo_b + (hi_b - lo_b) // 2
        ok_b = mass_above_below_top_p(mid_b)
        return jnp.where(ok_b, lo_b, mid_b + 1), jnp.where(ok_b, mid_b, hi_b)

    rows = probs_bv.shape[0]
    bounds = (jnp.zeros((rows,), jnp.int32), jnp.full((rows,), _ONE_BITS, jnp.int32))  # S(1.0) = 0 < top_p
    _, hi_b = jax.lax.fori_loop(0, BISECTION_STEPS, step, bounds)
    return jax.lax.bitcast_convert_type(hi_b, jnp.float32)


def nucleus_probs(probs_bv: jax.Array, top_p: float) -> jax.Array:
    """The probabilities with every token outside the row's nucleus set to 0 (float32 [B, V], not renormalized):
    the tokens kept are those at or above `nucleus_threshold`."""
    probs_bv = probs_bv.astype(jnp.float32)
    return jnp.where(probs_bv >= nucleus_threshold(probs_bv, top_p)[:, None], probs_bv, 0.0)
