"""Sharding on 8 fake CPU devices: placement by rule, equality with the unsharded model, clear mesh errors."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from llds_jax import parallel
from llds_jax.aot import compile_check
from llds_jax.model import ModelConfig, Transformer, hf_io, init_pages, pages_spec, preset, vocab
from llds_jax.rl.logprobs import model_token_logp
from tests.placement import shard_model


def test_eight_devices_present():
    assert jax.device_count() == 8


@pytest.mark.parametrize("axes", [dict(data=2, fsdp=2, tensor=2), dict(data=1, fsdp=-1, tensor=2)])
def test_sharded_forward_equals_unsharded(hf_checkpoint, left_padded_batch, axes):
    folder, _ = hf_checkpoint("qwen2_untied")
    ids, mask = left_padded_batch
    ids, mask = np.concatenate([ids, ids[:1]]), np.concatenate([mask, mask[:1]])  # batch 4 divides data*fsdp
    plain = np.asarray(hf_io.load_model(folder)(jnp.asarray(ids), jnp.asarray(mask)))
    mesh = parallel.make_mesh(**axes)
    model = hf_io.load_model(folder, mesh=mesh)
    graphdef, state = nnx.split(model)

    @jax.jit
    def forward(state, ids, mask):
        return nnx.merge(graphdef, state)(ids, mask)

    with jax.set_mesh(mesh):
        batch = jax.device_put((jnp.asarray(ids), jnp.asarray(mask)), parallel.batch_sharding(mesh, 2))
        sharded = forward(state, *batch)
    real = mask.astype(bool)
    np.testing.assert_allclose(np.asarray(sharded)[real], plain[real], atol=1e-5)
    # Every parameter sits on the sharding its rule names.
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name = parallel.path_str(path)
        assert var.get_value().sharding.spec == parallel.spec_for(name), name
    assert model.layers.q_proj.get_value().sharding.spec == P(None, "fsdp", "tensor", None)
    shard_shape = model.layers.q_proj.get_value().addressable_shards[0].data.shape
    assert shard_shape == (2, 32 // mesh.shape["fsdp"], 4 // mesh.shape["tensor"], 8)


def test_shard_model_places_random_init():
    mesh = parallel.make_mesh(data=2, fsdp=2, tensor=2)
    model = shard_model(Transformer(ModelConfig.tiny(), rngs=nnx.Rngs(0)), mesh)
    assert model.lm_head.get_value().sharding.spec == P(None, ("fsdp", "tensor"))
    assert model.embed.get_value().sharding.spec == P(("fsdp", "tensor"), None)


def all_gather_elements(hlo_text):
    """Element counts of the outputs of every all-gather in compiled HLO text."""
    return [math.prod(dims) for _, dims in compile_check.all_gather_shapes(hlo_text)]


@pytest.mark.slow
@pytest.mark.parametrize("axes, tied", [(dict(data=1, fsdp=4, tensor=2), False), (dict(data=2, fsdp=4, tensor=1), True)])
def test_no_program_gathers_the_vocabulary(axes, tied):
    """The log-prob gradient (embedding lookup, layers, output projection) and a ragged step over the paged KV cache
    (the 8 rows' prompts, pages of 4) run on the vocab-sharded embedding and output projection: the largest
    all-gather (layer weights under fsdp, one chunk of the group's hidden states) is smaller than one shard of the
    [V, D] table, and the values equal the unsharded model's.
    """
    cfg = ModelConfig.tiny(vocab_size=2048, tie_word_embeddings=tied)
    mesh = parallel.make_mesh(**axes)
    plain = Transformer(cfg, rngs=nnx.Rngs(0))
    graphdef, plain_state = nnx.split(plain)
    sharded_state = nnx.state(shard_model(Transformer(cfg, rngs=nnx.Rngs(0)), mesh))
    tokens_bt = jax.random.randint(jax.random.key(1), (8, 16), 0, cfg.vocab_size)
    mask_bt = jnp.ones((8, 16), jnp.int32).at[:3, :5].set(0)

    def loss(params, rest, tokens_bt, mask_bt, mesh):
        model = nnx.merge(graphdef, params, rest)
        logp_bt, _ = model_token_logp(model, tokens_bt, mask_bt, time_chunk=8, mesh=mesh)
        return jnp.sum(logp_bt * mask_bt)

    # The ragged step's batch: each row's real tokens back to back, 4 pages of 4 tokens per row.
    lens_s = np.asarray(mask_bt).sum(axis=1)
    real_bt = np.asarray(mask_bt, bool)
    step_batch = (jnp.asarray(np.asarray(tokens_bt)[real_bt], jnp.int32), jnp.asarray(lens_s, jnp.int32),
                  jnp.arange(32, dtype=jnp.int32).reshape(8, 4),
                  jnp.asarray(np.concatenate([[0], np.cumsum(lens_s)]), jnp.int32), jnp.asarray([8], jnp.int32))

    def ragged_step(state, pages, tokens_t, *rest):
        logits_sv, _ = nnx.merge(graphdef, state).ragged_step(tokens_t, pages, *rest)
        return logits_sv

    split = lambda state: nnx.split_state(state, nnx.Param, ...)  # noqa: E731
    want = jax.value_and_grad(loss)(*split(plain_state), tokens_bt, mask_bt, None)
    with jax.set_mesh(mesh):
        grad_fn = jax.jit(jax.value_and_grad(loss), static_argnums=4)
        got = grad_fn(*split(sharded_state), tokens_bt, mask_bt, mesh)
        pages = jax.device_put(init_pages(cfg, 32, 4), NamedSharding(mesh, pages_spec(mesh, cfg.num_kv_heads)))
        step_fn = jax.jit(ragged_step)
        logits = step_fn(sharded_state, pages, *step_batch)
        hlos = [grad_fn.lower(*split(sharded_state), tokens_bt, mask_bt, mesh).compile().as_text(),
                step_fn.lower(sharded_state, pages, *step_batch).compile().as_text()]
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for g, w in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(logits, ragged_step(plain_state, init_pages(cfg, 32, 4), *step_batch), atol=1e-5,
                               rtol=1e-5)
    shard_elements = cfg.vocab_size * cfg.hidden_size // (mesh.shape["fsdp"] * mesh.shape["tensor"])
    for hlo in hlos:
        assert all_gather_elements(hlo) and max(all_gather_elements(hlo)) < shard_elements


@pytest.mark.parametrize("chunk", [4, 6, 512])
def test_sharded_lookup_in_time_chunks_equals_take(monkeypatch, chunk):
    """The vocabulary-sharded lookup, a time chunk at a time (chunks dividing T, padded, or one chunk), gives the
    rows of `jnp.take` exactly and the scatter-add of the output gradient as the table's gradient."""
    monkeypatch.setattr(vocab, "LOOKUP_CHUNK", chunk)
    mesh = parallel.make_mesh(data=1, fsdp=4, tensor=2)
    table_vd = jax.random.normal(jax.random.key(0), (64, 8))
    tokens_bt = jax.random.randint(jax.random.key(1), (8, 16), 0, 64)
    cotangent_btd = jax.random.normal(jax.random.key(2), (8, 16, 8))
    with jax.set_mesh(mesh):
        sharded_vd = jax.device_put(table_vd, NamedSharding(mesh, P(parallel.VOCAB, None)))
        x_btd, pullback = jax.vjp(lambda t: vocab.embed_lookup(t, tokens_bt, jnp.float32), sharded_vd)
        (grad_vd,) = pullback(cotangent_btd)
    np.testing.assert_array_equal(np.asarray(x_btd), np.asarray(table_vd)[np.asarray(tokens_bt)])
    want_vd = np.zeros((64, 8), np.float32)
    np.add.at(want_vd, np.asarray(tokens_bt).ravel(), np.asarray(cotangent_btd).reshape(-1, 8))
    np.testing.assert_allclose(np.asarray(grad_vd), want_vd, rtol=1e-6, atol=1e-6)


def test_mesh_that_cannot_divide_the_model_names_axis_and_sizes():
    cfg = preset("qwen2.5-7b")  # 28 query heads, 4 KV heads
    abstract = nnx.state(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    mesh = parallel.make_mesh(data=1, fsdp=1, tensor=8)
    with pytest.raises(ValueError, match=r"layers/k_proj dimension 4 is not divisible by mesh axis 'tensor' of size 8"):
        parallel.param_shardings(abstract, mesh)


def test_mesh_shape_resolution_and_errors():
    assert parallel.mesh_shape(8, data=1, fsdp=-1, tensor=2) == (1, 4, 2)
    assert parallel.mesh_shape(8, data=-1, fsdp=2, tensor=1) == (4, 2, 1)
    with pytest.raises(ValueError, match=r"8 devices cannot be split into data=1 x fsdp=-1 x tensor=3"):
        parallel.mesh_shape(8, data=1, fsdp=-1, tensor=3)
    with pytest.raises(ValueError, match="only one axis may be -1"):
        parallel.mesh_shape(8, data=-1, fsdp=-1)
    with pytest.raises(ValueError, match=r"does not equal the 8 devices"):
        parallel.mesh_shape(8, data=2, fsdp=2, tensor=1)
