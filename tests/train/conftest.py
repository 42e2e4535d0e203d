"""Fixtures of the training-infrastructure tests: QA examples, a 2x2x2 mesh, a sharded tiny model and its optimizer."""
import jax
import numpy as np
import optax
import pytest
from flax import nnx

from llds_jax import parallel
from llds_jax.data.qa import QAExample
from llds_jax.model import ModelConfig, Transformer


@pytest.fixture
def make_examples():
    """`make_examples(n)`: n distinct QA examples with uids `nq-0` ... `nq-{n-1}`."""
    def make(n: int) -> list[QAExample]:
        return [QAExample(uid=f"nq-{i}", question=f"question {i}?", golden_answers=(f"answer {i}",),
                          data_source="nq") for i in range(n)]
    return make


@pytest.fixture(scope="session")
def mesh():
    """data=2 x fsdp=2 x tensor=2 over the 8 fake CPU devices."""
    return parallel.make_mesh(data=2, fsdp=2, tensor=2)


@pytest.fixture(scope="session")
def param_layout(mesh):
    """(abstract nnx.State of a tiny model's parameters, their NamedShardings by the partition rules)."""
    abstract = nnx.state(nnx.eval_shape(lambda: Transformer(ModelConfig.tiny(), rngs=nnx.Rngs(0))), nnx.Param)
    return abstract, parallel.param_shardings(abstract, mesh)


@pytest.fixture
def make_train_state(mesh, param_layout):
    """`make_train_state(seed)`: (params, opt_state) of a tiny model, sharded on `mesh` by the partition rules.

    Parameters are seeded random values; AdamW moments take the parameters' shardings and non-zero values, its
    step count is replicated.
    """
    tx = optax.adamw(1e-3)
    abstract, shardings = param_layout
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def make(seed: int):
        rng = np.random.default_rng(seed)
        params = jax.tree.map(lambda x, sharding: jax.device_put(rng.normal(size=x.shape).astype(x.dtype), sharding),
                              abstract, shardings)
        opt_shardings = optax.tree_map_params(tx, lambda _, x: x.sharding, jax.eval_shape(tx.init, params), params,
                                              transform_non_params=lambda _: replicated)
        opt_state = jax.jit(lambda p: jax.tree.map(lambda x: x + seed, tx.init(p)), out_shardings=opt_shardings)(params)
        return params, opt_state

    return make
