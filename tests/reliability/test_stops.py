"""Stops as a TPU VM meets them, injected into real runs: SIGTERM in the middle of a step's rollout (while the
retriever stops answering) or updates (a preemption notice gives ~30 s, a 7B step takes minutes) and SIGKILL after
a checkpoint. Nothing is lost: the
resumed run equals an uninterrupted one bit for bit, and its metrics hold every step exactly once."""
import os
import re
import signal
import time

import jax
import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.e2e.runs import comparable, finish, latest_checkpoint, read_metrics, steps_saved
from tests.reliability.scripted_retriever import ScriptedRetriever

TIMEOUT_S = 300
STOP_WITHIN_S = 10  # from the signal to the exit: a session or an update, plus the save


def final_params(run_dir, model_dir):
    restored, _ = latest_checkpoint(run_dir, model_dir)
    leaves = jax.tree_util.tree_flatten_with_path(restored.params)[0]
    return restored.step, {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves}


@pytest.fixture(scope="module")
def reference(searching_runs, policy):
    """The uninterrupted run: (metrics records, final step, final params)."""
    with ScriptedRetriever() as server:
        finish([searching_runs.start(server.config(), "reference")], TIMEOUT_S)
    run_dir = searching_runs.run_dir("reference")
    return (read_metrics(run_dir), *final_params(run_dir, policy[0]))


def assert_equal_to_reference(run_dir, reference, model_dir):
    records, step, params = reference
    resumed = read_metrics(run_dir)
    assert [r["step"] for r in resumed] == [1, 2, 3]
    assert [comparable(r) for r in resumed] == [comparable(r) for r in records]
    resumed_step, resumed_params = final_params(run_dir, model_dir)
    assert resumed_step == step and resumed_params.keys() == params.keys()
    for key in params:
        np.testing.assert_array_equal(resumed_params[key], params[key], err_msg=str(key))


def assert_stopped_in_time(launched, signalled_at: float) -> str:
    """Waits for the process that was sent a stop signal at `signalled_at` (time.monotonic(), one clock for every
    process of the machine); asserts that it exited with status 0 within STOP_WITHIN_S. Returns its output."""
    launched.process.wait(TIMEOUT_S)
    stopped_s = time.monotonic() - signalled_at
    output = launched.output()
    assert launched.process.returncode == 0, output[-4000:]
    assert stopped_s <= STOP_WITHIN_S, output[-4000:]
    print(f"exit status 0 {stopped_s:.1f} s after the signal")
    return output


def stopped_during_updates(searching_runs, server, name: str, step: int, updates: int, **settings) -> str:
    """Launches run `name` under tests/reliability/sigterm_at_update.py, which sends SIGTERM once `updates` of step
    `step`'s updates are done; asserts the run stopped in time (`assert_stopped_in_time`), saving the state from
    before that step. Returns its output."""
    launched = searching_runs.start(server.config(), name, **settings,
                                    launcher=("-m", "tests.reliability.sigterm_at_update", str(step), str(updates)))
    launched.process.wait(TIMEOUT_S)
    signalled = re.search(r"SIGTERM sent at monotonic (\S+)", launched.output())
    assert signalled, launched.output()[-4000:]
    output = assert_stopped_in_time(launched, float(signalled.group(1)))
    assert (f"stop requested during the updates of step {step}: saved the state before it, exiting"
            in output), output[-4000:]
    return output


@pytest.mark.slow
def test_sigterm_during_a_rollout_saves_the_step_before_and_resumes_bitwise(searching_runs, reference,
                                                                            policy):
    run_dir = searching_runs.run_dir("rollout_stop")
    with ScriptedRetriever() as server:
        launched = None
        sent = []

        def sigterm_in_step_2(queries):  # the first search after step 1's console line: step 2's first session
            if not sent and "step 1/3" in launched.output():
                server.hanging = True  # and the retriever stops answering: the search in flight is abandoned
                launched.process.send_signal(signal.SIGTERM)
                sent.append(time.monotonic())

        server.on_request = sigterm_in_step_2
        launched = searching_runs.start({"backend": "http", "url": server.url}, "rollout_stop")  # default retries
        launched.process.wait(TIMEOUT_S)
        assert sent, launched.output()[-4000:]
        output = assert_stopped_in_time(launched, sent[0])
        assert "stop requested during the rollout of step 2: saved the state before it, exiting" in output
        assert "training stopped after step 1 of 3" in output
        assert steps_saved(run_dir) == [1]
        assert [r["step"] for r in read_metrics(run_dir)] == [1]
        server.hanging = False
        finish([searching_runs.start(server.config(), "rollout_stop")], TIMEOUT_S)
    assert_equal_to_reference(run_dir, reference, policy[0])


@pytest.mark.slow
def test_sigterm_during_the_updates_saves_the_step_before_and_resumes_bitwise(searching_runs, reference,
                                                                             policy):
    run_dir = searching_runs.run_dir("update_stop")
    with ScriptedRetriever() as server:
        output = stopped_during_updates(searching_runs, server, "update_stop", 2, 5)  # 5 of step 2's 32 updates
        assert "training stopped after step 1 of 3" in output
        assert steps_saved(run_dir) == [1]
        finish([searching_runs.start(server.config(), "update_stop")], TIMEOUT_S)
    assert_equal_to_reference(run_dir, reference, policy[0])


@pytest.mark.slow
def test_sigkill_after_a_checkpoint_loses_no_metrics(searching_runs, reference, policy):
    run_dir = searching_runs.run_dir("killed")
    with ScriptedRetriever() as server:
        launched = searching_runs.start(server.config(), "killed", train__checkpoint_every=1)
        deadline = time.monotonic() + TIMEOUT_S
        while 2 not in steps_saved(run_dir):
            assert launched.process.poll() is None and time.monotonic() < deadline, launched.output()[-4000:]
            time.sleep(0.05)
        launched.process.send_signal(signal.SIGKILL)
        launched.process.wait(TIMEOUT_S)
        # The metrics of every step whose checkpoint was committed reached the disk before it.
        assert [r["step"] for r in read_metrics(run_dir)][:2] == [1, 2]
        finish([searching_runs.start(server.config(), "killed", train__checkpoint_every=1)], TIMEOUT_S)
    assert_equal_to_reference(run_dir, reference, policy[0])
    events = EventAccumulator(os.path.join(run_dir, "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("reward/mean")] == [1, 2, 3]
