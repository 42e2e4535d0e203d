"""Drawing tokens (`rollout.sampling`): the sampling distributions and their log-probs, and the step program on a mesh
drawing from each row's whole vocabulary."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from llds_jax import parallel
from llds_jax.model import ModelConfig, Transformer
from llds_jax.rollout import sampling
from llds_jax.rollout.config import SamplingConfig
from llds_jax.rollout.engine import EngineConfig
from llds_jax.rollout.runner import DeviceRunner
from llds_jax.rollout.sampling import sample_tokens

TEMPERATURE = 0.7


def draw(logits_v, cfg, n=4000):
    """n samples (tokens, log-probs) of one row of logits, each with its own key."""
    logits_nv = jnp.broadcast_to(jnp.asarray(logits_v, jnp.float32), (n, len(logits_v)))
    keys = jax.random.split(jax.random.key(0), n)
    tokens, logps = jax.jit(lambda l, k: sample_tokens(l, k, cfg))(logits_nv, keys)
    return np.asarray(tokens), np.asarray(logps)


LOGITS = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])


def frequencies(tokens, v=len(LOGITS)):
    return np.bincount(tokens, minlength=v) / len(tokens)


def test_temperature_sampling_matches_distribution_and_logp():
    tokens, logps = draw(LOGITS, SamplingConfig(temperature=TEMPERATURE))
    expected_logp = jax.nn.log_softmax(LOGITS / TEMPERATURE)
    np.testing.assert_allclose(logps, np.asarray(expected_logp)[tokens], atol=1e-6)
    np.testing.assert_allclose(frequencies(tokens), np.exp(expected_logp), atol=0.03)


def test_top_k_and_top_p_restrict_candidates_but_not_logp():
    full_logp = np.asarray(jax.nn.log_softmax(LOGITS / TEMPERATURE))
    probs = np.exp(full_logp)
    tokens, logps = draw(LOGITS, SamplingConfig(temperature=TEMPERATURE, top_k=3))
    assert set(tokens) == {0, 1, 2}
    np.testing.assert_allclose(frequencies(tokens)[:3], probs[:3] / probs[:3].sum(), atol=0.03)
    np.testing.assert_allclose(logps, full_logp[tokens], atol=1e-6)  # full-vocabulary log-probs
    # top_p: the smallest prefix of sorted tokens whose mass reaches p.
    p = probs[:2].sum() + 0.5 * probs[2]
    tokens, _ = draw(LOGITS, SamplingConfig(temperature=TEMPERATURE, top_p=float(p)))
    assert set(tokens) == {0, 1, 2}
    np.testing.assert_allclose(frequencies(tokens)[:3], probs[:3] / probs[:3].sum(), atol=0.03)
    tokens, _ = draw(LOGITS, SamplingConfig(temperature=TEMPERATURE, top_p=float(probs[0] * 0.5)))
    assert set(tokens) == {0}
    tokens, _ = draw(LOGITS, SamplingConfig(temperature=TEMPERATURE, top_k=4, top_p=float(p)))
    assert set(tokens) == {0, 1, 2}


def test_greedy_takes_argmax_with_temperature_one_logp():
    logits = np.array([0.1, 3.0, -1.0, 2.9])
    tokens, logps = draw(logits, SamplingConfig(greedy=True, temperature=0.5), n=4)
    assert (tokens == 1).all()
    np.testing.assert_allclose(logps, np.asarray(jax.nn.log_softmax(logits))[1], atol=1e-6)


def exact_cdf(probs_v: np.ndarray) -> np.ndarray:
    """The draw's CDF (float32 [V]): each probability's floor(p x 2**43) summed exactly (int64), then rounded to
    float32 as `nucleus.to_float` rounds its two carried words."""
    prefix_v = np.cumsum(np.floor(probs_v.astype(np.float64) * 2.0**43).astype(np.int64))
    return ((prefix_v & (2**13 - 1)).astype(np.float32) * np.float32(2.0**-43)
            + (prefix_v >> 13).astype(np.float32) * np.float32(2.0**-30))


def test_the_draw_is_the_first_token_whose_exact_cumulative_mass_reaches_u_times_the_total():
    """4,096 draws from each of four rows of 1,300 candidates (three chunks of the draw's 512, the last padded): each
    is the first token whose exact cumulative mass, rounded to float32, is >= u x the total (u = 1 - the key's
    uniform), as NumPy computes it in int64. Rows: one token of half the mass then 1,299 equal ones (where a float32
    cumsum drifts: it drew another token for one of the 4,096 keys), a random one, six tokens at chunk edges, and a
    sparse one summing to 0.9."""
    candidates, n = 1300, 4096
    rs = np.random.RandomState(0)
    drifting = np.full(candidates, 0.5 / (candidates - 1), np.float32)
    drifting[0] = 0.5
    edges = np.zeros(candidates, np.float32)
    edges[[3, 511, 512, 1023, 1024, 1299]] = [0.1, 0.2, 0.3, 0.15, 0.05, 0.2]
    spread = rs.exponential(size=candidates)
    sparse = (rs.rand(candidates) < 0.1) * rs.rand(candidates)
    rows = [drifting, (spread / spread.sum()).astype(np.float32), edges,
            (sparse / sparse.sum() * 0.9).astype(np.float32)]
    keys = jax.random.split(jax.random.key(1), n)
    u = 1 - np.asarray(jax.vmap(lambda key: jax.random.uniform(key, dtype=jnp.float32))(keys))
    draw = jax.jit(sampling._inverse_cdf_draw)
    for probs_v in rows:
        cdf_v = exact_cdf(probs_v)
        expected = np.argmax(cdf_v[None] >= (u * cdf_v[-1])[:, None], axis=1)
        np.testing.assert_array_equal(np.asarray(draw(keys, jnp.broadcast_to(probs_v, (n, candidates)))), expected)


def test_config_errors_name_the_key():
    with pytest.raises(ValueError, match="rollout.temperature"):
        SamplingConfig(temperature=0.0)
    with pytest.raises(ValueError, match="rollout.top_p"):
        SamplingConfig(top_p=1.5)
    with pytest.raises(ValueError, match="rollout.decode_chunk"):
        SamplingConfig(decode_chunk=0)


def test_the_step_program_on_a_mesh_samples_from_each_rows_whole_vocabulary():
    """The step program on a mesh samples from logits gathered over the vocabulary (split by rows only): left split
    over the tensor axis, XLA's CPU compiler turned the inverse-CDF draw's cumsum into a reduce-window over the whole
    vocabulary per output element (O(V^2) per row: 143x slower at Qwen's 151,936, bench/mesh_decode.py)."""
    graphdef, params = nnx.split(Transformer(ModelConfig.tiny(), rngs=nnx.Rngs(0)))
    mesh = parallel.make_mesh(data=2, fsdp=1, tensor=2, devices=jax.devices()[:4])
    engine = EngineConfig(max_seqs=4, token_budgets=(4,), decode_chunk=4, page_size=4, num_pages=17, max_context=16)
    runner = DeviceRunner(graphdef, ModelConfig.tiny(), SamplingConfig(top_p=1.0), engine, mesh)
    [step] = runner.abstract_programs(parallel.abstract_params(params, mesh))
    hlo = step.lower().compile().as_text()
    windows = [[int(n) for n in w.split("x")] for w in re.findall(r"reduce-window\(.*window=\{size=([0-9x]+)", hlo)]
    assert windows, "no reduce-window at all: the check below cannot bite"
    assert all(max(w) < ModelConfig.tiny().vocab_size for w in windows), windows
