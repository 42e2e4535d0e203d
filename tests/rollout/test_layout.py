"""rollout.tensor_parallel: the rollout's copy of the policy split over a host's chips by heads and MLP width samples
what the training layout samples, with each key/value head repeated where the chips outnumber them."""
import jax
import numpy as np
import pytest
from flax import nnx

from llds_jax import parallel
from llds_jax.config import ConfigError
from llds_jax.model import ModelConfig, Transformer
from llds_jax.rollout.config import SamplingConfig
from llds_jax.rollout.driver import sequence_keys
from llds_jax.rollout.engine import Engine, EngineConfig
from llds_jax.rollout.layout import abstract_rollout_params, make_layout, rollout_params
from llds_jax.rollout.runner import DeviceRunner
from tests.placement import shard_model

# 4 query heads, 2 key/value heads, MLP in 2 slices (as the paper configs slice theirs for the update).
MODEL = ModelConfig.tiny(mlp_chunks=2)
GREEDY = SamplingConfig(greedy=True, decode_chunk=4)
PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16], [3], [40, 41, 42]]


@pytest.fixture(scope="module")
def trained():
    """The tiny model on the training mesh (fsdp over the 8 CPU devices): (mesh, graphdef, params)."""
    mesh = parallel.make_mesh(1, -1, 1)
    model = shard_model(Transformer(MODEL, rngs=nnx.Rngs(0)), mesh)
    graphdef, params = nnx.split(model)
    return mesh, graphdef, params


def run_turns(engine):
    turns = {}
    while engine.running:
        turns.update(engine.step())
    return [turns[seq] for seq in sorted(turns)]


def converse(layout, graphdef, params):
    """Two greedy turns of every prompt on the rollout engine over `layout`'s mesh (the second after a rollback of
    2 tokens and an observation): the token ids and log-probs of each turn of each sequence."""
    engine_cfg = EngineConfig(max_seqs=8, token_budgets=(8, 16, 32), decode_chunk=GREEDY.decode_chunk, page_size=4,
                              num_pages=8 * 8 + 1, max_context=32)
    runner = DeviceRunner(layout.graphdef(graphdef), layout.model_cfg, GREEDY, engine_cfg, layout.mesh)
    engine = Engine(runner, rollout_params(layout, params, "float32"), engine_cfg)
    for seq, (prompt, key) in enumerate(zip(PROMPTS, sequence_keys(jax.random.key(0), range(len(PROMPTS))))):
        engine.add_request(seq, prompt, key, 10)
    first = run_turns(engine)
    for seq, turn in enumerate(first):
        engine.extend(seq, len(turn.token_ids) - 2, [20 + seq, 21], 6)
    turns = first + run_turns(engine)
    return [t.token_ids for t in turns], np.concatenate([t.logps for t in turns])


@pytest.mark.slow
@pytest.mark.parametrize("tensor", [4, 2, -1], ids=["tensor4-kv-repeat", "tensor2", "all-chips"])
def test_tensor_parallel_layout_samples_the_training_layouts_greedy_tokens(trained, tensor):
    mesh, graphdef, params = trained
    # -1: every chip of a host of 4 (8 chips cannot split 4 query heads); else rows over 8 / tensor groups.
    local = jax.devices()[:4] if tensor == -1 else jax.devices()
    t = len(local) if tensor == -1 else tensor
    layout = make_layout(tensor, MODEL, mesh, local)
    assert dict(layout.mesh.shape) == {"data": len(local) // t, "fsdp": 1, "tensor": t}
    assert layout.kv_repeat == max(1, t // MODEL.num_kv_heads)
    assert layout.model_cfg == MODEL.replace(num_kv_heads=MODEL.num_kv_heads * layout.kv_repeat, mlp_chunks=1)
    reference = converse(make_layout(0, MODEL, mesh, jax.devices()), graphdef, params)
    got = converse(layout, graphdef, params)
    assert got[0] == reference[0]
    np.testing.assert_allclose(got[1], reference[1], atol=1e-5)


def test_rollout_copy_repeats_key_value_heads_and_leaves_the_training_params(trained):
    mesh, _, params = trained
    before = jax.tree.map(np.asarray, params)
    layout = make_layout(4, MODEL, mesh, jax.devices())
    copy = rollout_params(layout, params, "bfloat16")
    abstract = abstract_rollout_params(layout, params, "bfloat16")
    for (path, x), y, a in zip(nnx.to_flat_state(params), jax.tree.leaves(copy), jax.tree.leaves(abstract)):
        name = parallel.path_str(path)
        want = np.asarray(x.get_value()).astype(y.dtype)
        axis = {"layers/k_proj": 2, "layers/v_proj": 2, "layers/k_bias": 1, "layers/v_bias": 1}.get(name)
        if axis is not None:  # [.., K, H] -> [.., 2 K, H]: head k at 2 k and 2 k + 1
            want = np.repeat(want, 2, axis=axis)
        np.testing.assert_array_equal(np.asarray(y), want)
        assert y.sharding == a.sharding and (y.shape, y.dtype) == (a.shape, a.dtype)
        assert y.sharding.mesh == layout.mesh and y.sharding.spec == parallel.spec_for(name)
    for x, b in zip(jax.tree.leaves(params), jax.tree.leaves(before)):
        assert x.dtype == np.float32 and x.sharding.mesh == mesh
        np.testing.assert_array_equal(np.asarray(x), b)


@pytest.mark.parametrize("tensor, local, message", [
    (3, 8, r"rollout\.tensor_parallel \(3\) must divide the 8 chip\(s\) of a host"),
    (8, 8, r"rollout\.tensor_parallel = 8 chips cannot split the model's 4 query heads"),
    (-1, 8, r"rollout\.tensor_parallel = 8 chips cannot split the model's 4 query heads"),
])
def test_a_layout_the_model_cannot_take_names_the_key(trained, tensor, local, message):
    with pytest.raises(ConfigError, match=message):
        make_layout(tensor, MODEL, trained[0], jax.devices()[:local])


def test_key_value_heads_that_neither_divide_nor_repeat_evenly_are_refused(trained):
    model = ModelConfig.tiny(num_heads=12, num_kv_heads=3, intermediate_size=96, vocab_size=252)
    with pytest.raises(ConfigError, match=r"cannot split the model's 3 key/value heads .* nor hold an equal number "
                                          r"of copies of each"):
        make_layout(2, model, trained[0], jax.devices()[:2])
