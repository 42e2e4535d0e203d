"""A gs:// run folder whose GCS endpoint fails in the middle of a run (a fake-gcs-server of the test's own, storing
its objects on disk so that they outlive it): an endpoint that dies, or one that stops answering (the server
frozen with SIGSTOP). Either way the run ends with one `llds_jax: error:` line naming the endpoint and the
operation, exit status 2, within a bounded time (`train.storage_timeout_s`, or a few seconds after a SIGTERM),
and the same command resumes from the checkpoints saved before once the endpoint is back (llds_jax.runtime.storage)."""
import signal
import time

import pytest

from tests import gcs_emulator
from tests.e2e.runs import finish
from tests.reliability.scripted_retriever import ScriptedRetriever
from tests.reliability.test_run_folder import assert_one_error_line, wait_for
from tests.reliability.test_stops import TIMEOUT_S

BUCKET = "llds-faults"
STORAGE_TIMEOUT_S = 15.0
SLACK_S = 10.0  # the process's own exit, on a loaded machine
STEP_S = 10.0  # the rest of the step under way at the fault: its writes begin after it


@pytest.fixture
def emulator(tmp_path):
    """A fake-gcs-server with its objects in tmp_path (bucket BUCKET), resumed if a test left it frozen."""
    server = gcs_emulator.Emulator(root=str(tmp_path / "objects"))
    (tmp_path / "objects").mkdir()
    server.start()
    server.create_bucket(BUCKET)
    yield server
    if server.paused:
        server.resume()
    server.stop()


def committed_steps(server: gcs_emulator.Emulator, prefix: str) -> list[int]:
    """The checkpoint steps under gs://BUCKET/prefix/checkpoints whose save completed: on GCS orbax writes each step
    straight into its final folder and commits it by writing commit_success.txt there last (its
    _CHECKPOINT_METADATA is there from the start: a fault after it alone leaves an unfinished step, which the
    resumed run's checkpointer deletes)."""
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    client = storage.Client(project=gcs_emulator.PROJECT, credentials=AnonymousCredentials(),
                            client_options={"api_endpoint": server.url})
    names = [blob.name for blob in client.list_blobs(BUCKET, prefix=f"{prefix}/checkpoints/")]
    parts = [name[len(prefix) + len("/checkpoints/"):].split("/") for name in names]
    return sorted({int(p[0]) for p in parts if p[0].isdigit() and p[1:] == ["commit_success.txt"]})


def start(searching_runs, server, emulator, name: str, **settings):
    """Starts `name` on gs://BUCKET/name, a checkpoint after every step."""
    return searching_runs.start(server.config(), name, run_dir=f"gs://{BUCKET}/{name}",
                                env=gcs_emulator.environment(emulator.url), train__checkpoint_every=1, **settings)


def run_until_step_1_is_saved(searching_runs, server, emulator, name: str, **settings):
    """Starts `name`; returns it once step 1's checkpoint is complete."""
    launched = start(searching_runs, server, emulator, name, **settings)
    wait_for(lambda: 1 in committed_steps(emulator, name), launched, "step 1's checkpoint")
    return launched


def assert_ended_in(launched, since: float, bound_s: float) -> str:
    launched.process.wait(TIMEOUT_S)
    seconds = time.monotonic() - since
    output = launched.output()
    assert launched.process.returncode == 2, output[-4000:]
    assert seconds <= bound_s, (seconds, output[-4000:])
    print(f"ended {seconds:.1f} s after the fault, {len(output.splitlines())} lines of output")
    return output


def test_a_killed_endpoint_comes_back_without_the_upload_it_cut_short(emulator):
    """The stand-in itself: a kill in the middle of an upload leaves the object's bytes without their metadata,
    which made the restarted server answer 404 to every listing of the bucket (real GCS never shows a partial
    object); `kill` removes such files, and the complete objects are all back."""
    import os

    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    client = storage.Client(project=gcs_emulator.PROJECT, credentials=AnonymousCredentials(),
                            client_options={"api_endpoint": emulator.url})
    client.bucket(BUCKET).blob("run/checkpoints/1/commit_success.txt").upload_from_string(b"committed")
    with open(os.path.join(emulator.root, BUCKET, "run", "checkpoints", "2.orbax-checkpoint-tmp"), "wb") as f:
        f.write(b"bytes of an upload whose metadata was never written")
    emulator.kill()
    emulator.start()
    assert committed_steps(emulator, "run") == [1]


def test_a_resumed_endpoint_answers_without_the_upload_its_client_gave_up(emulator):
    """The stand-in itself: bytes without metadata left while the server was frozen (an upload whose client gave
    up) are removed by `resume`, as by `kill`; otherwise every listing of the bucket answers 404."""
    import os

    emulator.pause()
    folder = os.path.join(emulator.root, BUCKET, "paused", "checkpoints")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "2.orbax-checkpoint-tmp"), "wb") as f:
        f.write(b"bytes of an upload whose metadata was never written")
    emulator.resume()
    assert committed_steps(emulator, "paused") == []


@pytest.mark.slow
@pytest.mark.parametrize("fault, repair, timeout_s", [("kill", "start", STORAGE_TIMEOUT_S),
                                                      ("pause", "resume", STORAGE_TIMEOUT_S),
                                                      ("kill", "start", None)],
                         ids=["dies", "stops_answering", "dies_at_the_default_timeout"])
def test_an_endpoint_that_fails_ends_the_run_with_one_line_in_bounded_time_and_it_resumes(searching_runs, emulator,
                                                                                          fault, repair, timeout_s):
    """At the default `train.storage_timeout_s` (None: 120 s) the clients retry a dead endpoint for longer (about
    100 s), and a checkpoint's background save waits (tensorstore) until its timeout, counted from its start:
    still one line, no retry's traceback. The writes on the way out (the lease's release) get AFTER_FAILURE_S more.
    Before, the wait for the save counted its timeout from the wait's start, after a metrics write had failed (the
    run ended 154 s after the fault in CI)."""
    from llds_jax.config.sections import TrainConfig
    from llds_jax.runtime.storage import AFTER_FAILURE_S

    name = f"endpoint_{fault}_{timeout_s or 'default'}"
    settings = {} if timeout_s is None else {"train__storage_timeout_s": timeout_s}
    with ScriptedRetriever() as server:
        launched = run_until_step_1_is_saved(searching_runs, server, emulator, name, **settings)
        getattr(emulator, fault)()
        bound_s = STEP_S + (timeout_s or TrainConfig.storage_timeout_s) + AFTER_FAILURE_S + SLACK_S
        output = assert_ended_in(launched, time.monotonic(), bound_s)
        line = assert_one_error_line(output, f"(Google Cloud Storage at {emulator.url})")
        assert line.startswith(("llds_jax: error: saving checkpoint step", "llds_jax: error: writing metrics to")), line
        getattr(emulator, repair)()
        assert 1 in committed_steps(emulator, name)
        finish([start(searching_runs, server, emulator, name)], TIMEOUT_S)
    assert committed_steps(emulator, name)[-1] == 3


@pytest.mark.slow
def test_sigterm_while_the_endpoint_hangs_ends_the_run_within_the_stop_grace(searching_runs, emulator):
    from llds_jax.runtime.storage import STOP_GRACE_S

    with ScriptedRetriever() as server:  # the default storage timeout (120 s): the signal is what ends the wait
        launched = run_until_step_1_is_saved(searching_runs, server, emulator, "endpoint_hangs_sigterm")
        emulator.pause()
        launched.process.send_signal(signal.SIGTERM)
        output = assert_ended_in(launched, time.monotonic(), STOP_GRACE_S + SLACK_S)
        assert_one_error_line(output, f"(Google Cloud Storage at {emulator.url}): no answer within",
                              "a stop was requested")
        emulator.resume()
        assert 1 in committed_steps(emulator, "endpoint_hangs_sigterm")
