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
from llds_jax.train.checkpoint import MAX_REASON_CHARS, Checkpointer, CheckpointUnreadableError, checksums
from tests.e2e.runs import finish, read_metrics
from tests.reliability.scripted_retriever import ScriptedRetriever
from tests.reliability.test_partial_runs import assert_same_run, result

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
    checkpointer's fallback. The record is saved so (a damaged file fails its checksum before: the next tests)."""
    examples = [QAExample(f"nq-{i}", f"question {i}", ("a",), "nq") for i in range(8)]
    data = PromptIterator(examples, batch_size=4, seed=0)
    directory = str(tmp_path / "checkpoints")
    params = {"w": jnp.ones((4, 4), jnp.float32)}
    checkpointer = Checkpointer(directory, save_every=1, keep=3, async_save=False)
    next(data)
    checkpointer.save(1, params, {}, {"data": data.state()})
    next(data)
    checkpointer.save(2, params, {}, {"data": {**data.state(), "position": 999}})
    checkpointer.close()
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


# ----- the checkpoint's own record (issue 66) -------------------------------------------------------------------------
# Before: `meta/metadata` held the arrays' checksums but was read as it was: one flipped bit of the saved rng
# ("data": [0, 0] -> [1, 0]) resumed on another random stream without a word.

def flip_bit_in(path: str, text: str, at: int) -> None:
    """Flips the lowest bit of byte `at` of the first `text` in the file `path` (one bit rotted)."""
    with open(path, "r+b") as f:
        data = f.read()
        where = data.index(text.encode()) + at
        f.seek(where)
        f.write(bytes([data[where] ^ 1]))


# What one flipped bit turns a step's record into: (text in meta/metadata, the byte of it that flips).
RECORD_FLIPS = {
    "rng": ('"data": [0, 0]', len('"data": [')),  # the rng's key [0, 0] -> [1, 0]
    "data position": ('"position": 32', len('"position": 3')),  # process 0's copy of the data position, 32 -> 33
    "counter": ('"nonfinite_count": 0', len('"nonfinite_count": ')),  # 0 -> 1
    "an array's checksum": ('"params": [[', len('"params": [[')),  # its first digit
    "the record's checksum": ('"record_sha256": "', len('"record_sha256": "')),  # its first hex digit
    "the record checksum's name": ('"record_sha256"', len('"record_sha25')),  # "record_sha257": no checksum
}
META_FILE_LINE = "checkpoint step 2 in {directory} is unreadable (ChecksumMismatchError: {directory}/2/meta/metadata: "
RECORD_REASON = ("the record (the rng, data position, counters and the arrays' checksums) does not match the "
                 "checksum saved with it (its data changed after the save)")


def save_two_steps(directory: str) -> tuple[dict, dict]:
    """Saves steps 1 and 2 (params, a record with the trainer's keys, host records); returns step 1's (params,
    record)."""
    checkpointer = Checkpointer(directory, save_every=1, keep=3, async_save=False)
    saved = {}
    for step in (1, 2):
        params = {"w": jnp.arange(256 * 256, dtype=jnp.float32).reshape(256, 256) / 7 + step}
        data = {"seed": 0, "epoch": 0, "position": 16 * step, "num_examples": 80, "fingerprint": "1809ce42becd48e7"}
        meta = {"data": data, "rng": {"impl": "threefry2x32", "data": [0, 0]}, "lengths": [128], "nonfinite_count": 0}
        checkpointer.save(step, params, {}, meta, host_meta={"data": data})
        saved[step] = params, meta
    checkpointer.close()
    return saved[1]


def restore_with_warnings(directory: str, caplog) -> tuple[object, list[str]]:
    reopened = Checkpointer(directory, save_every=1, keep=3, async_save=False)
    params = {"w": jnp.zeros((256, 256), jnp.float32)}
    try:
        with caplog.at_level(logging.WARNING, logger="llds_jax.train.checkpoint"):
            restored = reopened.restore_latest(params)
    finally:
        reopened.close()
    return restored, [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


@pytest.mark.parametrize("field", RECORD_FLIPS)
def test_a_flipped_bit_in_the_checkpoint_record_falls_back_to_the_previous_step_naming_the_file(tmp_path, caplog,
                                                                                                 field):
    directory = str(tmp_path / "checkpoints")
    params, meta = save_two_steps(directory)
    flip_bit_in(os.path.join(directory, "2", "meta", "metadata"), *RECORD_FLIPS[field])
    restored, warnings = restore_with_warnings(directory, caplog)
    assert (restored.step, restored.meta, restored.host_meta) == (1, meta, {"data": meta["data"]})
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), restored.params, params))
    reason = (RECORD_REASON if field != "the record checksum's name" else
              "the record has no record_sha256 and unknown keys ['record_sha257'] (its data changed after the save)")
    assert warnings[0] == (META_FILE_LINE.format(directory=directory) + reason +
                           "); falling back to the previous step"), warnings
    assert re.fullmatch(rf"moved unreadable checkpoint {directory}/2 to {directory}/2\.unreadable-\d+", warnings[1])
    assert len(warnings) == 2


def test_a_checkpoint_of_the_version_before_the_record_checksum_resumes(tmp_path, caplog):
    """A step saved at 0e0871a (the issue's base): its meta/metadata is this version's without the key
    `record_sha256` (checked byte for byte against that version's save when this test was written)."""
    directory = str(tmp_path / "checkpoints")
    save_two_steps(directory)
    meta_file = os.path.join(directory, "2", "meta", "metadata")
    with open(meta_file) as f:
        text = f.read()
    old_text = re.sub(r', "record_sha256": "[0-9a-f]{64}"', "", text)
    assert old_text != text and list(json.loads(old_text)) == ["step", "meta", "checksums"]
    with open(meta_file, "w") as f:
        f.write(old_text)
    restored, warnings = restore_with_warnings(directory, caplog)
    assert (restored.step, restored.meta["data"]["position"], restored.host_meta["data"]["position"]) == (2, 32, 32)
    assert warnings == []


def test_the_oldest_steps_warning_says_that_nothing_is_left_to_fall_back_to(tmp_path, caplog):
    """Issue 66: the oldest step's warning said "falling back to the previous step" where there was none; the
    restore then fails as a whole, moving nothing."""
    directory = str(tmp_path / "checkpoints")
    save_two_steps(directory)
    for step in ("1", "2"):
        flip_bytes(os.path.join(directory, step, "params"))
    with pytest.raises(CheckpointUnreadableError, match=f"no readable checkpoint in {directory}: step 2: "
                                                        "ChecksumMismatchError: .*; step 1: ChecksumMismatchError"):
        restore_with_warnings(directory, caplog)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    reason = ("(ChecksumMismatchError: {directory}/{step}/params: params['w'] does not match the checksum saved with "
              "it (its data changed after the save))")
    assert warnings == [
        f"checkpoint step 2 in {directory} is unreadable {reason.format(directory=directory, step=2)}; falling back "
        "to the previous step",
        f"checkpoint step 1 in {directory} is unreadable {reason.format(directory=directory, step=1)}; it is the "
        "oldest step: nothing to fall back to, the restore fails and no step is moved aside"]
    assert sorted(os.listdir(directory)) == ["1", "2"]


@pytest.fixture(scope="module")
def undamaged_resume(searching_runs, policy):
    """A run saved at step 1, then resumed from it to step 3: (metrics records, final step, final params)."""
    with ScriptedRetriever() as server:
        finish([searching_runs.start(server.config(), "record_reference", train__total_steps=1,
                                     train__checkpoint_every=1)], TIMEOUT_S)
        output = finish([searching_runs.start(server.config(), "record_reference", train__checkpoint_every=1)],
                        TIMEOUT_S)[0]
    assert "resumed from step 1" in output
    return result(searching_runs, "record_reference", policy[0])


@pytest.mark.slow
@pytest.mark.parametrize("field", ["rng", "data position"])
def test_a_run_whose_newest_record_has_a_flipped_bit_resumes_the_step_before_as_an_undamaged_resume(
        searching_runs, policy, undamaged_resume, field):
    """The issue's probe in a real run: one bit of step 2's saved rng (on another random stream 28 of 81 of step
    3's metrics differed) or of process 0's copy of the data position (harmless before: the hosts record is what
    is restored) is one warning naming the step and its file; the run resumes from step 1 and trains what a resume
    from an undamaged step 1 trains, bit for bit (every metric, the final weights)."""
    name = "record_" + field.replace(" ", "_")
    run_dir = searching_runs.run_dir(name)
    with ScriptedRetriever() as server:
        finish([searching_runs.start(server.config(), name, train__total_steps=2, train__checkpoint_every=1)],
               TIMEOUT_S)
        flip_bit_in(os.path.join(run_dir, "checkpoints", "2", "meta", "metadata"), *RECORD_FLIPS[field])
        output = finish([searching_runs.start(server.config(), name, train__checkpoint_every=1)], TIMEOUT_S)[0]
    warnings = [line for line in output.splitlines() if line.startswith("W") and "checkpoint.py" in line]
    directory = os.path.join(run_dir, "checkpoints")
    assert len(warnings) == 2, output[-6000:]
    assert warnings[0].endswith(META_FILE_LINE.format(directory=directory) + RECORD_REASON +
                                "); falling back to the previous step"), warnings[0]
    assert re.search(r"moved unreadable checkpoint \S+/2 to \S+/2\.unreadable-\d+$", warnings[1]), warnings[1]
    assert "resumed from step 1" in output and "Traceback" not in output
    assert_same_run(result(searching_runs, name, policy[0]), undamaged_resume)
