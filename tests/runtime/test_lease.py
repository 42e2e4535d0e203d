"""llds_jax.runtime.lease: one writer per folder, on a local disk and on gs:// (the GCS emulator): a live holder is
refused by name, a dead one's lease is taken over (a pid that ended, a reused pid, another host's old heartbeat),
the heartbeat is refreshed, the file is deleted at release, and an unwritable folder is named."""
import json
import logging
import os
import socket
import subprocess
import sys
import time

import pytest

from llds_jax.runtime import lease

TIMEOUT_S = 120.0  # seconds taking or releasing a lease may take (the run passes train.storage_timeout_s)


def write_record(path, **fields) -> None:
    record = {"host": socket.gethostname(), "pid": os.getpid(), "start_ticks": lease.process_start_ticks(os.getpid()),
              "started": time.time(), "heartbeat": time.time(), "token": "other", **fields}
    with open(path, "w") as f:
        json.dump(record, f)


def ended_pid() -> int:
    """The pid of a process that has ended."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_a_lease_is_held_for_the_block_and_deleted_at_release(tmp_path):
    path = tmp_path / "run" / "lease.json"
    with lease.Lease(path, "run_dir X", TIMEOUT_S) as held:
        record = json.loads(path.read_text())
        assert (record["host"], record["pid"], record["token"]) == (socket.gethostname(), os.getpid(),
                                                                     held.record["token"])
    assert not path.exists()


def test_a_live_holder_is_refused_naming_it(tmp_path):
    path = tmp_path / "lease.json"
    write_record(path)  # this very process, another lease token
    with pytest.raises(lease.LeaseHeldError, match=rf"^run_dir X is in use by pid {os.getpid()} on host "
                                                    rf"{socket.gethostname()} \(started .* UTC, last heartbeat 0 s "
                                                    rf"ago\) \(lease file {path}\)"):
        lease.Lease(path, "run_dir X", TIMEOUT_S).acquire()
    assert json.loads(path.read_text())["token"] == "other"  # untouched


@pytest.mark.parametrize("fields", [
    pytest.param(lambda: {"pid": ended_pid()}, id="pid_ended"),
    pytest.param(lambda: {"start_ticks": -1}, id="pid_reused"),
    pytest.param(lambda: {"host": "another-host", "heartbeat": time.time() - 121}, id="other_host_silent"),
])
def test_the_lease_of_a_holder_that_is_gone_is_taken_over(tmp_path, caplog, fields):
    path = tmp_path / "lease.json"
    write_record(path, **fields())
    with caplog.at_level(logging.WARNING), lease.Lease(path, "run_dir X", TIMEOUT_S) as held:
        assert json.loads(path.read_text())["token"] == held.record["token"]
    assert "run_dir X: taking over the lease of pid" in caplog.text


@pytest.mark.parametrize("content, problem", [
    pytest.param("", "empty", id="empty"),  # a run started on a full disk: the create succeeded, the write did not
    pytest.param('{"host": "h", "pid"', "not JSON", id="cut_short"),
    pytest.param(json.dumps({"host": "another-host", "pid": 7, "started": 0, "heartbeat": "soon", "token": "t"}),
                 "heartbeat is not a time: 'soon'", id="heartbeat_not_a_number"),
    pytest.param(json.dumps({"host": "another-host", "pid": 7, "started": 0, "heartbeat": time.time() + 31536000,
                             "token": "t"}), "s in the future", id="heartbeat_in_a_year"),
    pytest.param(json.dumps([1, 2]), "not a record: [1, 2]", id="not_a_record"),
])
def test_an_unreadable_or_impossible_lease_is_taken_over_with_one_warning(tmp_path, caplog, content, problem):
    path = tmp_path / "lease.json"
    path.write_text(content)
    with caplog.at_level(logging.WARNING), lease.Lease(path, "run_dir X", TIMEOUT_S) as held:
        assert json.loads(path.read_text())["token"] == held.record["token"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith(f"run_dir X: unreadable lease file {path} (")
    assert problem in warnings[0] and warnings[0].endswith("): taking it over")
    assert not path.exists()  # released at the end like any lease


def test_another_hosts_lease_with_a_recent_heartbeat_is_refused(tmp_path):
    path = tmp_path / "lease.json"
    write_record(path, host="another-host", pid=1, heartbeat=time.time() - 60)
    with pytest.raises(lease.LeaseHeldError, match="in use by pid 1 on host another-host .* last heartbeat 60 s ago"):
        lease.Lease(path, "run_dir X", TIMEOUT_S).acquire()


def test_the_heartbeat_is_refreshed(tmp_path):
    path = tmp_path / "lease.json"
    with lease.Lease(path, "run_dir X", TIMEOUT_S, heartbeat_s=0.05):
        first = json.loads(path.read_text())["heartbeat"]
        deadline = time.monotonic() + 10
        while json.loads(path.read_text())["heartbeat"] == first:
            assert time.monotonic() < deadline, "no heartbeat within 10 s"
            time.sleep(0.02)


def test_an_unwritable_folder_is_named(tmp_path):
    (tmp_path / "file").write_text("")  # a folder below a regular file cannot be created, even by root
    with pytest.raises(lease.FolderNotWritableError,
                       match=rf"^run_dir X: {tmp_path}/file is a file, not a folder: name a folder "):
        lease.Lease(tmp_path / "file" / "run" / "lease.json", "run_dir X", TIMEOUT_S).acquire()
    with pytest.raises(lease.FolderNotWritableError, match=rf"^--export_dir Y: {tmp_path}/file is a file, not a "
                                                           "folder: "):
        lease.check_writable(tmp_path / "file" / "out", "--export_dir Y")
    with pytest.raises(lease.FolderNotWritableError, match=r"^--export_dir F is a file, not a folder: "):
        lease.check_writable(tmp_path / "file", "--export_dir F")
    lease.check_writable(tmp_path / "ok", "--export_dir Z")
    assert os.listdir(tmp_path / "ok") == []  # the probe is gone


def test_a_lease_on_gcs(gcs_dir, gcs_fs):
    path = f"{gcs_dir}/run/lease.json"
    with lease.Lease(path, "run_dir G", TIMEOUT_S) as held:
        assert json.loads(gcs_fs.cat(path))["token"] == held.record["token"]
        with pytest.raises(lease.LeaseHeldError, match=f"^run_dir G is in use by pid {os.getpid()} "):
            lease.Lease(path, "run_dir G", TIMEOUT_S).acquire()
    gcs_fs.invalidate_cache()
    assert not gcs_fs.exists(path)


def test_a_lease_that_cannot_be_read_at_release_is_left_with_one_warning_not_taken_over(tmp_path, caplog):
    """Storage that stops answering at the end of a run (here: the file became a folder, so reading it fails) leaves
    the lease to go stale: one warning that it could not be deleted, none that it is being taken over."""
    path = tmp_path / "lease.json"
    with caplog.at_level(logging.WARNING):
        with lease.Lease(path, "run_dir X", TIMEOUT_S):
            path.unlink()
            path.mkdir()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith(f"run_dir X: could not delete the lease file {path} ("), \
        warnings
