"""llds_jax.storage: a failed write is one StorageError naming the operation, the path (with the GCS endpoint) and
the reason; a write that stops answering ends the process after its timeout, or STOP_GRACE_S after a stop signal,
with one line and exit status 2; the Checkpointer reports a failed background save as one error of that step."""
import logging
import os
import re
import shutil
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import pytest

from llds_jax import gcs, storage
from llds_jax.train.checkpoint import Checkpointer


def test_a_failed_write_is_one_storage_error_naming_operation_path_and_reason(tmp_path):
    with pytest.raises(storage.StorageError, match=rf"^writing metrics to {tmp_path} failed: No space left on "
                                                    r"device$"):
        with storage.operation("writing metrics to", tmp_path):
            raise OSError(28, "No space left on device")
    where = re.escape(f"gs://b/r (Google Cloud Storage at {gcs.endpoint()})")
    with pytest.raises(storage.StorageError, match=rf"^saving x to {where} failed: ValueError: bad$"):
        with storage.operation("saving x to", "gs://b/r"):
            raise ValueError("bad\nsecond line")
    with pytest.raises(KeyError):  # a reader that judges its own errors
        with storage.operation("reading", tmp_path, convert=False):
            raise KeyError("k")


def run_python(code: str) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    return proc, time.monotonic() - start


def test_an_operation_that_stops_answering_ends_the_process_with_one_line():
    proc, seconds = run_python(
        "import time\nfrom llds_jax import storage\n"
        "with storage.operation('saving checkpoint step 3 to', '/runs/x', timeout_s=1.0):\n    time.sleep(60)\n")
    assert proc.returncode == 2 and seconds < 30
    assert proc.stderr == ("llds_jax: error: saving checkpoint step 3 to /runs/x: no answer within 1 s; the same "
                           "command resumes from the newest complete checkpoint\n")


def test_a_stop_signal_cuts_the_wait_to_the_stop_grace():
    proc, seconds = run_python(
        "import time\nfrom llds_jax import storage\nstorage.STOP_GRACE_S = 1.0\n"
        "with storage.operation('writing metrics to', '/runs/x', timeout_s=600):\n"
        "    storage.stop_requested()\n    time.sleep(60)\n")
    assert proc.returncode == 2 and seconds < 30
    assert proc.stderr == ("llds_jax: error: writing metrics to /runs/x: no answer within 1 s (a stop was requested: "
                           "nothing more can be saved); the same command resumes from the newest complete "
                           "checkpoint\n")


def test_a_failed_background_save_is_one_error_of_its_step_and_close_returns(tmp_path, caplog):
    params = {"w": jax.device_put(jnp.arange(4.0))}
    folder = tmp_path / "checkpoints"
    ckpt = Checkpointer(str(folder), save_every=1, keep=3)
    ckpt.save(1, params, None, {"k": 1})
    ckpt.wait_until_finished()
    shutil.rmtree(folder)
    folder.write_text("")  # the folder became a file: step 2's folder cannot be made
    with caplog.at_level(logging.INFO):
        ckpt.save(2, params, None, {"k": 2})
        with pytest.raises(storage.StorageError, match=rf"^saving checkpoint step 2 to {folder} failed: "):
            ckpt.wait_until_finished()
    assert ckpt.failed
    ckpt.close()  # waits for nothing more
    assert not [r for r in caplog.records if r.exc_info and f"{os.sep}orbax{os.sep}" in r.pathname]
