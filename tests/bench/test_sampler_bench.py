"""bench/sampler.py's textbook reference draws from the nucleus the rollout's sampler keeps (so the bench times two
samplers of one distribution): a NumPy nucleus of each row's probabilities, sorted, holds every token the reference
draws, and greedy agrees with the argmax."""
import jax
import jax.numpy as jnp
import numpy as np

from llds_jax.rollout.config import SamplingConfig
from tests.bench.loading import load_bench


def numpy_nucleus(logits_v: np.ndarray, top_p: float) -> set[int]:
    """The smallest set of most likely tokens whose mass reaches top_p (float64)."""
    probs_v = np.exp(logits_v - logits_v.max())
    probs_v /= probs_v.sum()
    order = np.argsort(-probs_v, kind="stable")
    before = np.cumsum(probs_v[order]) - probs_v[order]
    return set(order[before < top_p].tolist())


def test_the_reference_draws_inside_the_nucleus_and_its_log_probs_are_the_full_softmax():
    bench = load_bench("sampler")
    logits_bv = 3.0 * jax.random.normal(jax.random.key(0), (16, 300), jnp.float32)
    x = np.asarray(logits_bv, np.float64)
    for draw in range(4):
        tokens_b, logp_b = bench.reference_sample(logits_bv, jax.random.key(draw), SamplingConfig(top_p=0.5))
        for row, token in enumerate(np.asarray(tokens_b)):
            assert int(token) in numpy_nucleus(x[row], 0.5)
        full = x - x.max(1, keepdims=True)
        full -= np.log(np.exp(full).sum(1, keepdims=True))
        np.testing.assert_allclose(np.asarray(logp_b), full[np.arange(16), np.asarray(tokens_b)], rtol=1e-5)
    tokens_b, _ = bench.reference_sample(logits_bv, jax.random.key(0), SamplingConfig(greedy=True))
    np.testing.assert_array_equal(np.asarray(tokens_b), x.argmax(1))
    top_k, _ = bench.reference_sample(logits_bv, jax.random.key(0), SamplingConfig(top_k=3, top_p=0.99))
    top3 = np.argsort(-x, axis=1)[:, :3]
    assert all(int(t) in top3[row] for row, t in enumerate(np.asarray(top_k)))
