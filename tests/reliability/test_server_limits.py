"""The retrieval server's limits (a real server process on loopback): top-k, queries per request, request and
response bytes, each refused with a JSON error naming the flag, its value and what the request had; the server
keeps serving. Start-up failures (missing index, address in use) are one line on stderr and exit status 2."""
import http.client
import json
import socket
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from index_builder.__main__ import main as index_builder_main
from llds_jax.search.synthetic import SyntheticCorpus
from tests.servers import free_port, http_ok, wait_until

PROG = "python -m llds_jax.search.server"
LIMITS = {"--max-topk": 5, "--max-queries": 4, "--max-request-bytes": 2000, "--max-response-bytes": 3000}
EMPTY_RESULT = len('{"result": []}')


@pytest.fixture(scope="module")
def corpus_index(tmp_path_factory):
    """(corpus, index folder): 80 generated passages of 20-40 words in an embedded BM25 index."""
    corpus = SyntheticCorpus(80, seed=3, n_planted=4, vocab_size=800, words_per_doc=(20, 40))
    path = corpus.write(str(tmp_path_factory.mktemp("corpus") / "corpus.jsonl"))
    index = str(tmp_path_factory.mktemp("bm25") / "index")
    assert index_builder_main([path, "--to", "bm25", "--out", index, "--no-progress"]) == 0
    return corpus, index


def server_command(port, index, *flags):
    return [sys.executable, "-m", "llds_jax.search.server", "--port", str(port), "--set", "backend=bm25",
            "--set", f"index_dir={index}", *flags]


@pytest.fixture(scope="module")
def server(corpus_index):
    """Base URL of a server over `corpus_index` started with LIMITS."""
    port = free_port()
    flags = [str(x) for item in LIMITS.items() for x in item]
    process = subprocess.Popen(server_command(port, corpus_index[1], *flags), stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"

    def ready():
        if process.poll() is not None:
            pytest.fail(f"search server exited with {process.returncode}: {process.stderr.read()}")
        return http_ok(f"{url}/health")

    wait_until(ready, 60, "llds_jax.search.server")
    yield url
    process.terminate()
    process.wait(10)


def post(url, data: bytes, chunked=False):
    """(status, raw body) of a POST of `data` to url/retrieve (chunked: without a Content-Length)."""
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        body = iter([data[:len(data) // 2], data[len(data) // 2:]]) if chunked else data
        connection.request("POST", "/retrieve", body=body, headers={"Content-Type": "application/json"},
                           encode_chunked=chunked)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def post_json(url, body, chunked=False):
    status, raw = post(url, json.dumps(body).encode(), chunked)
    return status, json.loads(raw)


@pytest.mark.parametrize("body, message", [
    ({"queries": ["q"] * 10, "topk": 1_000_000_000},
     '"queries" must hold at most 4 queries (--max-queries), got 10'),
    ({"queries": ["q"], "topk": 1_000_000_000}, '"topk" must be at most 5 (--max-topk), got 1000000000'),
    ({"queries": ["q"] * 5}, '"queries" must hold at most 4 queries (--max-queries), got 5'),
    ({"queries": ["q"], "topk": 6}, '"topk" must be at most 5 (--max-topk), got 6'),
])
def test_topk_and_query_count_past_the_limit_get_400(server, body, message):
    assert post_json(server, body) == (400, {"error": message})
    status, answer = post_json(server, {"queries": ["q"] * 4, "topk": 1})  # at the limits: served
    assert status == 200 and len(answer["result"]) == 4


@pytest.mark.parametrize("chunked, got", [(False, "2001"), (True, "more")])
def test_body_past_max_request_bytes_gets_413(server, chunked, got):
    body = {"queries": ["x" * 1984]}
    assert len(json.dumps(body)) == 2001
    assert post_json(server, body, chunked) == (
        413, {"error": f"the body must be at most 2000 bytes (--max-request-bytes), got {got}"})
    status, _ = post_json(server, {"queries": ["x" * 1983]}, chunked)  # 2000 bytes: served
    assert status == 200


def test_response_past_max_response_bytes_gets_400(server, corpus_index):
    corpus = corpus_index[0]
    queries = [p.query for p in corpus.planted[:4]]
    # Each query's result list alone, as the server encodes it (its answer without the envelope).
    sizes = []
    for query in queries:
        status, raw = post(server, json.dumps({"queries": [query], "topk": 5}).encode())
        assert status == 200 and len(raw) <= LIMITS["--max-response-bytes"]
        sizes.append(len(raw) - EMPTY_RESULT)
    total, answered = EMPTY_RESULT, 0
    while total <= 3000:
        total += sizes[answered] + (2 if answered else 0)  # ", " between lists
        answered += 1
    assert post_json(server, {"queries": queries, "topk": 5}) == (400, {"error": (
        f"the response would pass 3000 bytes (--max-response-bytes): {total} bytes after {answered} of 4 queries;"
        ' ask for fewer queries or a smaller "topk"')})
    with urllib.request.urlopen(f"{server}/health", timeout=10) as response:
        assert response.status == 200


def test_missing_index_is_one_line_and_exit_2(tmp_path):
    missing = str(tmp_path / "no_index")
    done = subprocess.run(server_command(free_port(), missing), capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stderr) == (2, f"{PROG}: error: {missing}: not an embedded BM25 index folder"
                                                 " (llds_index.json missing; build one with"
                                                 " `python -m index_builder --to bm25 ...`)\n")


def test_port_in_use_is_one_line_and_exit_2(corpus_index):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(server_command(port, corpus_index[1]), capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stderr) == (
        2, f"{PROG}: error: cannot listen on 127.0.0.1:{port}: Address already in use\n")
