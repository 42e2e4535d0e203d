"""Prefill + decode + extend through the KV cache equals a full forward over the same tokens."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from llds_jax.model import ModelConfig, Transformer, init_cache


def _model(**overrides):
    return Transformer(ModelConfig.tiny(**overrides), rngs=nnx.Rngs(0))


def _full_logits(model, rows):
    """Logits of a full forward per row (each row: list of its real tokens, no padding)."""
    return [np.asarray(model(jnp.asarray([r]))[0]) for r in rows]


@pytest.mark.slow
def test_prefill_decode_extend_equal_full_forward():
    model = _model()
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(1, 256, n)) for n in (7, 3, 5)]
    # Multi-turn continuation per row: decode 2 single tokens, then extend by ragged chunks, then decode 1.
    decode_steps = [[int(rng.integers(1, 256)) for _ in range(3)] for _ in range(3)]
    extend_chunks = [list(rng.integers(1, 256, n)) for n in (4, 1, 0)]
    rows = [p + d[:2] + e + d[2:] for p, d, e in zip(prompts, decode_steps, extend_chunks)]
    ref = _full_logits(model, rows)

    cache = init_cache(model.cfg, batch_size=3, capacity=32)
    got = [[] for _ in range(3)]
    # Prefill, left padded to 7.
    pl = max(map(len, prompts))
    toks = np.zeros((3, pl), np.int32)
    valid = np.zeros((3, pl), bool)
    for b, p in enumerate(prompts):
        toks[b, pl - len(p):] = p
        valid[b, pl - len(p):] = True
    h, cache = model.extend(jnp.asarray(toks), jnp.asarray(valid), cache)
    logits = np.asarray(model.logits(h))
    for b in range(3):
        got[b].extend(logits[b][valid[b]])
    # Two decode steps.
    for step in range(2):
        h, cache = model.extend(jnp.asarray([[d[step]] for d in decode_steps]), jnp.ones((3, 1), bool), cache)
        for b, row in enumerate(np.asarray(model.logits(h))):
            got[b].append(row[0])
    # Ragged extend, right padded to 4 (row 2 appends nothing).
    toks = np.zeros((3, 4), np.int32)
    valid = np.zeros((3, 4), bool)
    for b, e in enumerate(extend_chunks):
        toks[b, :len(e)] = e
        valid[b, :len(e)] = True
    h, cache = model.extend(jnp.asarray(toks), jnp.asarray(valid), cache)
    logits = np.asarray(model.logits(h))
    for b in range(3):
        got[b].extend(logits[b][valid[b]])
    h, cache = model.extend(jnp.asarray([[d[2]] for d in decode_steps]), jnp.ones((3, 1), bool), cache)
    for b, row in enumerate(np.asarray(model.logits(h))):
        got[b].append(row[0])

    for b in range(3):
        assert len(got[b]) == len(rows[b])
        np.testing.assert_allclose(np.stack(got[b]), ref[b], atol=1e-5, rtol=0)
    np.testing.assert_array_equal(np.asarray(cache.next_pos_b), [len(r) for r in rows])
    # Row 2's right-padded slots were not kept: its end sits right after its last real token.
    assert int(cache.end_b[2]) == pl + 2 + 0 + 1


def test_decode_of_a_finished_row_changes_nothing():
    """A row that writes an invalid token (valid=False) keeps its cache position and its other logits."""
    model = _model()
    cache = init_cache(model.cfg, batch_size=2, capacity=8)
    _, cache = model.extend(jnp.asarray([[5, 6], [7, 8]]), jnp.ones((2, 2), bool), cache)
    _, after = model.extend(jnp.asarray([[9], [9]]), jnp.asarray([[True], [False]]), cache)
    assert list(np.asarray(after.end_b)) == [3, 2] and list(np.asarray(after.next_pos_b)) == [3, 2]
    h, _ = model.extend(jnp.asarray([[3], [3]]), jnp.ones((2, 1), bool), after)
    full = np.asarray(model(jnp.asarray([[7, 8, 3]])))[0, -1]
    np.testing.assert_allclose(np.asarray(model.logits(h))[1, 0], full, atol=1e-5)


def test_jitted_extend_matches_eager():
    model = _model()
    graphdef, state = nnx.split(model)

    @jax.jit
    def step(state, toks, valid, cache):
        h, cache = nnx.merge(graphdef, state).extend(toks, valid, cache)
        return h, cache

    cache = init_cache(model.cfg, 2, 8)
    toks, valid = jnp.asarray([[0, 4, 5], [1, 2, 3]]), jnp.asarray([[False, True, True], [True] * 3])
    h_jit, _ = step(state, toks, valid, cache)
    h_eager, _ = model.extend(toks, valid, cache)
    np.testing.assert_allclose(np.asarray(h_jit)[np.asarray(valid)], np.asarray(h_eager)[np.asarray(valid)],
                               atol=1e-6)


def test_extend_in_passes_equals_one_pass():
    """extend_chunk: right-padded observations of 0 to 13 tokens appended in passes of 4 tokens (a row's tokens
    may end inside any pass, or fill none) give one pass's hidden states at every real token and its cache."""
    whole, passes = _model(), _model(extend_chunk=4)
    rng = np.random.default_rng(1)
    prompt = jnp.asarray(rng.integers(1, 256, (4, 5)), jnp.int32)
    lengths = [13, 0, 4, 9]
    obs = np.zeros((4, 16), np.int32)
    valid = np.zeros((4, 16), bool)
    for b, n in enumerate(lengths):
        obs[b, :n] = rng.integers(1, 256, n)
        valid[b, :n] = True
    out = {}
    for name, model in (("whole", whole), ("passes", passes)):
        cache = init_cache(model.cfg, batch_size=4, capacity=32)
        _, cache = model.extend(prompt, jnp.ones((4, 5), bool), cache, prefill=True)
        out[name] = jax.jit(lambda t, v, c, m=model: m.extend(t, v, c))(jnp.asarray(obs), jnp.asarray(valid), cache)
    (h_whole, c_whole), (h_passes, c_passes) = out["whole"], out["passes"]
    np.testing.assert_allclose(np.asarray(h_passes)[valid], np.asarray(h_whole)[valid], atol=1e-5)
    for field in ("valid_bs", "end_b", "next_pos_b"):
        np.testing.assert_array_equal(getattr(c_passes, field), getattr(c_whole, field))
    real_ls = np.asarray(c_whole.valid_bs)
    np.testing.assert_allclose(np.asarray(c_passes.k_lbskh)[:, real_ls], np.asarray(c_whole.k_lbskh)[:, real_ls],
                               atol=1e-5)
    np.testing.assert_array_equal(np.asarray(c_whole.end_b), 5 + np.asarray(lengths))
