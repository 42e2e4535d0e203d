"""The step program's decode iterations (`runner.step_program`, issue 67): each runs only the rows still sampling,
dealt to one ragged batch per shard of the mesh's "batch" axes, and samples what one device running every slot
samples, token for token."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from llds_jax import parallel
from llds_jax.model import ModelConfig, Transformer
from llds_jax.rollout.config import KernelTiles, SamplingConfig, Tile
from llds_jax.rollout.driver import sequence_keys
from llds_jax.rollout.engine import Engine, EngineConfig
from llds_jax.rollout.runner import DeviceRunner, decode_batches, decode_rows

SMALL = ModelConfig.tiny()  # a 256-token vocabulary, 4 query heads over 2 key/value heads


@pytest.fixture(scope="module")
def small():
    return nnx.split(Transformer(SMALL, rngs=nnx.Rngs(0)))


def test_the_sampling_rows_come_first_dealt_to_the_batches_in_turn():
    """Slots 1, 4, 5 and 6 of 8 sample: in slot order they are dealt to batch 0, 1, 0, 1, then the others; each
    batch runs its 2 sampling rows; each slot's row among the batches' 8 rows takes it back. One batch runs all 4
    first; with one sampling row, the other batches still run one row each."""
    active = jnp.asarray([False, True, False, False, True, True, True, False])
    slots, rows, num = decode_rows(active, 2)
    np.testing.assert_array_equal(slots, [[1, 5, 0, 3], [4, 6, 2, 7]])
    np.testing.assert_array_equal(rows, [2, 0, 6, 3, 4, 1, 5, 7])
    np.testing.assert_array_equal(np.asarray(slots).reshape(-1)[rows], np.arange(8))
    np.testing.assert_array_equal(num, [[2], [2]])
    slots, rows, num = decode_rows(active, 1)
    np.testing.assert_array_equal(slots, [[1, 4, 5, 6, 0, 2, 3, 7]])
    np.testing.assert_array_equal(num, [[4]])
    slots, _, num = decode_rows(active.at[4:].set(False), 4)
    np.testing.assert_array_equal(slots[:, 0], [1, 0, 2, 3])
    np.testing.assert_array_equal(num[:, 0], [1, 1, 1, 1])


def test_the_decode_batches_are_the_meshs_batch_shards_where_they_divide_the_slots():
    mesh = parallel.make_mesh(data=2, fsdp=1, tensor=2, devices=jax.devices()[:4])
    assert (decode_batches(None, 8), decode_batches(mesh, 8), decode_batches(mesh, 3)) == (1, 2, 1)
    assert decode_batches(parallel.make_mesh(data=1, fsdp=1, tensor=4, devices=jax.devices()[:4]), 8) == 1


def test_the_tiles_of_the_slots_bucket_and_the_decode_iterations_are_the_decode_tile():
    tiles = KernelTiles(kv_pages_per_block=8, queries_per_block=32, decode_kv_pages_per_block=4,
                        decode_queries_per_block=8)
    assert tiles.forward(128, 128) == tiles.decode == Tile(4, 8)
    assert tiles.forward(256, 128) == Tile(8, 32)
    assert Tile().kwargs() == {"kv_pages_per_block": None, "queries_per_block": None}


def engine(small, mesh=None, max_seqs=4, decode_chunk=8):
    graphdef, params = small
    sampling = SamplingConfig(temperature=1.0, top_p=1.0, decode_chunk=decode_chunk)
    cfg = EngineConfig(max_seqs=max_seqs, token_budgets=(4, 8, 16, 32), decode_chunk=decode_chunk, page_size=4,
                       num_pages=2 * max_seqs * 24 + 1, max_context=96, stop_ids=())
    if mesh is not None:
        params = jax.device_put(params, parallel.param_shardings(params, mesh))
    return Engine(DeviceRunner(graphdef, SMALL, sampling, cfg, mesh), params, cfg)


def first_turns(engine, budgets, seed=5):
    """Each sequence's first turn of `budgets[i]` tokens after its own prompt."""
    rs = np.random.RandomState(seed)
    keys = sequence_keys(jax.random.key(seed), range(len(budgets)))
    for seq, budget in enumerate(budgets):
        engine.add_request(seq, rs.randint(10, 250, size=3 + 2 * seq).tolist(), keys[seq], budget)
    turns = {}
    while engine.running:
        turns.update(engine.step())
    return turns


def test_rows_that_no_longer_sample_do_not_run(small):
    """Three sequences in 4 slots, turns of 3, 5 and 13 tokens in calls of 8 samples: in most decode iterations
    some slots do not sample (empty, or their turn ended). They are not run: the padding page, where a row that
    is not sampling would write its token, stays empty."""
    e = engine(small)
    turns = first_turns(e, [3, 5, 13])
    assert [len(turns[s].token_ids) for s in range(3)] == [3, 5, 13]
    pool = np.asarray(e.runner.pool.array)
    assert np.abs(pool[:, 1:]).max() > 0  # the sequences' pages were written
    assert not np.any(pool[:, 0])  # page 0, the padding page, never


@pytest.mark.slow
def test_each_data_shard_decodes_its_own_rows_and_samples_what_one_device_does(small):
    """On a mesh of 2 tensor-parallel pairs (data 2, tensor 2) each decode iteration runs 2 ragged batches, one per
    pair: the same turns, token for token, as one device running every slot, at the same log-probs."""
    budgets = [3, 5, 13, 9]
    one = first_turns(engine(small), budgets)
    mesh = parallel.make_mesh(data=2, fsdp=1, tensor=2, devices=jax.devices()[:4])
    split = engine(small, mesh)
    assert split.runner.batches == 2
    two = first_turns(split, budgets)
    for seq in range(len(budgets)):
        assert two[seq].token_ids == one[seq].token_ids
        np.testing.assert_allclose(two[seq].logps, one[seq].logps, atol=1e-5)
