"""A run folder on gs:// (a GCS emulator): Orbax checkpoints (keep-N, restore onto the mesh, unreadable-step
fallback), TensorBoard events and metrics.jsonl, with the resume semantics of a local folder."""
import json
import logging

import jax
import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from llds_jax.train.checkpoint import Checkpointer
from llds_jax.train.metrics import MetricsWriter


def assert_trees_equal(actual, expected):
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


def step_folders(gcs_fs, folder):
    return sorted(path.rsplit("/", 1)[1] for path in gcs_fs.ls(folder, refresh=True))


# orbax leaves a callback of the failed read to an asyncio loop it has closed; Python reports it at garbage collection.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_checkpoints_keep_restore_and_fall_back(gcs_dir, gcs_fs, make_train_state, caplog):
    folder = f"{gcs_dir}/checkpoints"
    states = {step: make_train_state(step) for step in (1, 2, 3)}
    expected = {step: jax.tree.map(np.asarray, state) for step, state in states.items()}
    ckpt = Checkpointer(folder, save_every=1, keep=2)
    for step, (params, opt_state) in states.items():
        assert ckpt.save(step, params, opt_state, {"n": step})
    ckpt.close()
    assert step_folders(gcs_fs, folder) == ["2", "3"]  # complete steps only, the oldest deleted

    targets = make_train_state(4)
    fresh = Checkpointer(folder, save_every=1, keep=2)  # a new process's view
    restored = fresh.restore_latest(*targets)
    assert (restored.step, restored.meta) == (3, {"n": 3})
    assert_trees_equal((restored.params, restored.opt_state), expected[3])
    for leaf, target in zip(jax.tree.leaves(restored.params), jax.tree.leaves(targets[0])):
        assert leaf.sharding == target.sharding
    fresh.close()

    gcs_fs.rm(f"{folder}/3/params/manifest.ocdbt")
    fresh = Checkpointer(folder, save_every=1, keep=2)
    with caplog.at_level(logging.WARNING, logger="llds_jax.train.checkpoint"):
        restored = fresh.restore_latest(*targets)
    assert (restored.step, restored.meta) == (2, {"n": 2})
    assert_trees_equal((restored.params, restored.opt_state), expected[2])
    # Only the checkpointer's own records: orbax may add its own (e.g. a slow previous save on a busy machine).
    ours = [r.getMessage() for r in caplog.records if r.name == "llds_jax.train.checkpoint"]
    assert ours[0].startswith(f"checkpoint step 3 in {folder} is unreadable")
    [moved] = [name for name in step_folders(gcs_fs, folder) if name != "2"]
    assert moved.startswith("3.unreadable-") and fresh.all_steps() == [2]
    fresh.close()


def test_opening_deletes_an_unfinished_only_step_before_anything_lists_the_folder(gcs_dir, gcs_fs, make_train_state):
    """A save cut before orbax committed it (on GCS: no commit_success.txt) leaves the folder's only step unfinished;
    the next run's checkpointer deletes it while it opens (orbax does that in a thread, awaited only at its first
    save: the folder could vanish under its own listing) and leaves nothing of its own behind."""
    folder = f"{gcs_dir}/checkpoints"
    ckpt = Checkpointer(folder, save_every=1, keep=3)
    assert ckpt.save(1, *make_train_state(1), {"n": 1})
    ckpt.close()
    gcs_fs.rm(f"{folder}/1/commit_success.txt")
    assert len(gcs_fs.find(folder)) > 10
    fresh = Checkpointer(folder, save_every=1, keep=3)
    assert gcs_fs.find(folder) == []  # step 1 deleted, and no placeholder left
    assert fresh.restore_latest(*make_train_state(2)) is None and fresh.all_steps() == []
    assert fresh.save(1, *make_train_state(3), {"n": 3})  # the step number is free again
    fresh.close()
    assert step_folders(gcs_fs, folder) == ["1"]


def test_metrics_tensorboard_and_jsonl_resume(gcs_dir, gcs_fs):
    writer = MetricsWriter(gcs_dir, console=None)
    for step in range(1, 5):
        writer.write(step, {"loss": float(step), "lld/rate": float("nan")})
    writer.write_texts(2, {"samples/0": "<search> x </search>"})
    writer.close()
    resumed = MetricsWriter(gcs_dir, start_step=3, console=None)  # checkpoint at step 2
    resumed.write(3, {"loss": 30.0, "lld/rate": 0.5})
    resumed.close()

    records = [json.loads(line) for line in gcs_fs.cat(f"{gcs_dir}/metrics.jsonl").decode().splitlines()]
    assert [(r["step"], r["loss"], r["lld/rate"]) for r in records] == [(1, 1.0, None), (2, 2.0, None),
                                                                        (3, 30.0, 0.5)]
    assert len(gcs_fs.ls(f"{gcs_dir}/tensorboard", refresh=True)) == 2  # one events file per writer
    # TensorBoard reads gs:// itself (through gcsfs), as `tensorboard --logdir gs://...` does.
    events = EventAccumulator(f"{gcs_dir}/tensorboard", size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 1.0), (2, 2.0), (3, 30.0)]
    assert [(e.step, e.value) for e in events.Scalars("lld/rate")] == [(3, 0.5)]
    [text] = events.Tensors("samples/0/text_summary")
    assert (text.step, text.tensor_proto.string_val[0].decode()) == (2, "    <search> x </search>")
