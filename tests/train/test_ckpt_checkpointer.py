"""Checkpointer on 8 fake CPU devices: sharded round trips, keep-N, async saves, unreadable-step fallback."""
import asyncio
import gc
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from etils import epath
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from orbax.checkpoint._src.path import async_path

from llds_jax import parallel
from llds_jax.bounds import ConfigError
from llds_jax.config import default_config
from llds_jax.train.checkpoint import (Checkpointer, CheckpointMismatchError, CheckpointUnreadableError, abstract_like,
                                       drop_orphaned_read_errors, rng_from_json, rng_to_json)


def assert_trees_equal(actual, expected):
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


def assert_shardings(actual, target):
    for a, t in zip(jax.tree.leaves(actual), jax.tree.leaves(target)):
        assert a.sharding.is_equivalent_to(t.sharding, a.ndim), (a.sharding, t.sharding)


def host_copy(tree):
    return jax.tree.map(np.asarray, tree)


META = {"data": {"epoch": 1, "position": 6}, "rng": [0, 42], "nonfinite_count": 0}


@pytest.mark.slow
def test_round_trip_keeps_values_and_shardings(tmp_path, make_train_state):
    params, opt_state = make_train_state(1)
    ckpt = Checkpointer(str(tmp_path), save_every=1, keep=3)
    assert ckpt.save(7, params, opt_state, META) is True
    ckpt.wait_until_finished()
    target_params, target_opt = make_train_state(2)  # other values, same layout
    restored = ckpt.restore_latest(target_params, target_opt)
    assert restored.step == 7 and restored.meta == META
    assert_trees_equal(restored.params, params)
    assert_trees_equal(restored.opt_state, opt_state)
    assert_shardings(restored.params, target_params)
    assert_shardings(restored.opt_state, target_opt)
    embed = restored.params["embed"].get_value()
    assert embed.sharding.spec == parallel.spec_for("embed") == P(("fsdp", "tensor"), None)
    assert len(embed.addressable_shards) == 8 and embed.addressable_shards[0].data.shape == (64, 32)
    ckpt.close()


def test_restore_lands_on_the_targets_sharding(tmp_path, mesh):
    x = jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(mesh, P(("data", "fsdp"), "tensor")))
    ckpt = Checkpointer(str(tmp_path), save_every=1, keep=1)
    ckpt.save(1, {"x": x}, {"count": jnp.int32(3)}, {})
    ckpt.wait_until_finished()
    other = NamedSharding(mesh, P("tensor", ("data", "fsdp")))
    target = {"x": jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=other)}
    replicated = NamedSharding(mesh, P())
    restored = ckpt.restore(1, target, {"count": jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)})
    assert restored.params["x"].sharding == other
    np.testing.assert_array_equal(np.asarray(restored.params["x"]), np.arange(64.0).reshape(8, 8))
    assert int(restored.opt_state["count"]) == 3
    ckpt.close()


def test_restore_without_optimizer_state(tmp_path, make_train_state):
    params, opt_state = make_train_state(1)
    ckpt = Checkpointer(str(tmp_path), save_every=1, keep=1)
    ckpt.save(3, params, opt_state, META)
    ckpt.wait_until_finished()
    restored = ckpt.restore(3, abstract_like(params))
    assert restored.opt_state is None and restored.meta == META
    assert_trees_equal(restored.params, params)
    ckpt.close()


def test_keep_n_and_should_save(tmp_path, mesh):
    ckpt = Checkpointer(str(tmp_path), save_every=5, keep=2)
    assert [s for s in range(13) if ckpt.should_save(s)] == [5, 10]
    x = jax.device_put(jnp.zeros(8), NamedSharding(mesh, P("data")))
    for step in (5, 10, 15, 20):
        ckpt.save(step, {"x": x + step}, optax.EmptyState(), {"step_seen": step})
    ckpt.wait_until_finished()
    assert ckpt.all_steps() == [15, 20]
    assert sorted(os.listdir(tmp_path)) == ["15", "20"]
    assert ckpt.save(20, {"x": x}, (), {}) is False  # an existing step is not overwritten
    ckpt.close()
    restored = Checkpointer(str(tmp_path), save_every=5, keep=2).restore_latest({"x": x}, optax.EmptyState())
    assert restored.step == 20 and restored.meta == {"step_seen": 20} and restored.opt_state == optax.EmptyState()
    np.testing.assert_array_equal(np.asarray(restored.params["x"]), np.full(8, 20.0))


def test_async_save_snapshots_arrays_and_wait_makes_it_complete(tmp_path, make_train_state):
    params, opt_state = make_train_state(1)
    expected = host_copy((params, opt_state))
    ckpt = Checkpointer(str(tmp_path), save_every=1, keep=2, async_save=True)
    ckpt.save(4, params, opt_state, META)
    for leaf in jax.tree.leaves((params, opt_state)):  # donated or freed by the next step: the save must not care
        leaf.delete()
    ckpt.wait_until_finished()
    assert os.listdir(tmp_path) == ["4"]  # renamed from its temporary folder: complete
    fresh = Checkpointer(str(tmp_path), save_every=1, keep=2)  # a new process's view
    assert fresh.all_steps() == [4]
    target_params, target_opt = make_train_state(2)
    restored = fresh.restore_latest(target_params, target_opt)
    assert_trees_equal((restored.params, restored.opt_state), expected)
    fresh.close()
    ckpt.close()


def _truncate_largest_data_file(step_dir):
    data_dir = os.path.join(step_dir, "params", "d")
    path = max((os.path.join(data_dir, f) for f in os.listdir(data_dir)), key=os.path.getsize)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _delete_manifest(step_dir):
    os.remove(os.path.join(step_dir, "params", "manifest.ocdbt"))


def _delete_metadata(step_dir):
    os.remove(os.path.join(step_dir, "opt_state", "_METADATA"))


# orbax leaves a callback of the failed read to an asyncio loop it has closed; Python reports it at garbage collection.
ORBAX_CLOSED_LOOP = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@ORBAX_CLOSED_LOOP
@pytest.mark.parametrize("corrupt, error", [(_truncate_largest_data_file, "ValueError: OUT_OF_RANGE"),
                                            (_delete_manifest, "ValueError: NOT_FOUND"),
                                            (_delete_metadata, "FileNotFoundError: ")])
def test_unreadable_latest_falls_back_to_previous(tmp_path, make_train_state, caplog, corrupt, error):
    params1, opt1 = make_train_state(1)
    params2, opt2 = make_train_state(2)
    ckpt = Checkpointer(str(tmp_path), save_every=1, keep=3)
    ckpt.save(1, params1, opt1, {"n": 1})
    ckpt.save(2, params2, opt2, {"n": 2})
    ckpt.close()
    corrupt(str(tmp_path / "2"))

    ckpt = Checkpointer(str(tmp_path), save_every=1, keep=3)
    assert ckpt.all_steps() == [1, 2]  # orbax alone cannot tell
    target_params, target_opt = make_train_state(3)
    with caplog.at_level(logging.WARNING, logger="llds_jax.train.checkpoint"):
        restored = ckpt.restore_latest(target_params, target_opt)
    assert restored.step == 1 and restored.meta == {"n": 1}
    assert_trees_equal(restored.params, params1)
    assert_trees_equal(restored.opt_state, opt1)
    warnings = [r.getMessage() for r in caplog.records
                if r.name == "llds_jax.train.checkpoint" and r.levelno == logging.WARNING]
    assert warnings[0].startswith(f"checkpoint step 2 in {tmp_path} is unreadable ({error}")
    assert warnings[0].endswith("falling back to the previous step")
    moved = [name for name in os.listdir(tmp_path) if name.startswith("2.unreadable-")]
    assert len(moved) == 1 and f"to {tmp_path / moved[0]}" in warnings[1]
    assert ckpt.all_steps() == [1]
    assert ckpt.save(2, params2, opt2, {"n": 2}) is True  # the step number is free again
    ckpt.wait_until_finished()
    assert ckpt.restore_latest(target_params, target_opt).meta == {"n": 2}
    ckpt.close()


@ORBAX_CLOSED_LOOP
def test_every_step_unreadable_is_an_error(tmp_path, mesh):
    x = jax.device_put(jnp.ones(8), NamedSharding(mesh, P("data")))
    ckpt = Checkpointer(str(tmp_path), save_every=1, keep=2)
    ckpt.save(1, {"x": x}, (), {})
    ckpt.close()
    _delete_manifest(str(tmp_path / "1"))
    with pytest.raises(CheckpointUnreadableError, match=f"no readable checkpoint in {tmp_path}: step 1: ValueError"):
        Checkpointer(str(tmp_path), save_every=1, keep=2).restore_latest({"x": x})
    assert os.listdir(tmp_path) == ["1"]  # nothing moved: the caller decides


def _never_retrieved(loop, *failures):
    """Lets each failure (an exception for a future, a coroutine for a task) fail with nobody awaiting it, then drops
    it: asyncio logs "... exception was never retrieved" at garbage collection, as for orbax's orphaned reads."""
    for failure in failures:
        if isinstance(failure, BaseException):
            loop.create_future().set_exception(failure)
        else:
            loop.create_task(failure)
            loop.run_until_complete(asyncio.sleep(0.1))
        gc.collect()


@pytest.mark.slow
def test_orphaned_reads_of_a_failed_restore_are_not_reported(tmp_path, caplog):
    async def test_code_fails():
        raise ValueError("a failure of our own")

    drop_orphaned_read_errors()
    loop = asyncio.new_event_loop()
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        _never_retrieved(loop,
                         ValueError('OUT_OF_RANGE: Error reading "layers.w/0.0" in OCDBT database at local file "x"'),
                         async_path.read_text(epath.Path(tmp_path / "missing")),  # fails in orbax's code
                         ValueError("DATA_LOSS: a failure of our own"), test_code_fails())
    loop.close()
    reported = [(r.getMessage().split("\n")[0], str(r.exc_info[1])) for r in caplog.records if r.name == "asyncio"]
    assert reported == [("Future exception was never retrieved", "DATA_LOSS: a failure of our own"),
                        ("Task exception was never retrieved", "a failure of our own")]


def test_empty_folder_restores_nothing(tmp_path, mesh):
    x = jax.device_put(jnp.ones(8), NamedSharding(mesh, P("data")))
    assert Checkpointer(str(tmp_path / "run"), save_every=1, keep=2).restore_latest({"x": x}) is None


def test_a_host_record_round_trips_and_reaches_check_meta(tmp_path, mesh):
    x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("data")))
    ckpt = Checkpointer(str(tmp_path), save_every=1, keep=3)
    ckpt.save(1, {"x": x}, (), {"n": 1})
    ckpt.save(2, {"x": x + 1}, (), {"n": 2}, host_meta={"partial": {"groups": [["é"]]}, "data": {"position": 3}})
    ckpt.wait_until_finished()
    checked = []
    restored = ckpt.restore_latest({"x": x}, check_meta=lambda meta, host_meta: checked.append((meta, host_meta)))
    assert (restored.step, restored.host_meta, restored.host_count) == (
        2, {"partial": {"groups": [["é"]]}, "data": {"position": 3}}, 1)
    assert checked == [({"n": 2}, restored.host_meta)]
    first = ckpt.restore(1, {"x": x})
    assert (first.meta, first.host_meta, first.host_count) == ({"n": 1}, None, 0)  # saved without host records
    ckpt.close()


def test_clear_errors(tmp_path, mesh):
    ckpt = Checkpointer(str(tmp_path), save_every=1, keep=1)
    x = jax.device_put(jnp.ones(8), NamedSharding(mesh, P("data")))
    with pytest.raises(TypeError, match="checkpoint meta\\['rng'\\] is not JSON-serializable"):
        ckpt.save(1, {"x": x}, {}, {"rng": np.zeros(2)})
    with pytest.raises(TypeError, match="checkpoint host_meta\\['carry'\\] is not JSON-serializable"):
        ckpt.save(1, {"x": x}, {}, {}, host_meta={"carry": {1, 2}})
    with pytest.raises(ValueError, match="checkpoint restore params\\['layers'\\]\\['w'\\] has no sharding"):
        abstract_like({"layers": {"w": jax.ShapeDtypeStruct((2,), jnp.float32)}}, "params")
    ckpt.close()


@pytest.mark.parametrize("save_every, keep, key", [(0, 1, "train.checkpoint_every"), (1, 0, "train.keep_checkpoints")])
def test_a_bad_setting_names_its_run_config_key(tmp_path, save_every, keep, key):
    with pytest.raises(ConfigError, match=f"^{key} must be positive, got 0$"):
        Checkpointer(str(tmp_path), save_every=save_every, keep=keep)
    section, name = key.split(".")
    assert name in default_config()[section]  # the key the message names exists


def test_rng_json_round_trip():
    key = jax.random.split(jax.random.key(123))[1]
    record = rng_to_json(key)
    assert record["impl"] == "threefry2x32" and len(record["data"]) == 2
    again = rng_from_json(record)
    np.testing.assert_array_equal(jax.random.key_data(again), jax.random.key_data(key))
    np.testing.assert_array_equal(jax.random.uniform(again, (3,)), jax.random.uniform(key, (3,)))


def test_targets_of_another_model_are_an_error_not_a_fallback(tmp_path, mesh):
    x = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("data")))
    ckpt = Checkpointer(str(tmp_path), save_every=1, keep=2)
    ckpt.save(1, {"w": x}, (), {})
    ckpt.save(2, {"w": x}, (), {})
    ckpt.wait_until_finished()
    wider = jax.ShapeDtypeStruct((8, 6), jnp.float32, sharding=x.sharding)
    with pytest.raises(CheckpointMismatchError,
                       match=r"2/params: params\['w'\] was saved with shape \(8, 4\), the restore target has \(8, 6\)"):
        ckpt.restore_latest({"w": wider})
    with pytest.raises(CheckpointMismatchError, match="2/params: holds 1 arrays, the restore target has 2"):
        ckpt.restore_latest({"w": x, "b": x})
    assert sorted(os.listdir(tmp_path)) == ["1", "2"]
    ckpt.close()


def test_relative_folder_async_save_and_restore(tmp_path, make_train_state, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a run_dir such as "runs/demo_cpu" is relative to the working directory
    params, opt_state = make_train_state(1)
    expected = host_copy((params, opt_state))
    ckpt = Checkpointer(os.path.join("runs", "ckpt"), save_every=1, keep=2, async_save=True)
    ckpt.save(3, params, opt_state, META)
    ckpt.wait_until_finished()
    ckpt.close()
    assert os.listdir(tmp_path / "runs" / "ckpt") == ["3"]
    fresh = Checkpointer(os.path.join("runs", "ckpt"), save_every=1, keep=2)
    restored = fresh.restore_latest(*make_train_state(2))
    assert_trees_equal((restored.params, restored.opt_state), expected)
    fresh.close()
