"""The retrieval server's limits (a real server process on loopback): top-k, queries per request, request and
response bytes, each refused with a JSON error naming the flag, its value and what the request had; the server
keeps serving. A request at the default limits (4096 queries x top 100) is refused before any search when its answer
could pass --max-response-bytes, and served in bounded memory when it cannot (RSS <= 150 MB over idle). A body
nesting JSON too deeply is a 400. Start-up failures (missing index, an empty e5 index, address in use) are one line
on stderr and exit status 2."""
import asyncio
import http.client
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import faiss
import pytest
from aiohttp import web

from index_builder.__main__ import main as index_builder_main
from llds_jax.errors import InputError
from llds_jax.search import Document, Retriever, SearchResult, make_retriever
from llds_jax.search.docstore import DOCS_FILE, DocStore, DocStoreWriter
from llds_jax.search.server import Limits, build_app
from llds_jax.search.synthetic import SyntheticCorpus, write_random_bert
from tests.servers import free_port, http_ok, wait_until

PROG = "python -m llds_jax.search.server"
LIMITS = {"--max-topk": 5, "--max-queries": 4, "--max-request-bytes": 2000, "--max-response-bytes": 3000}
EMPTY_RESULT = len('{"result": []}')
RECORD_BYTES = 150  # every document of `wide_index`: len('{"id": "0042", "contents": "..."}')
RSS_GROWTH_LIMIT_KB = 150 * 1000  # 150 MB over idle


@pytest.fixture(scope="module")
def corpus_index(tmp_path_factory):
    """(corpus, index folder): 80 generated passages of 20-40 words in an embedded BM25 index."""
    corpus = SyntheticCorpus(80, seed=3, n_planted=4, vocab_size=800, words_per_doc=(20, 40))
    path = corpus.write(str(tmp_path_factory.mktemp("corpus") / "corpus.jsonl"))
    index = str(tmp_path_factory.mktemp("bm25") / "index")
    assert index_builder_main([path, "--to", "bm25", "--out", index, "--no-progress"]) == 0
    return corpus, index


@pytest.fixture(scope="module")
def wide_index(tmp_path_factory):
    """An embedded BM25 index of 400 documents whose records all take RECORD_BYTES bytes, every one holding the
    word "alpha" (so a search for it fills any top 100): at the default limits, 4096 queries x top 100 fit 64 MiB
    without scores (62,267,404 bytes at most) and do not with them (82,337,804)."""
    path = tmp_path_factory.mktemp("wide") / "corpus.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for i in range(400):
            record = {"id": f"{i:04d}", "contents": f'"Doc {i}"\nalpha word{i % 37} word{i % 11} '}
            record["contents"] += "x" * (RECORD_BYTES - len(json.dumps(record, ensure_ascii=False)))
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    index = str(tmp_path_factory.mktemp("wide_bm25") / "index")
    assert index_builder_main([str(path), "--to", "bm25", "--out", index, "--no-progress"]) == 0
    return index


def server_command(port, index, *flags):
    return [sys.executable, "-m", "llds_jax.search.server", "--port", str(port), "--set", "backend=bm25",
            "--set", f"index_dir={index}", *flags]


def start_server(index, *flags):
    """(process, base URL) of a server over `index` started with `flags`, once it answers /health."""
    port = free_port()
    process = subprocess.Popen(server_command(port, index, *flags), stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"

    def ready():
        if process.poll() is not None:
            pytest.fail(f"search server exited with {process.returncode}: {process.stderr.read()}")
        return http_ok(f"{url}/health")

    wait_until(ready, 60, "llds_jax.search.server")
    return process, url


@pytest.fixture(scope="module")
def server(corpus_index):
    """Base URL of a server over `corpus_index` started with LIMITS."""
    process, url = start_server(corpus_index[1], *(str(x) for item in LIMITS.items() for x in item))
    yield url
    process.terminate()
    process.wait(10)


@pytest.fixture(scope="module")
def default_server(wide_index):
    """(process, base URL) of a server over `wide_index` with the default limits."""
    process, url = start_server(wide_index)
    yield process, url
    process.terminate()
    process.wait(10)


def post(url, data: bytes, chunked=False, timeout=30):
    """(status, raw body) of a POST of `data` to url/retrieve (chunked: without a Content-Length)."""
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=timeout)
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


def longest_record(index):
    """Bytes of the longest `{"id": ..., "contents": ...}` line of an index folder's document store."""
    with open(os.path.join(index, DOCS_FILE), "rb") as f:
        return max(len(line) - 1 for line in f)


def test_response_that_could_pass_max_response_bytes_gets_400_before_searching(server, corpus_index):
    longest = longest_record(corpus_index[1])
    queries = [p.query for p in corpus_index[0].planted[:4]]
    # '{"result": [' + 4 lists of 5 items, ", " between lists and items + ']}'
    bound = 12 + 4 * (2 + 5 * longest + 2 * 4) + 2 * 3 + 2
    assert bound > 3000
    assert post_json(server, {"queries": queries, "topk": 5}) == (400, {"error": (
        f"the response could pass 3000 bytes (--max-response-bytes): up to {bound} bytes for 4 queries x topk 5"
        f' (the longest document takes {longest} bytes); ask for fewer queries or a smaller "topk"')})
    status, answer = post_json(server, {"queries": queries[:1], "topk": 5})  # its bound fits: served
    assert status == 200 and len(answer["result"][0]) == 5
    with urllib.request.urlopen(f"{server}/health", timeout=10) as response:
        assert response.status == 200


class FixedRetriever(Retriever):
    """A backend that gives every query the same `docs` and cannot bound a document's size in advance."""

    backend = "fixed"

    def __init__(self, docs):
        self.docs = docs

    async def search(self, queries, k):
        return [SearchResult(self.docs[:k]) for _ in queries]

    async def check(self):
        pass

    async def close(self):
        pass


def serve_in_process(app, requests):
    """The (status, JSON body) answers of `app` on a free loopback port to `requests`, JSON bodies sent in order."""
    port = free_port()

    async def run():
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            return [await asyncio.to_thread(post_json, f"http://127.0.0.1:{port}", body) for body in requests]
        finally:
            await runner.cleanup()

    return asyncio.run(run())


def test_without_a_bound_the_response_is_refused_as_soon_as_it_passes_max_response_bytes():
    docs = [Document(str(i), f'"T{i}"\nthé text {i}', 1.5) for i in range(3)]
    one_list = len(json.dumps([{"id": d.id, "contents": d.contents} for d in docs], ensure_ascii=False).encode())
    limits = Limits(max_response_bytes=EMPTY_RESULT + 2 * one_list + 2)  # two lists fit exactly
    app = build_app(FixedRetriever(docs), limits=limits)
    answers = serve_in_process(app, [{"queries": ["a", "b"]}, {"queries": ["a", "b", "c"]}])
    assert answers[0] == (200, {"result": [[{"id": d.id, "contents": d.contents} for d in docs]] * 2})
    size = EMPTY_RESULT + 3 * one_list + 4
    assert answers[1] == (400, {"error": (
        f"the response would pass {limits.max_response_bytes} bytes (--max-response-bytes): {size} bytes after 3 of"
        ' 3 queries; ask for fewer queries or a smaller "topk"')})


def test_max_record_bytes_bounds_every_record_of_a_corpus_and_is_exact_for_an_index(tmp_path):
    records = [{"id": "1", "contents": '"Café"\nnaïve 東京 😀 \\ "q" \t'}, {"id": "22", "contents": "x" * 40}]
    writer = DocStoreWriter(str(tmp_path))
    for record in records:
        writer.add(record["id"], record["contents"])
    writer.close()
    encoded = [len(json.dumps(r, ensure_ascii=False).encode()) for r in records]
    assert DocStore(str(tmp_path)).max_record_bytes == max(encoded)
    # Corpus lines as other tools write them: ASCII escapes, compact separators, integer ids, other fields.
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"id": 1, "contents": records[0]["contents"]}, separators=(",", ":")) + "\n"
                      + '{"id":22,"contents":"' + "x" * 40 + '"}' + "\n"
                      + json.dumps({"id": "3", "title": "t", "contents": "\ud800 lone"}) + "\n")
    store = DocStore.of_corpus(str(corpus))
    # Each document as the server encodes it: UTF-8, a lone surrogate as its \\u escape.
    sizes = [len(json.dumps(dict(zip(("id", "contents"), store.get(i))), ensure_ascii=False)
                 .encode("utf-8", "backslashreplace")) for i in range(len(store))]
    assert sizes[:2] == encoded and store.max_record_bytes >= max(sizes)
    longest_line = max(len(line) for line in corpus.read_bytes().splitlines(keepends=True))
    assert store.max_record_bytes == longest_line + 5


@pytest.mark.parametrize("opening, middle, closing", [(b"[", b"", b"]"), (b'{"a":', b"1", b"}")],
                         ids=["arrays", "objects"])
def test_deeply_nested_json_gets_400_and_the_server_goes_on(default_server, opening, middle, closing):
    url = default_server[1]
    nested = opening * 100_000 + middle + closing * 100_000  # 100,000 levels
    assert len(nested) <= Limits().max_request_bytes
    status, raw = post(url, nested)
    assert (status, json.loads(raw)) == (400, {"error": "the body nests JSON arrays or objects too deeply to parse"})
    status, answer = post_json(url, {"queries": ["alpha"], "topk": 2})
    assert status == 200 and len(answer["result"][0]) == 2


def status_kb(pid, field):
    """A "kB" field of /proc/PID/status (VmRSS: resident now, VmHWM: its peak)."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(f"{field}:"))


def idle_rss_kb(pid):
    """The resident size of the idle process `pid`, after resetting its peak (VmHWM) to it."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")
    return status_kb(pid, "VmRSS")


def test_4096_queries_top_100_past_max_response_bytes_are_refused_before_searching(default_server):
    process, url = default_server
    post_json(url, {"queries": ["alpha"] * 8, "topk": 100})  # warm: threads, accumulators, the bound
    idle = idle_rss_kb(process.pid)
    body = {"queries": ["alpha"] * 4096, "topk": 100, "return_scores": True}
    assert post_json(url, body) == (400, {"error": (
        "the response could pass 67108864 bytes (--max-response-bytes): up to 82337804 bytes for 4096 queries x"
        f' topk 100 (the longest document takes {RECORD_BYTES} bytes); ask for fewer queries or a smaller "topk"')})
    assert status_kb(process.pid, "VmHWM") - idle <= RSS_GROWTH_LIMIT_KB


@pytest.mark.slow  # 409,600 documents searched, encoded and sent: ~5 s
def test_4096_queries_top_100_within_max_response_bytes_are_served_in_bounded_memory(default_server):
    process, url = default_server
    post_json(url, {"queries": ["alpha"] * 8, "topk": 100})
    idle = idle_rss_kb(process.pid)
    status, raw = post(url, json.dumps({"queries": ["alpha"] * 4096, "topk": 100}).encode(), timeout=120)
    grown = status_kb(process.pid, "VmHWM") - idle
    # '{"result": [' + 4096 lists of 100 records, ", " between lists and items + ']}'
    assert status == 200 and len(raw) == 12 + 4096 * (2 + 100 * RECORD_BYTES + 2 * 99) + 2 * 4095 + 2 == 62_267_404
    assert raw.count(b'{"id": "') == 4096 * 100
    assert grown <= RSS_GROWTH_LIMIT_KB, f"RSS grew {grown} kB over idle"


def test_missing_index_is_one_line_and_exit_2(tmp_path):
    missing = str(tmp_path / "no_index")
    done = subprocess.run(server_command(free_port(), missing), capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stderr) == (2, f"{PROG}: error: {missing}: not an embedded BM25 index folder"
                                                 " (llds_index.json missing; build one with"
                                                 " `python -m index_builder --to bm25 ...`)\n")


@pytest.fixture(scope="module")
def empty_e5_index(tmp_path_factory):
    """(faiss file, corpus, encoder folder): a Flat inner-product index of no vectors as faiss writes it, beside a
    corpus of one passage, and a tiny random e5 encoder of the index's 32 dimensions."""
    folder = tmp_path_factory.mktemp("empty_e5")
    index, corpus = str(folder / "e5_Flat.index"), folder / "corpus.jsonl"
    faiss.write_index(faiss.IndexFlatIP(32), index)
    corpus.write_text(json.dumps({"id": "0", "contents": "a passage"}) + "\n")
    return index, str(corpus), write_random_bert(str(folder / "e5"), hidden_size=32)


EMPTY_INDEX = ("faiss index {} (retriever.index_path) is empty: it holds no vectors, so a search would find nothing; "
               "build it over a corpus with passages")


@pytest.mark.parametrize("backend", ["faiss", "e5_device"])
def test_an_empty_e5_index_is_refused_at_construction_naming_the_file(empty_e5_index, backend):
    """Issue 66: the retriever was built, its searches returned empty lists and its check then failed with
    "OSError: [Errno 22] Invalid argument"."""
    index, corpus, encoder = empty_e5_index
    with pytest.raises(InputError) as refused:
        make_retriever({"backend": backend, "index_path": index, "corpus_path": corpus, "encoder_path": encoder,
                        "max_length": 64})
    assert str(refused.value) == EMPTY_INDEX.format(index)


def test_a_server_over_an_empty_e5_index_is_one_line_and_exit_2(empty_e5_index):
    """Before: "... cannot serve searches: OSError: [Errno 22] Invalid argument", after loading the encoder."""
    index, corpus, encoder = empty_e5_index
    command = [sys.executable, "-m", "llds_jax.search.server", "--port", str(free_port()), "--set", "backend=faiss",
               "--set", f"index_path={index}", "--set", f"corpus_path={corpus}", "--set", f"encoder_path={encoder}",
               "--set", "max_length=64"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    errors = [line for line in done.stderr.splitlines() if line.startswith(PROG)]  # faiss logs its loading before
    assert (done.returncode, errors) == (2, [f"{PROG}: error: {EMPTY_INDEX.format(index)}"]), done.stderr
    assert "Traceback" not in done.stderr


def test_port_in_use_is_one_line_and_exit_2(corpus_index):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(server_command(port, corpus_index[1]), capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stderr) == (
        2, f"{PROG}: error: cannot listen on 127.0.0.1:{port}: Address already in use\n")


# ----- slow and vanishing clients (issue 58 item 13) ------------------------------------------------------------------
# Before: no deadline for headers or bodies (500 slow connections still open after 64 s, 10,126 held for 40 s), and
# a client gone mid-body logged a 29-line traceback.
SLOW = ("--header-timeout-s", "1", "--body-timeout-s", "1")
PARTIAL_HEADERS = b"POST /retrieve HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def closed_by_server(sock: socket.socket) -> bytes:
    """What the server sent before it closed the connection (a 10 s socket timeout fails the test)."""
    received = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return received
        if not chunk:
            return received
        received += chunk


def health(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/health", timeout=10) as response:
        return json.loads(response.read())


def test_connections_that_never_finish_their_headers_are_dropped_and_counted_in_few_lines(corpus_index):
    """Issue 66: each drop was one warning line (3,500 lines for 3,500 clients). The first drop after a quiet spell
    is one line naming the client, the others one summary line per --slow-client-summary-s that had any."""
    process, url = start_server(corpus_index[1], *SLOW, "--slow-client-summary-s", "2")
    try:
        silent, partial = [connect(url) for _ in range(20)], [connect(url) for _ in range(20)]
        for sock in partial:
            sock.sendall(PARTIAL_HEADERS)
        started = time.monotonic()
        assert all(closed_by_server(sock) == b"" for sock in silent + partial)
        assert time.monotonic() - started < 5
        assert health(url)["slow_clients_dropped"] == 40
        assert post(url, json.dumps({"queries": ["alpha"], "topk": 1}).encode())[0] == 200  # still serving
        time.sleep(max(0.0, started + 5.5 - time.monotonic()))  # the summary at ~2 s, then a quiet 2 s
        assert closed_by_server(connect(url)) == b""  # after the quiet spell: one line of its own again
        assert health(url)["slow_clients_dropped"] == 41
    finally:
        process.terminate()
        _, err = process.communicate(timeout=10)
    lines = [line.split(" WARNING __main__: ", 1)[1] for line in err.splitlines() if "slow client" in line]
    reason = "no complete request headers within 1 s (--header-timeout-s)"
    first = rf"dropped a slow client 127\.0\.0\.1:\d+: {re.escape(reason)}; {{}} slow client\(s\) dropped so far " \
            r"\(more within 2 s are summed up in one line\)"
    assert len(lines) == 3, err
    assert re.fullmatch(first.format(1), lines[0]), lines[0]
    assert lines[1] == f"dropped 39 more slow client(s) in 2 s (39 x {reason}); 40 slow client(s) dropped so far"
    assert re.fullmatch(first.format(41), lines[2]), lines[2]
    assert "Traceback" not in err


def test_a_body_that_does_not_arrive_gets_408_and_a_vanishing_client_one_line(corpus_index):
    process, url = start_server(corpus_index[1], *SLOW)
    try:
        slow = connect(url)
        slow.sendall(PARTIAL_HEADERS + b"Content-Length: 100\r\n\r\n" + b'{"queries": ')
        answer = closed_by_server(slow)
        assert answer.startswith(b"HTTP/1.1 408 ")
        assert answer.endswith(b'{"error": "the body did not arrive within 1 s (--body-timeout-s)"}')
        gone = connect(url)
        gone.sendall(PARTIAL_HEADERS + b"Content-Length: 1000\r\n\r\n" + b'{"queries": ')
        time.sleep(0.3)
        gone.close()
        time.sleep(0.5)
        assert health(url)["slow_clients_dropped"] == 1
    finally:
        process.terminate()
        _, err = process.communicate(timeout=10)
    assert "Traceback" not in err
    gone_lines = [line for line in err.splitlines() if "closed its connection before its body was in" in line]
    assert len(gone_lines) == 1, err
