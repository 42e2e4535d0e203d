"""Sharding on 8 fake CPU devices: placement by rule, equality with the unsharded model, clear mesh errors."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from llds_jax import parallel
from llds_jax.model import ModelConfig, Transformer, hf_io, preset


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
    model = parallel.shard_model(Transformer(ModelConfig.tiny(), rngs=nnx.Rngs(0)), mesh)
    assert model.lm_head.get_value().sharding.spec == P("fsdp", "tensor")
    assert model.embed.get_value().sharding.spec == P("tensor", "fsdp")


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
