"""The MLP over slices of its width (model.mlp_chunks) against the whole MLP: values and gradients, a Transformer
forward and backward, and the bad values."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llds_jax.model import mlp
from llds_jax.model.config import ModelConfig


def _inputs(dtype, b=2, t=5, d=8, f=12):
    keys = jax.random.split(jax.random.PRNGKey(0), 5)
    h = jax.random.normal(keys[0], (b, t, d), dtype)
    gate = jax.random.normal(keys[1], (d, f), dtype) / 3
    up = jax.random.normal(keys[2], (d, f), dtype) / 3
    down = jax.random.normal(keys[3], (f, d), dtype) / 3
    d_out = jax.random.normal(keys[4], (b, t, d), dtype)
    return (h, gate, up, down), d_out


def _numpy_swiglu(h, gate, up, down):
    """An independent float64 formula: down(silu(h gate) * (h up))."""
    h, gate, up, down = (np.asarray(a, np.float64) for a in (h, gate, up, down))
    pre = h @ gate
    return ((pre / (1 + np.exp(-pre))) * (h @ up)) @ down


@pytest.mark.parametrize("chunks", [2, 3, 6])
def test_sliced_mlp_values_and_gradients_equal_the_whole(chunks):
    args, d_out = _inputs(jnp.float32)
    whole, whole_vjp = jax.vjp(lambda *a: mlp.swiglu(*a, chunks=1), *args)
    sliced, sliced_vjp = jax.vjp(lambda *a: mlp.swiglu(*a, chunks=chunks), *args)
    np.testing.assert_allclose(whole, _numpy_swiglu(*args), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(sliced, whole, rtol=1e-6, atol=1e-6)
    for got, want in zip(sliced_vjp(d_out), whole_vjp(d_out)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_sliced_mlp_bfloat16_weight_gradients_are_the_whole_paths_columns():
    """In bfloat16 each slice's weight gradients are exactly the whole path's columns (the same sums over tokens);
    the output and the input gradient differ from it by at most one rounding."""
    args, d_out = _inputs(jnp.bfloat16, b=2, t=64, d=32, f=48)
    whole, whole_vjp = jax.vjp(lambda *a: mlp.swiglu(*a, chunks=1), *args)
    sliced, sliced_vjp = jax.vjp(lambda *a: mlp.swiglu(*a, chunks=4), *args)
    assert sliced.dtype == whole.dtype == jnp.bfloat16
    (dh_s, *dw_s), (dh_w, *dw_w) = sliced_vjp(d_out), whole_vjp(d_out)
    for got, want in zip(dw_s, dw_w):
        assert got.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    reference = _numpy_swiglu(*args)
    scale = np.abs(reference).max()
    # The sliced output is the float64 result rounded about once; the whole path's within the same bound.
    for out in (sliced, whole):
        assert np.abs(np.asarray(out, np.float64) - reference).max() <= 2 ** -7 * scale
    np.testing.assert_allclose(np.asarray(dh_s, np.float32), np.asarray(dh_w, np.float32),
                               atol=2 ** -6 * float(jnp.abs(dh_w.astype(jnp.float32)).max()))


@pytest.mark.slow
def test_transformer_with_sliced_mlp_matches_whole_under_remat_and_scan():
    from flax import nnx
    from llds_jax.model.transformer import Transformer

    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 7), 0, 256)

    def loss_and_grads(chunks):
        model = Transformer(ModelConfig.tiny(mlp_chunks=chunks, remat=True), rngs=nnx.Rngs(0))
        graphdef, state = nnx.split(model)

        def loss(state):
            return jnp.mean(jax.nn.log_softmax(nnx.merge(graphdef, state)(tokens))[..., 0])
        return jax.value_and_grad(loss)(state)

    def sliced_in_jaxpr(chunks):
        model = Transformer(ModelConfig.tiny(mlp_chunks=chunks, remat=True), rngs=nnx.Rngs(0))
        return "custom_vjp_call" in str(jax.make_jaxpr(model)(tokens))

    # The model takes the sliced path only when asked (else the comparison below would compare the whole with itself).
    assert (sliced_in_jaxpr(1), sliced_in_jaxpr(4)) == (False, True)
    (l1, g1), (l4, g4) = loss_and_grads(1), loss_and_grads(4)
    np.testing.assert_allclose(l4, l1, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g4), jax.tree.leaves(g1)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("chunks, message", [
    (0, r"model\.mlp_chunks must be >= 1, got 0"),
    (2.0, r"model\.mlp_chunks must be an integer >= 1, got 2\.0"),
    (5, r"model\.mlp_chunks \(5\) must divide the MLP width intermediate_size \(64\)"),
])
def test_bad_mlp_chunks_name_the_key(chunks, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.tiny(mlp_chunks=chunks)
