"""Nucleus sampling without a sort (`llds_jax.rollout.nucleus`, and `sampling.sample_tokens` with top_p < 1 and no
top_k) against the sorted rule, written here in NumPy as the oracle: sort descending, keep each token whose mass
before it is below top_p."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from llds_jax.rollout import nucleus
from llds_jax.rollout.config import SamplingConfig
from llds_jax.rollout.sampling import sample_tokens

TOP_PS = (0.1, 0.5, 0.9, 0.95, 0.99)


def sorted_nucleus(probs_v: np.ndarray, top_p: float) -> np.ndarray:
    """The sorted rule's kept tokens (ascending ids): a stable descending sort, masses before each in float64."""
    order = np.argsort(-probs_v, kind="stable")
    sorted_v = probs_v[order].astype(np.float64)
    before_v = np.cumsum(sorted_v) - sorted_v
    return np.sort(order[before_v < top_p])


def boundary_margin(probs_v: np.ndarray, top_p: float) -> float:
    """How far top_p is from the mass above each distinct probability (float64), which decides whether the tokens
    of that probability are kept: where it is small, float32 sums may decide either way."""
    sorted_v = np.sort(probs_v.astype(np.float64))[::-1]
    before_v = np.cumsum(sorted_v) - sorted_v
    first_of_level = np.concatenate([[True], sorted_v[1:] < sorted_v[:-1]])
    return float(np.min(np.abs(before_v[first_of_level] - top_p)))


def softmax32(logits_bv: np.ndarray) -> np.ndarray:
    return np.asarray(jax.nn.softmax(jnp.asarray(logits_bv, jnp.float32), axis=-1))


def logit_rows(rs: np.random.RandomState, vocab: int) -> np.ndarray:
    """Rows of logits [8, vocab]: Gaussian at three scales, few distinct levels (many ties), one peaked, one flat, one
    heavy-tailed."""
    return np.stack([
        rs.randn(vocab), 3 * rs.randn(vocab), 0.3 * rs.randn(vocab),
        rs.randint(0, 4, vocab).astype(np.float64),  # ties everywhere
        np.round(2 * rs.randn(vocab)) / 2,  # ties at every level
        np.where(np.arange(vocab) == vocab // 3, 30.0, rs.randn(vocab)),  # one token holds ~all the mass
        np.zeros(vocab),  # flat: one tie of every token
        rs.standard_cauchy(vocab),
    ]).astype(np.float32)


@pytest.mark.parametrize("vocab", [7, 1000, 151_936])
def test_kept_set_and_renormalized_probabilities_are_the_sorted_rules(vocab):
    """The kept set is {p >= the smallest probability the sorted rule keeps}: the sorted rule's set plus the tokens
    tied with its last one; the threshold is that probability exactly. Rows and top_p values where a boundary mass
    lies within the rule's precision of top_p (`nucleus`: top_p taken as float32, masses exact to V x 2**-43) are
    skipped (the margin is checked): at 151,936 tokens, margins down to 9e-8 are checked."""
    probs_bv = softmax32(logit_rows(np.random.RandomState(vocab), vocab))
    mass_unit = 2.0**-(nucleus.PROB_LEAD_BITS + nucleus.WORD_BITS)  # 2**-43
    grew_by_ties = 0
    for top_p in TOP_PS:
        threshold_b = np.asarray(jax.jit(nucleus.nucleus_threshold, static_argnums=1)(probs_bv, top_p))
        kept_bv = np.asarray(jax.jit(nucleus.nucleus_probs, static_argnums=1)(probs_bv, top_p))
        for b, probs_v in enumerate(probs_bv):
            if boundary_margin(probs_v, top_p) < abs(top_p - np.float32(top_p)) + vocab * mass_unit:
                continue
            sorted_kept = sorted_nucleus(probs_v, top_p)
            smallest = probs_v[sorted_kept].min()
            expected = np.flatnonzero(probs_v >= smallest)
            assert threshold_b[b] == smallest  # exact: one of the row's float32 probabilities
            np.testing.assert_array_equal(np.flatnonzero(kept_bv[b]), expected)
            np.testing.assert_array_equal(kept_bv[b][expected], probs_v[expected])  # kept as they are
            np.testing.assert_allclose(kept_bv[b] / kept_bv[b].sum(),
                                       np.where(probs_v >= smallest, probs_v, 0) / probs_v[expected].sum(),
                                       rtol=1e-6, atol=0)
            grew_by_ties += len(expected) > len(sorted_kept)
    if vocab > 7:
        assert grew_by_ties > 0  # the tie rows reach the case where the two rules differ


def test_a_tie_at_the_threshold_is_kept_whole():
    """probs [0.2, 0.4, 0.2, 0.2], top_p 0.5: sorted, token 1 (mass before 0) and token 0 (0.4) are kept and
    tokens 2, 3 (0.6, 0.8) are not, though they tie with token 0; here all three 0.2 tokens are kept."""
    probs_v = np.array([0.2, 0.4, 0.2, 0.2], np.float32)
    assert sorted_nucleus(probs_v, 0.5).tolist() == [0, 1]
    kept = np.asarray(nucleus.nucleus_probs(jnp.asarray(probs_v[None]), 0.5))[0]
    assert kept.tolist() == probs_v.tolist()
    assert np.asarray(nucleus.nucleus_probs(jnp.asarray(probs_v[None]), 0.4))[0].tolist() == [0, probs_v[1], 0, 0]


def test_all_tokens_are_kept_when_the_mass_above_zero_is_below_top_p():
    """A row whose float32 mass sums below top_p keeps every token: the threshold is 0."""
    probs_v = np.array([0.5, 0.25, 0.0, 0.125], np.float32)  # sums to 0.875
    assert float(nucleus.nucleus_threshold(jnp.asarray(probs_v[None]), 0.9)[0]) == 0.0
    assert sorted_nucleus(probs_v, 0.9).tolist() == [0, 1, 2, 3]


def test_draws_follow_the_renormalized_nucleus_and_report_full_vocabulary_logps():
    """40,000 draws (one key each) from a 6-token row with a tie at the threshold: the counts fit the oracle's
    renormalized nucleus (chi-square), nothing outside it is drawn, and each log-prob is the full vocabulary's
    log_softmax(logits / T) at the token."""
    temperature, top_p, n = 0.8, 0.8, 40_000
    logits_v = np.array([1.0, 2.5, 1.0, -1.0, 1.0, 0.2], np.float32)
    probs_v = softmax32(logits_v[None] / temperature)[0]
    sorted_kept = sorted_nucleus(probs_v, top_p)
    assert boundary_margin(probs_v, top_p) > 1e-3
    kept = np.flatnonzero(probs_v >= probs_v[sorted_kept].min())
    assert kept.tolist() == [0, 1, 2, 4] and sorted_kept.tolist() == [0, 1, 2]  # token 4 ties with 0 and 2
    cfg = SamplingConfig(temperature=temperature, top_p=top_p)
    keys = jax.random.split(jax.random.key(11), n)
    tokens, logps = jax.jit(lambda l, k: sample_tokens(l, k, cfg))(jnp.broadcast_to(logits_v, (n, 6)), keys)
    tokens, logps = np.asarray(tokens), np.asarray(logps)
    counts = np.bincount(tokens, minlength=6)
    assert counts[[3, 5]].tolist() == [0, 0]
    expected = probs_v[kept].astype(np.float64) / probs_v[kept].astype(np.float64).sum() * n
    assert stats.chisquare(counts[kept], expected).pvalue > 1e-3
    full_logp_v = np.log(probs_v.astype(np.float64))
    np.testing.assert_allclose(logps, full_logp_v[tokens], atol=1e-5)


def boundary_logits(rs: np.random.RandomState, vocab: int, top_p: float) -> tuple[np.ndarray, float]:
    """A row of logits (float32 [vocab]) whose mass above its level of tied tokens is float32(top_p) to within
    float32 rounding, and that mass less float32(top_p) (float64): vocab / 500 tokens above the level, vocab / 50 at
    it (~10% of the mass: whether they are kept moves most draws), the rest far below; the largest logit solved for
    in float64, then rounded to float32."""
    level = -1.0
    head, ties = vocab // 500, vocab // 50
    row_v = np.concatenate([np.clip(rs.randn(head) + 3, 0, None), np.full(ties, level),
                            np.clip(0.7 * rs.randn(vocab - head - ties) - 7, None, level - 2)])[rs.permutation(vocab)]
    weights_v = np.exp(row_v)
    above_v, largest = row_v > level, np.argmax(row_v)
    rest_above, below = weights_v[above_v].sum() - weights_v[largest], weights_v[~above_v].sum()
    target = float(np.float32(top_p))
    row_v[largest] = np.log((target * (rest_above + below) - rest_above) / (1 - target))
    row_v = row_v.astype(np.float32)
    weights_v = np.exp(row_v.astype(np.float64))
    return row_v, weights_v[above_v].sum() / weights_v.sum() - target


@pytest.mark.parametrize("vocab", [1000, pytest.param(151_936, marks=pytest.mark.slow)])
def test_a_rows_kept_set_and_token_do_not_depend_on_its_batch(vocab):
    """Eight rows whose mass above a level of tied tokens is within float32 rounding of top_p: alone and inside batches
    of 8, 32 and 128 (random rows beside them, the eight at random places), each row's threshold and kept
    probabilities, and from its logits with its own key its sampled token and log-prob, are the same bit for bit.
    The rows are at the boundary: some keep their tied tokens, some do not. (With float32 sums, XLA's CPU reduction
    of a row differs in its last bits between batch shapes: at 151,936 tokens five of the eight rows' thresholds
    and kept sets moved inside the batches of 32 and 128, at 1,000 tokens two rows' tokens inside each batch.)"""
    top_p, probes = 0.9, 8
    rs = np.random.RandomState(vocab)
    rows = [boundary_logits(rs, vocab, top_p) for _ in range(probes)]
    assert max(abs(margin) for _, margin in rows) < 2**-24  # float32's spacing at top_p
    logits_pv = np.stack([row_v for row_v, _ in rows])
    probs_pv = softmax32(logits_pv)
    keys = jax.random.split(jax.random.key(0), probes + 128)  # the eight rows' own, then their neighbours'
    threshold = jax.jit(nucleus.nucleus_threshold, static_argnums=1)
    kept = jax.jit(nucleus.nucleus_probs, static_argnums=1)
    sample = jax.jit(lambda logits_bv, key_b: sample_tokens(logits_bv, key_b, SamplingConfig(top_p=top_p)))

    def each_row(probs_bv, logits_bv, key_b):
        arrays = (threshold(probs_bv, top_p), kept(probs_bv, top_p), *sample(logits_bv, key_b))
        return [tuple(np.asarray(a)[b] for a in arrays) for b in range(len(probs_bv))]

    alone = [each_row(probs_pv[p:p + 1], logits_pv[p:p + 1], keys[p:p + 1])[0] for p in range(probes)]
    assert len({int(np.count_nonzero(kept_v)) for _, kept_v, _, _ in alone}) == 2  # tied tokens kept, or not
    for batch in (8, 32, 128):
        places = rs.permutation(batch)[:probes]
        logits_bv = (3 * rs.randn(batch, vocab)).astype(np.float32)
        logits_bv[places] = logits_pv
        probs_bv = np.array(softmax32(logits_bv))
        probs_bv[places] = probs_pv
        together = each_row(probs_bv, logits_bv, keys[probes:probes + batch].at[places].set(keys[:probes]))
        for p, place in enumerate(places):
            for got, want in zip(together[place], alone[p]):
                np.testing.assert_array_equal(got, want, err_msg=f"row {p} at {place} of a batch of {batch}")
