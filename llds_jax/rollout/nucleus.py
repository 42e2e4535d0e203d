"""Nucleus (top-p) sampling's kept set over the whole vocabulary without a sort, the same whatever the batch: each
row's probability threshold found by bisection on the bit pattern of float32 probabilities (`nucleus_probs`), every
mass summed exactly in integers (`fixed_point`, `exact_sums`).

The rule. A row's probabilities p_i (float32) weigh q_i = floor(p_i x 2**43) units of 2**-43 each (`mass_words`),
summed in int32 words without rounding; top_p weighs q(float32(top_p)) the same way. With S(x) = the sum of q_i over
the tokens whose probability is strictly above x, the smallest probability kept is t = min{x : S(x) < q(top_p)},
and the kept set is {tokens with probability >= t}. This is the sorted rule's (in descending order of probability,
keep each token whose mass before it is below top_p): the first token of a run of equal probabilities v has mass
S(v) before it, so v is kept iff S(v) < q(top_p), and S decreases as x grows. It differs from the sorted rule only
where tokens tie at t, which the sorted rule splits by their place in the order (the first ones kept) and this
keeps all: the kept set depends on the probabilities alone, not on token ids.

Its precision, exactly: S(x) x 2**-43 is at most the real sum m(x) of the float32 probabilities above x and more
than m(x) - V x 2**-43 (each q_i loses less than 2**-43), and q(top_p) x 2**-43 is float32(top_p) exactly (for
top_p >= 2**-19). So a boundary mass below float32(top_p) keeps its token, as the sorted rule in real arithmetic
does, and one at or above float32(top_p) + V x 2**-43 (1.8e-8 at V = 152,064) does not; one in between may count as
below. The threshold is exact: a probability of the row (or 0, when the whole vocabulary's mass is below top_p).

Batch invariance: integer addition is associative, so a sum is the same in whatever order XLA reduces it: a row's
threshold and kept set depend on its own probabilities alone, not on the other rows of its batch or the batch's
size. (Float32 sums would not be: XLA's CPU reduction of the same row differs in its last bits between a batch of
1 and one of 8 or 32, which moved a boundary within float32 rounding of top_p from one side to the other.)

Fixed point: a float32 x >= 0 is split into int32 words, most significant first (`fixed_point`): floor(x x
2**lead_bits), then WORD_BITS bits of the fraction per word. Exact: a power-of-two scaling, a floor and a float32's
fraction (x - floor(x)) are exact in float32. A probability's leading word is at most 2**30 and a row's
probabilities sum to below 2, so the leading words' sum fits an int32; a word of WORD_BITS bits is below 2**13,
so a sum of up to MAX_TERMS (262,176) of them does; carries between words are taken after the sum.

Bisection: non-negative float32 values are ordered as their int32 bit patterns, and probabilities lie in [0, 1],
whose bit patterns are the integers 0 .. 0x3F800000 (1.0): 0x3F800001 <= 2**30 candidates. A bisection step keeps
the smallest candidate satisfying S < q(top_p) inside its interval and halves the interval's size (n to at most
ceil(n / 2)), so BISECTION_STEPS = 30 steps narrow 2**30 candidates to the one. Each step is one pass over the
vocabulary, one reduction of two int32 words per token (each q_i's, computed in the pass): O(30 V) per row instead
of a sort's O(V log V) with its data movement.

Dimension letters: B rows, V vocabulary (or a row's candidates).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

BISECTION_STEPS = 30  # ceil(log2(0x3F800001)): the bit patterns of float32 values in [0, 1]
_ONE_BITS = 0x3F800000  # the int32 bit pattern of float32 1.0
WORD_BITS = 13  # the bits of each word after the leading one (`fixed_point`)
MAX_TERMS = (2**31 - 1) // (2**WORD_BITS - 1)  # 262,176: a sum of this many WORD_BITS-bit words fits an int32
PROB_LEAD_BITS = 30  # a probability's leading word: floor(p x 2**30) <= 2**30


def fixed_point(x: jax.Array, lead_bits: int, num_words: int) -> list[jax.Array]:
    """floor(x x 2**(lead_bits + WORD_BITS x (num_words - 1))) of float32 x >= 0, as num_words int32 arrays of x's
    shape, most significant first: floor(x x 2**lead_bits), then each next WORD_BITS bits of the fraction (module
    docstring: exact). x x 2**lead_bits must be below 2**31."""
    rest = x.astype(jnp.float32) * 2.0**lead_bits
    words = [jnp.floor(rest)]
    for _ in range(num_words - 1):
        rest = (rest - words[-1]) * 2.0**WORD_BITS
        words.append(jnp.floor(rest))
    return [word.astype(jnp.int32) for word in words]


def exact_sums(words_bv: list[jax.Array]) -> list[jax.Array]:
    """Each row's exact sum of `fixed_point` words along the last axis, carried: int32 words ([B] each for [B, V]),
    each after the first below 2**WORD_BITS. The same in any order of summation. The row's sum of the leading words
    must fit an int32, and a row hold at most MAX_TERMS entries."""
    _check_terms(words_bv[0].shape[-1])
    # One reduction of all the words (a pass over the row, not one per word).
    return carried(jax.lax.reduce(tuple(words_bv), (jnp.int32(0),) * len(words_bv),
                                  lambda a, b: tuple(x + y for x, y in zip(a, b)), (words_bv[0].ndim - 1,)))


def carried(words: list[jax.Array] | tuple[jax.Array, ...]) -> list[jax.Array]:
    """Words (int32, elementwise; sums or differences of `fixed_point` words) with their carries taken: the same
    value, each word after the first in [0, 2**WORD_BITS). The value's leading word must fit an int32."""
    words = list(words)
    for k in range(len(words) - 1, 0, -1):
        words[k - 1] = words[k - 1] + (words[k] >> WORD_BITS)  # arithmetic shift: floor, for negative words too
        words[k] = words[k] & (2**WORD_BITS - 1)
    return words


def to_float(words: list[jax.Array], lead_bits: int) -> jax.Array:
    """The float32 value of `carried` words, elementwise: each word scaled by its power of two, added from the least
    significant. Within float32 rounding of the value, and non-decreasing in it (two words: below 2**24 in the
    leading word, one rounding of the exact value; above, the leading word's rounding, the next adding less than
    half a unit in the last place)."""
    value = jnp.zeros(words[0].shape, jnp.float32)
    for k in range(len(words) - 1, -1, -1):
        value = value + words[k].astype(jnp.float32) * 2.0**-(lead_bits + WORD_BITS * k)
    return value


def prob_words(probs_bv: jax.Array) -> list[jax.Array]:
    """Each probability's q_i = floor(p_i x 2**43) (module docstring) as two int32 words of its shape: units of
    2**-30 (PROB_LEAD_BITS) and 2**-43."""
    return fixed_point(probs_bv, PROB_LEAD_BITS, 2)


def mass_words(probs_bv: jax.Array) -> list[jax.Array]:
    """Each row's exact mass along the last axis, the sum of its q_i, as carried `prob_words` ([B] each for [B, V]):
    the same whatever the batch. A row's probabilities must sum to below 2."""
    return exact_sums(prob_words(probs_bv))


def _check_terms(terms: int) -> None:
    """Raises unless a row of `terms` entries has sums that fit their int32 words (MAX_TERMS)."""
    if terms > MAX_TERMS:
        raise ValueError(f"exact sums take rows of at most {MAX_TERMS:,} entries (int32 words of {WORD_BITS} bits); "
                         f"got {terms:,}")


def nucleus_threshold(probs_bv: jax.Array, top_p: float) -> jax.Array:
    """Each row's smallest kept probability t = min{x : mass of the probabilities > x is below top_p}, masses exact
    in units of 2**-43 (module docstring). Returns float32 [B].

    probs_bv: float32 [B, V] probabilities of each row (non-negative, each at most 1; a row sums to below 2).
    top_p: the nucleus mass, in (0, 1] (a Python float or a float32 scalar; taken as float32).
    """
    probs_bv = probs_bv.astype(jnp.float32)
    top_p_words = prob_words(jnp.asarray(top_p, jnp.float32))

    def mass_above_below_top_p(bits_b: jax.Array) -> jax.Array:
        x_b = jax.lax.bitcast_convert_type(bits_b, jnp.float32)
        # The words of the masked probabilities, not the masked words of the probabilities: computed in the pass,
        # rather than hoisted out of the loop as two more [B, V] arrays read from memory at every step.
        high_b, low_b = mass_words(jnp.where(probs_bv > x_b[:, None], probs_bv, 0.0))
        return (high_b < top_p_words[0]) | ((high_b == top_p_words[0]) & (low_b < top_p_words[1]))

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
