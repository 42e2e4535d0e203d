"""Fixtures of the retrieval tests: small generated corpora and indexes (the Elasticsearch server `es_url` is in
tests/conftest.py), noida-db servers of one test, our retrieval server as a subprocess, and a server that never
answers."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import urllib.error
import urllib.request
import uuid

import pytest

from index_builder.__main__ import main as index_builder_main
from llds_jax.search.synthetic import SyntheticCorpus
from tests.servers import NoidaServer, delete_es_index, free_port, http_ok, wait_until

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def noida_factory(tmp_path):
    """Starts NoidaServer(s) for one test (own data dir, given or free port); stops them all afterwards."""
    servers = []

    def start(port: int | None = None) -> NoidaServer:
        server = NoidaServer(str(tmp_path / f"noida{len(servers)}"), port or free_port())
        servers.append(server)
        return server.start()

    yield start
    for server in servers:
        server.stop()


class SilentServer:
    """A TCP server on loopback that accepts connections, reads what is sent, and never answers."""

    def __init__(self, port: int | None = None):
        self.port = port or free_port()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._swallow, "127.0.0.1", self.port), self._loop).result(5)

    @staticmethod
    async def _swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await reader.read(65536):
            pass
        writer.close()

    def stop(self) -> None:
        """Closes the listener and every held connection; the port is free afterwards."""

        async def shutdown():
            self._server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


    @property
    def running(self) -> bool:
        return self._thread.is_alive()


@pytest.fixture
def silent_server():
    """A SilentServer on a free port, stopped after the test if the test did not stop it."""
    server = SilentServer()
    yield server
    if server.running:
        server.stop()


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory):
    """(path, corpus): 300 generated passages of 20-40 words with 8 planted answers, as plain JSON lines."""
    corpus = SyntheticCorpus(300, seed=7, n_planted=8, vocab_size=3000, words_per_doc=(20, 40))
    return corpus.write(str(tmp_path_factory.mktemp("corpus") / "corpus.jsonl")), corpus


def build_bm25_index(corpus_path: str, out_dir: str, *extra: str) -> str:
    """Builds an embedded index with the index_builder CLI entry point (in process); returns `out_dir`."""
    status = index_builder_main([corpus_path, "--to", "bm25", "--out", out_dir, "--no-progress", *extra])
    assert status == 0
    return out_dir


@pytest.fixture(scope="session")
def bm25_index(small_corpus, tmp_path_factory):
    """Embedded index folder of `small_corpus`, built in chunks of 64 documents."""
    return build_bm25_index(small_corpus[0], str(tmp_path_factory.mktemp("bm25") / "index"), "--chunk-docs", "64")


@pytest.fixture(scope="session")
def es_index(es_url, small_corpus):
    """Name of an index holding `small_corpus`, built with the index_builder CLI; deleted at the end."""
    name = f"llds-test-{uuid.uuid4().hex[:8]}"
    status = index_builder_main([small_corpus[0], "--to", "elasticsearch", "--es-hosts", es_url, "--es-index", name,
                                 "--bulk-docs", "100", "--no-progress"])
    assert status == 0
    yield name
    delete_es_index(es_url, name)


@pytest.fixture
def fresh_es_index(es_url):
    """A new index name on `es_url`; the index is deleted after the test."""
    name = f"llds-test-{uuid.uuid4().hex[:8]}"
    yield name
    delete_es_index(es_url, name)


def start_search_server(port: int, *settings: str) -> subprocess.Popen:
    """`python -m llds_jax.search.server --set ...` on loopback `port`; waits until /health answers 200."""
    args = [sys.executable, "-m", "llds_jax.search.server", "--host", "127.0.0.1", "--port", str(port)]
    for setting in settings:
        args += ["--set", setting]
    process = subprocess.Popen(args, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def ready() -> bool:
        if process.poll() is not None:
            pytest.fail(f"search server exited with {process.returncode}: {process.stdout.read()}")
        return http_ok(f"http://127.0.0.1:{port}/health")

    wait_until(ready, 60, "llds_jax.search.server")
    return process


def stop_process(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)


@pytest.fixture(scope="session")
def search_server(bm25_index):
    """Base URL of our retrieval server (bm25 backend over `bm25_index`) running as a subprocess."""
    port = free_port()
    process = start_search_server(port, "backend=bm25", f"index_dir={bm25_index}")
    yield f"http://127.0.0.1:{port}"
    stop_process(process)


@pytest.fixture
def search_server_factory():
    """start(port, *settings) -> base URL of a search server subprocess; all are stopped after the test."""
    processes = []

    def start(port: int, *settings: str) -> str:
        processes.append(start_search_server(port, *settings))
        return f"http://127.0.0.1:{port}"

    yield start
    for process in processes:
        stop_process(process)


@pytest.fixture(name="build_bm25_index")
def build_bm25_index_fixture():
    """The `build_bm25_index(corpus_path, out_dir, *cli_args) -> out_dir` function."""
    return build_bm25_index


@pytest.fixture(name="free_port")
def free_port_fixture():
    """The `free_port()` function."""
    return free_port


@pytest.fixture(name="post_json")
def post_json_fixture():
    """The `post_json(url, body) -> (status, JSON)` function."""
    return post_json


def post_json(url: str, body: object, timeout_s: float = 30) -> tuple[int, object]:
    """(status, parsed JSON body) of a plain HTTP POST."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="session")
def e5_folder(tmp_path_factory):
    """A tiny random BERT folder in e5's layout (hidden 32, 2 layers, 4 heads, 128 positions, WordPiece vocab)."""
    from llds_jax.search.synthetic import write_random_bert

    return write_random_bert(str(tmp_path_factory.mktemp("e5") / "tiny_e5"))
