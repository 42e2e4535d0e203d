"""The run folder as a spot VM and a busy team meet it, with the real command: a second run on a live run folder is
refused with one line naming the holder (llds_jax.runtime.lease) and a dead holder's lease is taken over; a
read-only run folder is refused before anything is loaded; a run folder that becomes read-only or full in the middle
of a run ends it with one line and exit status 2, and the same command resumes from the last checkpoint once the
disk is back. The disk faults are real file systems (a tmpfs remounted read-only, a full tmpfs), so those tests need
the right to mount (root); elsewhere they are skipped, saying so."""
import json
import os
import signal
import subprocess
import threading
import time
import uuid

import pytest

from llds_jax.launch import LEASE_FILE
from tests.e2e.runs import finish, read_metrics, steps_saved
from tests.reliability.scripted_retriever import ScriptedRetriever
from tests.reliability.test_stops import TIMEOUT_S

ERROR = "llds_jax: error: "


def mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True, text=True)


@pytest.fixture
def tmpfs(tmp_path):
    """`tmpfs(folder, size)` mounts a fresh tmpfs of `size` (e.g. "64m") on `folder`; unmounted afterwards.
    Skips the test where mounting is not allowed."""
    mounted = []

    def make(folder: str, size: str = "256m") -> str:
        os.makedirs(folder, exist_ok=True)
        try:
            mount("-t", "tmpfs", "-o", f"size={size}", "tmpfs", folder)
        except (OSError, subprocess.CalledProcessError) as e:
            pytest.skip(f"cannot mount a tmpfs here ({e}): the disk-fault tests need root")
        mounted.append(folder)
        return folder

    yield make
    for folder in reversed(mounted):
        subprocess.run(["umount", "-l", folder], capture_output=True)


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith(ERROR)]


def assert_one_error_line(output: str, *fragments: str) -> str:
    """The output's single `llds_jax: error:` line (it holds every fragment), with no traceback anywhere."""
    lines = error_lines(output)
    assert len(lines) == 1 and all(f in lines[0] for f in fragments), output[-4000:]
    assert "Traceback" not in output, output[-6000:]
    return lines[0]


def wait_for(predicate, launched, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not predicate():
        assert launched.process.poll() is None, f"ended before {what}: {launched.output()[-4000:]}"
        assert time.monotonic() < deadline, f"no {what} within {TIMEOUT_S} s"
        time.sleep(0.05)


@pytest.mark.slow
def test_a_second_run_on_a_live_run_folder_is_refused_and_a_dead_holders_lease_is_taken_over(searching_runs):
    run_dir = searching_runs.run_dir("leased")
    lease_file = os.path.join(run_dir, LEASE_FILE)
    with ScriptedRetriever() as server:
        server.hanging = True  # each run waits in its retriever check, holding the lease
        retriever = {**server.config(), "timeout_s": 600.0}
        waits = {"rollout__search_timeout_s": 600.0}  # within the rollout's timeout too (llds_jax.checks)
        first = searching_runs.start(retriever, "leased", **waits)
        wait_for(lambda: server.requests == 1, first, "retriever check")
        holder = json.loads(open(lease_file).read())
        assert holder["pid"] == first.process.pid
        second = searching_runs.start(retriever, "leased", **waits)
        start = time.monotonic()
        second.process.wait(TIMEOUT_S)
        print(f"the second run: exit status {second.process.returncode} after {time.monotonic() - start:.1f} s")
        assert second.process.returncode == 2
        line = assert_one_error_line(second.output(), f"run_dir {run_dir} is in use by pid {first.process.pid} "
                                                       f"on host ")
        assert "lease file" in line
        first.process.send_signal(signal.SIGKILL)  # its lease stays behind, its process is gone
        first.process.wait(TIMEOUT_S)
        third = searching_runs.start(retriever, "leased", **waits)
        wait_for(lambda: server.requests == 2, third, "the third run's retriever check")
        assert f"taking over the lease of pid {first.process.pid}" in third.output()
        assert json.loads(open(lease_file).read())["pid"] == third.process.pid
        third.process.send_signal(signal.SIGTERM)
        third.process.wait(TIMEOUT_S)
    assert third.process.returncode == 0, third.output()[-4000:]
    assert not os.path.exists(lease_file)  # released at the exit


@pytest.mark.slow
def test_a_read_only_run_folder_is_refused_before_anything_is_loaded(searching_runs, tmpfs):
    run_dir = searching_runs.run_dir("read_only")
    tmpfs(run_dir)
    mount("-o", "remount,ro", run_dir)
    with ScriptedRetriever() as server:
        launched = searching_runs.start(server.config(), "read_only")
        start = time.monotonic()
        launched.process.wait(TIMEOUT_S)
        seconds = time.monotonic() - start
        assert server.requests == 0  # not even the retriever was asked
    assert launched.process.returncode == 2
    assert_one_error_line(launched.output(), f"run_dir {run_dir} is not writable", "Read-only file system")
    print(f"read-only run folder: exit 2 after {seconds:.1f} s")


def fault_mid_run(searching_runs, tmpfs, name: str, fault, repair, reason: str) -> None:
    """Runs `name` (3 steps, a checkpoint after each) on a tmpfs run folder; `fault(run_dir)` once step 1 is saved;
    asserts one error line naming `reason` and exit status 2; then `repair(run_dir)`, and the same command resumes
    and runs to the end. Once step 1 is saved the retriever holds every request until the fault is in place: the
    demo's later steps take a fraction of a second, and one that saved before the fault would let the run end
    without meeting it."""
    run_dir = tmpfs(searching_runs.run_dir(name), "256m")
    injected = threading.Event()
    with ScriptedRetriever() as server:
        server.on_request = lambda queries: 1 in steps_saved(run_dir) and injected.wait(TIMEOUT_S)
        launched = searching_runs.start(server.config(), name, train__checkpoint_every=1)
        wait_for(lambda: 1 in steps_saved(run_dir) and "step 1/3" in launched.output(), launched, "step 1's save")
        fault(run_dir)
        injected.set()
        launched.process.wait(TIMEOUT_S)
        output = launched.output()
        assert launched.process.returncode == 2, output[-4000:]
        line = assert_one_error_line(output, reason)
        print(f"{name}: {len(output.splitlines())} lines, error: {line}")
        repair(run_dir)
        finish([searching_runs.start(server.config(), name, train__checkpoint_every=1)], TIMEOUT_S)
    assert steps_saved(run_dir)[-1] == 3
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3]


@pytest.mark.slow
def test_a_run_folder_that_becomes_read_only_ends_the_run_with_one_line_and_it_resumes(searching_runs, tmpfs):
    def read_only_checkpoints(run_dir):  # a read-only file system over the checkpoint folder
        mount("-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", os.path.join(run_dir, "checkpoints"))

    fault_mid_run(searching_runs, tmpfs, "becomes_read_only", read_only_checkpoints,
                  lambda d: subprocess.run(["umount", os.path.join(d, "checkpoints")], check=True),
                  "Read-only file system")


@pytest.mark.slow
def test_a_full_disk_ends_the_run_with_one_line_and_it_resumes(searching_runs, tmpfs):
    filler = f"filler-{uuid.uuid4().hex}"

    def fill(run_dir):
        with open(os.path.join(run_dir, filler), "wb") as f:
            try:
                while True:
                    f.write(b"\0" * (1 << 20))
            except OSError:
                pass

    fault_mid_run(searching_runs, tmpfs, "disk_full", fill, lambda d: os.remove(os.path.join(d, filler)),
                  "No space left on device")
