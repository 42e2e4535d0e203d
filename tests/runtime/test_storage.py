"""llds_jax.runtime.storage: a failed write is one StorageError naming the operation, the path (with the GCS
endpoint) and the reason; a write that stops answering ends the process after its timeout, or STOP_GRACE_S after a stop
signal, with one line and exit status 2; the Checkpointer reports a failed save as one error of that step and leaves
none of orbax's threads or coroutines behind."""
import gc
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import warnings

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
import pytest
from orbax.checkpoint._src.futures import future as orbax_future
from orbax.checkpoint._src.multihost import multihost as orbax_multihost

from llds_jax.runtime import gcs, storage
from llds_jax.train.checkpoint import Checkpointer


def test_a_failed_write_is_one_storage_error_naming_operation_path_and_reason(tmp_path):
    with pytest.raises(storage.StorageError, match=rf"^writing metrics to {tmp_path} failed: No space left on "
                                                    r"device$"):
        with storage.operation("writing metrics to", tmp_path, 120.0):
            raise OSError(28, "No space left on device")
    where = re.escape(f"gs://b/r (Google Cloud Storage at {gcs.endpoint()})")
    with pytest.raises(storage.StorageError, match=rf"^saving x to {where} failed: ValueError: bad$"):
        with storage.operation("saving x to", "gs://b/r", 120.0):
            raise ValueError("bad\nsecond line")
    with pytest.raises(KeyError):  # a reader that judges its own errors
        with storage.operation("reading", tmp_path, 120.0, convert=False):
            raise KeyError("k")


def run_python(code: str) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    return proc, time.monotonic() - start


def test_an_operation_that_stops_answering_ends_the_process_with_one_line():
    proc, seconds = run_python(
        "import time\nfrom llds_jax.runtime import storage\n"
        "with storage.operation('saving checkpoint step 3 to', '/runs/x', timeout_s=1.0):\n    time.sleep(60)\n")
    assert proc.returncode == 2 and seconds < 30
    assert proc.stderr == ("llds_jax: error: saving checkpoint step 3 to /runs/x: no answer within 1 s; the same "
                           "command resumes from the newest complete checkpoint\n")


def test_on_the_way_out_the_wait_for_a_save_counts_its_timeout_from_the_saves_start():
    """A checkpoint's background save is waited for later. In a running run the wait gets its whole timeout (a save
    that ended long ago may still delete old steps). On the way out of a failure it counts from the save's start,
    with at least AFTER_FAILURE_S left (before: from the wait's start, a whole timeout after the write that failed
    first: 154 s after a dead endpoint in CI, at the default 120 s)."""
    proc, seconds = run_python(
        "import time\nfrom llds_jax.runtime import storage\nstorage.AFTER_FAILURE_S = 1.0\n"
        "with storage.operation('saving checkpoint step 2 to', '/runs/x', timeout_s=10.0, saves_state=True,\n"
        "                       work_began=time.monotonic() - 100.0):\n    time.sleep(2)\n"
        "print('the running wait ended', flush=True)\n"
        "try:\n    with storage.operation('writing metrics to', '/runs/x', 120.0):\n"
        "        raise OSError(28, 'No space left on device')\nfinally:\n"
        "    with storage.operation('saving checkpoint step 3 to', '/runs/x', timeout_s=101.0, saves_state=True,\n"
        "                           work_began=time.monotonic() - 1000.0):\n        time.sleep(200)\n")
    assert proc.returncode == 2 and seconds < 30
    assert proc.stdout == "the running wait ended\n"
    assert proc.stderr == ("llds_jax: error: saving checkpoint step 3 to /runs/x: no answer within 101 s; the same "
                           "command resumes from the newest complete checkpoint\n")


def test_a_stop_signal_cuts_the_wait_to_the_stop_grace():
    proc, seconds = run_python(
        "import time\nfrom llds_jax.runtime import storage\nstorage.STOP_GRACE_S = 1.0\n"
        "with storage.operation('writing metrics to', '/runs/x', timeout_s=600):\n"
        "    storage.stop_requested()\n    time.sleep(60)\n")
    assert proc.returncode == 2 and seconds < 30
    assert proc.stderr == ("llds_jax: error: writing metrics to /runs/x: no answer within 1 s (a stop was requested: "
                           "nothing more can be saved); the same command resumes from the newest complete "
                           "checkpoint\n")


def test_a_write_on_the_way_out_of_a_failure_gets_seconds_and_ends_with_the_failures_line():
    """A metrics write fails; as the error propagates, the checkpoint save in flight is waited for (2 s, past
    AFTER_FAILURE_S: a save keeps its whole timeout) and the lease is released on the endpoint that failed, which
    does not answer: the process ends AFTER_FAILURE_S later with the metrics' line (before: the lease's whole
    timeout, 120 s by default, then a line naming the lease). A write after a failure was handled gets its whole
    timeout (the first 2 s write below ends: a failure is no state of the process)."""
    proc, seconds = run_python(
        "import contextlib, time\nfrom llds_jax.runtime import storage\nstorage.AFTER_FAILURE_S = 1.0\n"
        "try:\n    with storage.operation('saving checkpoint step 2 to', '/runs/x', timeout_s=600):\n"
        "        raise OSError(28, 'No space left on device')\nexcept storage.StorageError:\n    pass\n"
        "with storage.operation('writing metrics to', '/runs/x', timeout_s=600):\n    time.sleep(2)\n"
        "@contextlib.contextmanager\ndef lease():\n    try:\n        yield\n    finally:\n"
        "        with storage.operation('releasing the lease', '/runs/x/lease.json', timeout_s=600):\n"
        "            time.sleep(60)\n"
        "with lease():\n    try:\n        with storage.operation('writing metrics to', '/runs/x', timeout_s=600):\n"
        "            raise OSError(28, 'No space left on device')\n    finally:\n"
        "        with storage.operation('saving checkpoint step 3 to', '/runs/x', 600, saves_state=True):\n"
        "            time.sleep(2)\n        print('step 3 saved', flush=True)\n")
    assert proc.returncode == 2 and 5 < seconds < 30, (seconds, proc.stderr)
    assert proc.stdout == "step 3 saved\n"
    assert proc.stderr == ("llds_jax: error: writing metrics to /runs/x failed: No space left on device; the same "
                           "command resumes from the newest complete checkpoint\n")


def _folder_becomes_a_file(folder, monkeypatch):
    """The checkpoint folder is replaced by a file: step 2's folder cannot be made (a save that fails at once)."""
    shutil.rmtree(folder)
    folder.write_text("")


def _disk_fills_during_the_background_write(folder, monkeypatch):
    """The meta item's write, which runs in orbax's background threads, fails as on a full disk."""
    async def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ocp.JsonCheckpointHandler, "_save_fn", no_space)


def _orbax_commit_threads(but: set[threading.Thread]) -> list[threading.Thread]:
    """orbax's running commit threads (a save's writers), but those in `but` (another test's)."""
    return [t for t in threading.enumerate()
            if isinstance(t, orbax_future._SignalingThread) and t.is_alive() and t not in but]


@pytest.mark.parametrize("fault", [_folder_becomes_a_file, _disk_fills_during_the_background_write])
def test_a_failed_save_is_one_error_of_its_step_and_leaves_nothing_running(tmp_path, caplog, monkeypatch, fault):
    """A failed save is one StorageError naming its step (from `save` or from the next wait), `close` returns, and
    nothing of the save is left behind: before issue 58 (item 17) a step folder that could not be made left orbax's
    writers of the step waiting for its folder signal, for orbax's signal timeout (300 s: the interpreter's exit
    waited that long), after which they dropped their coroutines: the six "coroutine '...' was never awaited"
    blocks in the test suite's output. The signal timeout is cut to 2 s here, so that the code before fails in
    seconds (its threads still waiting after `close`, then the warnings)."""
    monkeypatch.setattr(orbax_multihost, "_DEFAULT_BARRIER_TIMEOUT", 2)
    others = set(threading.enumerate())
    params = {"w": jax.device_put(jnp.arange(4.0))}
    folder = tmp_path / "checkpoints"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ckpt = Checkpointer(str(folder), save_every=1, keep=3)
        ckpt.save(1, params, None, {"k": 1})
        ckpt.wait_until_finished()
        fault(folder, monkeypatch)
        with caplog.at_level(logging.INFO):
            with pytest.raises(storage.StorageError, match=rf"^saving checkpoint step 2 to {folder} failed: "):
                ckpt.save(2, params, None, {"k": 2})
                ckpt.wait_until_finished()
        assert ckpt.failed
        ckpt.close()  # waits for nothing more
        del ckpt  # what orbax keeps of the save (a waiting writer holds its coroutine) goes with it
        deadline = time.monotonic() + 1
        while _orbax_commit_threads(others) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = [t.name for t in _orbax_commit_threads(others)]
        deadline = time.monotonic() + 5  # past the signal timeout: the code before dropped its coroutines by then
        while _orbax_commit_threads(others) and time.monotonic() < deadline:
            time.sleep(0.05)
        gc.collect()
    never_awaited = [str(w.message) for w in caught if "was never awaited" in str(w.message)]
    assert not left and not never_awaited, f"threads left: {left}; {never_awaited}"
    assert not [r for r in caplog.records if r.exc_info and f"{os.sep}orbax{os.sep}" in r.pathname]
