"""Chunked (and vocab-sharded) log-probs and entropies against the full-logits computation."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from llds_jax.aot import compile_check
from llds_jax.model import Transformer
from llds_jax.rl.logprobs import model_token_logp, token_logp_entropy

B, T, D, V = 4, 37, 16, 96  # T is not a multiple of the chunk; V/4 = 24 per tensor shard
TEMPERATURE = 0.7


def naive(hidden_btd, w_dv, targets_bt):
    """Full [B, T, V] logits, log_softmax, gather; entropy -sum p log p."""
    logp_btv = jax.nn.log_softmax((hidden_btd @ w_dv) / TEMPERATURE, axis=-1)
    logp_bt = jnp.take_along_axis(logp_btv, targets_bt[..., None], axis=-1)[..., 0]
    return logp_bt, -jnp.sum(jnp.exp(logp_btv) * logp_btv, axis=-1)


def weighted_sum(fn):
    """A scalar mixing both outputs with distinct weights, and its gradient wrt (hidden, w)."""
    weights_t = jnp.cos(jnp.arange(T, dtype=jnp.float32))

    def scalar(hidden_btd, w_dv, targets_bt):
        logp_bt, entropy_bt = fn(hidden_btd, w_dv, targets_bt)
        return jnp.sum(logp_bt * weights_t) + jnp.sum(entropy_bt * weights_t[::-1])

    return jax.value_and_grad(scalar, argnums=(0, 1))


@pytest.fixture(scope="module")
def inputs():
    k = jax.random.split(jax.random.key(0), 3)
    return (jax.random.normal(k[0], (B, T, D)), 0.5 * jax.random.normal(k[1], (D, V)),
            jax.random.randint(k[2], (B, T), 0, V))


@pytest.fixture(scope="module")
def reference(inputs):
    return naive(*inputs), jax.jit(weighted_sum(naive))(*inputs)


def assert_close(got, want):
    # 2e-5: the gradient wrt w sums B x T = 148 float32 terms of order 1, in another order per layout (chunks,
    # shards); one element of 1536 differed by 1.1e-5 from the full-logits reference on one CPU model.
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5, rtol=1e-5)


def test_chunked_equals_full_logits_with_gradients(inputs, reference):
    chunked = lambda h, w, t: token_logp_entropy(h, w, t, temperature=TEMPERATURE, time_chunk=8)  # noqa: E731
    assert_close(jax.jit(chunked)(*inputs), reference[0])
    assert_close(jax.jit(weighted_sum(chunked))(*inputs), reference[1])


def all_gather_shapes(hlo_text):
    """Output shapes of every all-gather in compiled HLO text, e.g. [[4, 8, 96]]."""
    return [list(dims) for _, dims in compile_check.all_gather_shapes(hlo_text)]


@pytest.mark.parametrize("axis_type, mesh_shape", [(AxisType.Auto, (2, 1, 4)), (AxisType.Explicit, (2, 1, 4)),
                                                   (AxisType.Auto, (1, 4, 2)), (AxisType.Explicit, (2, 2, 2))])
def test_vocab_sharded_on_8_devices_matches_and_never_gathers_logits(inputs, reference, axis_type, mesh_shape):
    """V split over (fsdp, tensor) as the parameters are; the batch over (data, fsdp), the rows of an fsdp group
    gathered one chunk of hidden states at a time."""
    mesh = jax.make_mesh(mesh_shape, ("data", "fsdp", "tensor"), axis_types=(axis_type,) * 3)
    hidden, w, targets = inputs
    hidden = jax.device_put(hidden, NamedSharding(mesh, P(("data", "fsdp"))))
    w = jax.device_put(w, NamedSharding(mesh, P(None, ("fsdp", "tensor"))))
    targets = jax.device_put(targets, NamedSharding(mesh, P(("data", "fsdp"))))
    sharded = lambda h, w, t: token_logp_entropy(h, w, t, temperature=TEMPERATURE, time_chunk=8, mesh=mesh)  # noqa
    assert_close(jax.jit(sharded)(hidden, w, targets), reference[0])
    value_and_grad = jax.jit(weighted_sum(sharded))
    assert_close(value_and_grad(hidden, w, targets), reference[1])

    hlo = value_and_grad.lower(hidden, w, targets).compile().as_text()
    # The only gathers are of the fsdp group's rows (hidden states one chunk at a time, and the targets): never
    # the output projection (the code before vocab sharding over fsdp gathered w as [16, 48] on a 4-way fsdp).
    group_rows = B // (mesh_shape[0] * mesh_shape[1]) * mesh_shape[1]
    allowed = [[group_rows, 8, D], [group_rows, T]] if mesh_shape[1] > 1 else []
    # and the log-softmax statistics of the chunk (3 per row), gathered from every vocabulary shard to be summed in
    # shard order, then marked as shared by an exact all-reduce (one shard's sums plus zeros).
    shards = mesh_shape[1] * mesh_shape[2]
    allowed.append([shards, 3, group_rows, 8])
    assert all(s in allowed for s in all_gather_shapes(hlo)), all_gather_shapes(hlo)
    assert re.search(rf"f32\[3,{group_rows},8\][^=]*all-reduce\(", hlo)


def test_hlo_check_detects_a_gather_of_vocab_sharded_logits(inputs):
    """The check above can fail: logits computed vocab-sharded, then replicated, show up as an all-gather."""
    mesh = jax.make_mesh((2, 1, 4), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)
    hidden, w, targets = inputs
    w = jax.device_put(w, NamedSharding(mesh, P(None, "tensor")))

    def gathered(h, w, t):
        logits = jax.lax.with_sharding_constraint(h @ w, NamedSharding(mesh, P(None, None, "tensor")))
        logits = jax.lax.with_sharding_constraint(logits, NamedSharding(mesh, P()))
        return jnp.take_along_axis(jax.nn.log_softmax(logits), t[..., None], axis=-1)

    hlo = jax.jit(gathered).lower(hidden, w, targets).compile().as_text()
    assert [s for s in all_gather_shapes(hlo) if V in s]


@pytest.mark.slow
def test_model_logp_is_aligned_to_tokens(tiny_model_cfg, make_rollout):
    """logp_bt[:, t] = log softmax(logits at t - 1)[token t]; column 0 is 0; padding does not matter."""
    roll = make_rollout(1, 4, 20, tiny_model_cfg.vocab_size)
    model = Transformer(tiny_model_cfg, rngs=nnx.Rngs(2))
    tokens, mask = roll.tokens_bt, roll.mask_bt
    logp_bt, entropy_bt = jax.jit(lambda t, m: model_token_logp(model, t, m, temperature=TEMPERATURE,
                                                                time_chunk=8))(tokens, mask)
    logp_btv = np.asarray(jax.jit(lambda t, m: jax.nn.log_softmax(model(t, m) / TEMPERATURE, axis=-1))(tokens, mask))
    want = np.zeros(tokens.shape)
    want_entropy = np.zeros(tokens.shape)
    for b in range(tokens.shape[0]):
        for t in range(1, tokens.shape[1]):
            want[b, t] = logp_btv[b, t - 1, tokens[b, t]]
            want_entropy[b, t] = -(np.exp(logp_btv[b, t - 1]) * logp_btv[b, t - 1]).sum()
    np.testing.assert_allclose(np.asarray(logp_bt), want, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(entropy_bt), want_entropy, atol=1e-5, rtol=1e-5)
