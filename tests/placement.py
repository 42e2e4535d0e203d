"""Placing a randomly initialized model on a mesh, as tests build one (a run loads its weights onto their shards:
llds_jax.model.hf_io.load_model)."""
import jax
from flax import nnx
from jax.sharding import Mesh

from llds_jax import parallel


def shard_model(model: nnx.Module, mesh: Mesh) -> nnx.Module:
    """Places a model's parameters on their shards (the partition rules of llds_jax.parallel), in place; returns
    it."""
    state = nnx.state(model, nnx.Param)
    nnx.update(model, jax.device_put(state, parallel.param_shardings(state, mesh)))
    return model
