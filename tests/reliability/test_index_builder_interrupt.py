"""SIGINT stops `python -m index_builder` within moments (a real process): one line on stderr saying what is left,
exit status 130, and never a folder at --out (bm25 removes OUT.partial; faiss keeps its complete shards there, without
a manifest, so nothing reads it as an index). The signal is sent once the build has written passages (OUT.partial's
files), to a process started as a shell starts it: normally, or with SIGINT ignored (`trap "" INT`, as a
non-interactive shell starts `cmd &`), which Python keeps unless the builder installs its own handler. A SIGINT that
arrives inside a gc callback (JAX registers one) interrupts the code after it instead of being printed and dropped,
also when finalizers run by the same collection swallow it."""
import gc
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from llds_jax.search.dense_index import MANIFEST_FILE, index_file
from llds_jax.search.synthetic import write_random_bert
from tests.servers import wait_until

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CORPUS_DOCS = 60_000  # passages: tens of seconds of building on 2 CPUs, so the build is running when SIGINT comes
EXIT_WITHIN_S = 10  # seconds from SIGINT to exit allowed (it takes ~1 s: interpreter shutdown with JAX loaded)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A corpus of CORPUS_DOCS passages of 60 words drawn from 5,000."""
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    rng = random.Random(0)
    words = [f"w{i}" for i in range(5000)]
    with open(path, "w", encoding="utf-8") as f:
        for i in range(CORPUS_DOCS):
            f.write(json.dumps({"id": str(i), "contents": f'"Doc {i}"\n' + " ".join(rng.choices(words, k=60))}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def e5_folder(tmp_path_factory):
    """A tiny random BERT folder in e5's layout (hidden 32, 2 layers, 128 positions)."""
    return write_random_bert(str(tmp_path_factory.mktemp("e5") / "tiny_e5"))


def start_build(args, sigint_ignored):
    """`python -m index_builder ARGS --no-progress` started by a shell, with SIGINT ignored when `sigint_ignored`."""
    script = ('trap "" INT; ' if sigint_ignored else "") + 'exec "$@"'
    return subprocess.Popen(["sh", "-c", script, "sh", sys.executable, "-m", "index_builder", *args, "--no-progress"],
                            cwd=REPO_ROOT, stderr=subprocess.PIPE, text=True)


def wait_for_file(process, path):
    """Waits until `path` exists and holds bytes (the build has got that far); fails if the build ended first."""

    def written():
        if process.poll() is not None:
            pytest.fail(f"index_builder exited with {process.returncode} before writing {path}:"
                        f" {process.stderr.read()}")
        return os.path.exists(path) and os.path.getsize(path) > 0

    wait_until(written, 120, path)


def interrupt(process):
    """(exit status, stderr) of `process` after a SIGINT; fails if it still runs EXIT_WITHIN_S after it."""
    process.send_signal(signal.SIGINT)
    try:
        _, stderr = process.communicate(timeout=EXIT_WITHIN_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        pytest.fail(f"index_builder still running {EXIT_WITHIN_S} s after SIGINT")
    return process.returncode, stderr


@pytest.mark.parametrize("sigint_ignored", [False, True], ids=["sigint_default", "sigint_ignored_by_the_shell"])
def test_sigint_stops_a_bm25_build_and_leaves_nothing(corpus, tmp_path, sigint_ignored):
    out = str(tmp_path / "index")
    process = start_build([corpus, "--to", "bm25", "--out", out], sigint_ignored)
    wait_for_file(process, os.path.join(out + ".partial", "docs.jsonl"))
    status, stderr = interrupt(process)
    assert (status, stderr) == (130, f"index_builder: interrupted; {out} not created, {out}.partial removed\n")
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_sigint_stops_a_faiss_build_and_keeps_its_complete_shards(corpus, tmp_path, e5_folder):
    out, partial = str(tmp_path / "index"), str(tmp_path / "index.partial")
    process = start_build([corpus, "--to", "faiss", "--encoder", "e5", "--encoder-path", e5_folder, "--out", out,
                           "--max-length", "128", "--shard-docs", "100"], sigint_ignored=True)
    wait_for_file(process, os.path.join(partial, "shards", "emb_000000.npy"))
    status, stderr = interrupt(process)
    assert status == 130 and "Traceback" not in stderr
    assert stderr.splitlines()[-1] == (f"index_builder: interrupted; {out} not created, the complete shards in"
                                       f" {partial} are kept: re-run the same command to resume")
    assert os.listdir(tmp_path) == ["index.partial"] and not os.path.exists(os.path.join(partial, MANIFEST_FILE))
    with pytest.raises(FileNotFoundError, match="not a dense index folder"):
        index_file(partial)


class SwallowsInterrupts:
    """Garbage (a reference cycle) whose finalizer runs for FINALIZER_S and swallows any exception in it, as some
    libraries' finalizers do with a bare `except`."""

    def __init__(self):
        self.cycle = self

    def __del__(self):
        end = time.monotonic() + FINALIZER_S
        try:
            while time.monotonic() < end:
                pass
        except BaseException:
            pass


FINALIZER_S = 0.05  # longer than interrupt.RETRY_S: the interrupt raised again lands inside the finalizer


@pytest.mark.parametrize("swallowing_finalizers", [0, 3], ids=["plain_collection", "finalizers_swallow_it"])
def test_sigint_inside_a_gc_callback_interrupts_the_code_after_it(monkeypatch, swallowing_finalizers):
    from index_builder.interrupt import sigint_interrupts  # here: the process tests above run on any version

    printed = []  # what Python would print as "Exception ignored in: ..."
    monkeypatch.setattr(sys, "unraisablehook", printed.append)
    calls = []

    def send_sigint_once(phase, info):  # os.kill runs the handler at once, inside this callback
        if phase == "start" and not calls:
            calls.append(phase)
            os.kill(os.getpid(), signal.SIGINT)

    for _ in range(swallowing_finalizers):
        SwallowsInterrupts()
    gc.callbacks.append(send_sigint_once)
    deadline = time.monotonic() + EXIT_WITHIN_S
    try:
        with pytest.raises(KeyboardInterrupt), sigint_interrupts():
            gc.collect()
            while time.monotonic() < deadline:  # the interrupt lands here, after the callback returned
                pass
    finally:
        gc.callbacks.remove(send_sigint_once)
    assert calls == ["start"] and time.monotonic() < deadline and printed == []


def test_a_second_build_on_the_same_out_is_refused_naming_the_first(corpus, tmp_path):
    out = str(tmp_path / "index")
    first = start_build([corpus, "--to", "bm25", "--out", out], sigint_ignored=False)
    wait_for_file(first, os.path.join(out + ".partial", "docs.jsonl"))  # the first build holds OUT.lease
    second = subprocess.run([sys.executable, "-m", "index_builder", corpus, "--to", "bm25", "--out", out,
                             "--no-progress"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert second.returncode == 2
    assert second.stderr.startswith(f"error: --out {out} is in use by pid {first.pid} on host ")
    assert len(second.stderr.splitlines()) == 1 and f"(lease file {out}.lease)" in second.stderr
    assert interrupt(first)[0] == 130
    assert not os.path.exists(out + ".lease")  # released by the interrupted build
