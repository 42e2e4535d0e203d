"""A damaged newest checkpoint (a data file truncated after it was written) costs one warning line: the run falls
back to the previous step and says so, without the storage library's dumps (other damage: tests/train/
test_ckpt_checkpointer.py)."""
import json
import logging
import os
import re

import jax
import jax.numpy as jnp
import pytest

from llds_jax.data.iterator import PromptIterator
from llds_jax.data.qa import QAExample
from llds_jax.train.checkpoint import MAX_REASON_CHARS, Checkpointer, checksums
from tests.e2e.runs import finish, read_metrics
from tests.reliability.scripted_retriever import ScriptedRetriever

TIMEOUT_S = 300


def truncate_largest_file(folder: str) -> None:
    files = [os.path.join(root, name) for root, _, names in os.walk(folder) for name in names]
    path = max(files, key=os.path.getsize)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


@pytest.mark.slow
def test_truncated_newest_checkpoint_is_one_warning_and_the_run_goes_on(searching_runs):
    name = "truncated"
    run_dir = searching_runs.run_dir(name)
    with ScriptedRetriever() as server:
        finish([searching_runs.start(server.config(), name, train__total_steps=2, train__checkpoint_every=1)],
               TIMEOUT_S)
        truncate_largest_file(os.path.join(run_dir, "checkpoints", "2", "params"))
        output = finish([searching_runs.start(server.config(), name, train__checkpoint_every=1)], TIMEOUT_S)[0]
    warnings = [line for line in output.splitlines() if line.startswith("W") and "checkpoint.py" in line]
    assert len(warnings) == 2, output[-6000:]
    assert re.search(r"checkpoint step 2 in \S+ is unreadable \(Exception: Encountered error while reading array "
                     r"index: .*\(caused by ValueError: OUT_OF_RANGE: .*\); falling back to the previous step$",
                     warnings[0]), warnings[0]
    assert re.search(r"moved unreadable checkpoint \S+/2 to \S+/2\.unreadable-\d+$", warnings[1]), warnings[1]
    assert "resumed from step 1" in output
    reason_text = warnings[0].split(" is unreadable (", 1)[1].rsplit("); falling back", 1)[0]
    assert len(reason_text) <= MAX_REASON_CHARS  # the error's first lines, not orbax's 60-line TensorStore spec
    assert "Event loop is closed" not in output and "Traceback" not in output and "Exception ignored" not in output
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3]


def flip_bytes(folder: str, count: int = 9) -> None:
    """Flips `count` bytes in the middle of the largest file under `folder` (bit rot, a bad disk or copy)."""
    files = [os.path.join(root, name) for root, _, names in os.walk(folder) for name in names]
    path = max(files, key=os.path.getsize)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        data = f.read(count)
        f.seek(os.path.getsize(path) // 2)
        f.write(bytes(b ^ 0xFF for b in data))


def test_flipped_bytes_in_the_newest_weights_fall_back_to_the_previous_step_with_one_warning(tmp_path, caplog):
    """Issue 58 item 3: nine flipped bytes in the newest checkpoint's weights restored 7,335 wrong weights (up to
    3.3e38) with no warning. The checksums saved with each step are checked on restore."""
    directory = str(tmp_path / "checkpoints")
    params = {"w": jnp.arange(64 * 1024, dtype=jnp.float32).reshape(256, 256) / 7, "b": jnp.ones(256, jnp.bfloat16)}
    opt_state = {"count": jnp.array(3, jnp.int32), "mu": jnp.zeros((256, 256), jnp.float32)}
    checkpointer = Checkpointer(directory, save_every=1, keep=3, async_save=False)
    checkpointer.save(1, params, opt_state, {"data_position": 16})
    checkpointer.save(2, jax.tree.map(lambda x: x + 1, params), opt_state, {"data_position": 32})
    checkpointer.close()
    flip_bytes(os.path.join(directory, "2", "params"))
    reopened = Checkpointer(directory, save_every=1, keep=3, async_save=False)
    with caplog.at_level(logging.WARNING):
        restored = reopened.restore_latest(params, opt_state)
    reopened.close()
    assert (restored.step, restored.meta) == (1, {"data_position": 16})
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), restored.params, params))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert re.fullmatch(rf"checkpoint step 2 in {directory} is unreadable \(ChecksumMismatchError: {directory}/2/"
                        r"params: params\['w'\] does not match the checksum saved with it \(its data changed after "
                        r"the save\)\); falling back to the previous step", warnings[0]), warnings
    assert re.fullmatch(rf"moved unreadable checkpoint {directory}/2 to {directory}/2\.unreadable-\d+", warnings[1])


def test_a_data_position_out_of_range_falls_back_to_the_previous_step_naming_the_file(tmp_path, caplog):
    """Issue 58 item 4: a checkpoint whose data position was out of range failed every rerun with an error naming
    neither step nor file. The trainer's check of the record (here the data iterator's own) runs inside the
    checkpointer's fallback."""
    examples = [QAExample(f"nq-{i}", f"question {i}", ("a",), "nq") for i in range(8)]
    data = PromptIterator(examples, batch_size=4, seed=0)
    directory = str(tmp_path / "checkpoints")
    params = {"w": jnp.ones((4, 4), jnp.float32)}
    checkpointer = Checkpointer(directory, save_every=1, keep=3, async_save=False)
    for step in (1, 2):
        next(data)
        checkpointer.save(step, params, {}, {"data": data.state()})
    checkpointer.close()
    meta_file = os.path.join(directory, "2", "meta", "metadata")
    with open(meta_file) as f:
        record = json.load(f)
    record["meta"]["data"]["position"] = 999
    with open(meta_file, "w") as f:
        json.dump(record, f)
    reopened = Checkpointer(directory, save_every=1, keep=3, async_save=False)
    with caplog.at_level(logging.WARNING):
        restored = reopened.restore_latest(params, None, check_meta=lambda meta, host_meta: data.check(meta["data"]))
    reopened.close()
    assert restored.step == 1 and restored.meta["data"]["position"] == 4
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings[0] == (f"checkpoint step 2 in {directory} is unreadable (ValueError: {directory}/2/meta: "
                           "ValueError: data iterator state: 'position' must be an int in [0, 8), got 999); falling "
                           "back to the previous step")


def test_checksums_of_a_state_copy_in_host_memory_are_those_of_the_state():
    """The state a stop within a step saves is a copy in pinned host memory (trainer.to_host), which the checksums'
    device program cannot take whole (the first version failed the stop: "memory_space of all inputs ... must be
    the same")."""
    state = {"w": jnp.arange(4096, dtype=jnp.float32) / 3, "n": jnp.array(5, jnp.int32)}
    host = jax.tree.map(lambda x: jax.device_put(x, x.sharding.with_memory_kind("pinned_host")), state)
    assert checksums(host) == checksums(state)
    assert checksums({**state, "n": jnp.array(6, jnp.int32)}) != checksums(state)
