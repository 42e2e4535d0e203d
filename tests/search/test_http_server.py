"""Search-R1 API: our server (a real subprocess) answers in the protocol's exact JSON shape; our http client reads
it; bad requests, backend failures, a server that never answers, and start-up checks."""
import asyncio
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from aiohttp import web

from llds_jax.search import Document, Retriever, RetrieverUnavailableError, SearchResult, make_retriever
from llds_jax.search.bm25 import Bm25Retriever
from llds_jax.search.http import HttpRetriever, ResponseShapeError, parse_response
from llds_jax.search.retry import RequestPolicy
from llds_jax.search.server import build_app


@pytest.fixture(scope="module")
def expected(bm25_index, small_corpus):
    """(queries, results) straight from the index in this process: what the server must return."""
    corpus = small_corpus[1]
    queries = [p.query for p in corpus.planted[:4]] + corpus.random_queries(4, seed=21) + ["the of and"]
    return queries, Bm25Retriever(bm25_index).search_blocking(queries, 3)


def test_raw_json_with_scores_is_the_protocol_shape(search_server, post_json, expected):
    queries, results = expected
    status, body = post_json(f"{search_server}/retrieve", {"queries": queries, "topk": 3, "return_scores": True})
    assert status == 200
    assert body == {"result": [[{"document": {"id": d.id, "contents": d.contents}, "score": d.score}
                                for d in r.docs] for r in results]}
    assert list(body) == ["result"] and len(body["result"]) == len(queries)
    first = body["result"][0][0]
    assert list(first) == ["document", "score"] and list(first["document"]) == ["id", "contents"]
    assert isinstance(first["document"]["id"], str) and isinstance(first["score"], float)
    assert body["result"][-1] == []  # a query of stopwords only matches nothing


def test_raw_json_without_scores_has_bare_documents(search_server, post_json, expected):
    queries, results = expected
    status, body = post_json(f"{search_server}/retrieve", {"queries": queries, "topk": 3, "return_scores": False})
    assert status == 200
    assert body == {"result": [[{"id": d.id, "contents": d.contents} for d in r.docs] for r in results]}
    # Search-R1's defaults: no scores, and topk from the server's --topk (3).
    assert post_json(f"{search_server}/retrieve", {"queries": queries[:2]}) == (200, {"result": body["result"][:2]})


def test_http_client_against_our_server(search_server, expected):
    queries, results = expected

    async def run():
        retriever = make_retriever({"backend": "http", "url": f"{search_server}/retrieve", "batch_size": 2,
                                    "max_concurrency": 3})
        try:
            await retriever.check()
            one_batch = await retriever.search(queries, 3)
            concurrent = await asyncio.gather(*(retriever.search([q], 3) for q in queries * 3))
            return one_batch, [r for batch in concurrent for r in batch]
        finally:
            await retriever.close()

    one_batch, concurrent = asyncio.run(run())
    assert one_batch == results
    assert concurrent == results * 3


@pytest.mark.parametrize("body, message", [
    ({"queries": "one query"}, '"queries" must be a list of strings'),
    ({"queries": ["q"], "topk": 0}, '"topk" must be an integer >= 1, got 0'),
    ({"queries": ["q"], "return_scores": "yes"}, '"return_scores" must be true or false'),
    ([1, 2], "the body must be a JSON object"),
])
def test_bad_requests_get_400_with_the_reason(search_server, post_json, body, message):
    status, answer = post_json(f"{search_server}/retrieve", body)
    assert status == 400 and answer["error"].startswith(message)


def test_invalid_json_gets_400(search_server):
    request = urllib.request.Request(f"{search_server}/retrieve", data=b'{"queries": [', method="POST")
    with pytest.raises(urllib.error.HTTPError) as error:
        urllib.request.urlopen(request, timeout=10)
    assert (error.value.code, json.loads(error.value.read())) == (400, {"error": "the body is not valid JSON"})


def test_health(search_server):
    with urllib.request.urlopen(f"{search_server}/health", timeout=10) as response:
        assert (response.status, json.loads(response.read())) == (
            200, {"status": "ok", "backend": "bm25", "slow_clients_dropped": 0})


class FailingRetriever(Retriever):
    """A backend whose searches fail, to see the server's answer."""

    backend = "failing"

    async def search(self, queries, k):
        return [SearchResult([Document("1", '"T"\nx', 1.0)]), SearchResult([], "backend X at host:1: down")]

    async def check(self):
        raise RetrieverUnavailableError("backend X at host:1: down")

    async def close(self):
        pass


def test_backend_failure_is_a_503_naming_the_backend(post_json, free_port):
    port = free_port()

    async def run():
        runner = web.AppRunner(build_app(FailingRetriever()))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            retrieve = await asyncio.to_thread(post_json, f"http://127.0.0.1:{port}/retrieve", {"queries": ["a", "b"]})
            client = HttpRetriever(f"http://127.0.0.1:{port}/retrieve", policy=RequestPolicy(max_retries=0))
            via_client = await client.search(["a", "b"], 3)
            await client.close()
            return retrieve, via_client
        finally:
            await runner.cleanup()

    retrieve, via_client = asyncio.run(run())
    assert retrieve == (503, {"error": "1 of 2 queries failed: backend X at host:1: down"})
    assert [r.docs for r in via_client] == [[], []]
    assert via_client[0].error == (f"http backend at http://127.0.0.1:{port}/retrieve: gave up after 1 attempt,"
                                   " last error: HttpStatusError: HTTP 503: "
                                   '{"error": "1 of 2 queries failed: backend X at host:1: down"}')


def test_server_that_never_answers_times_out_then_recovers(silent_server, search_server_factory, bm25_index,
                                                           expected):
    queries, results = expected
    policy = RequestPolicy(timeout_s=0.5, max_retries=1, backoff_s=0.1)
    url = f"http://127.0.0.1:{silent_server.port}/retrieve"

    async def run():
        retriever = HttpRetriever(url, policy=policy)
        try:
            started = time.monotonic()
            hung = await retriever.search(queries[:2], 3)
            elapsed = time.monotonic() - started
            with pytest.raises(RetrieverUnavailableError, match=f"http backend at {url}: no answer within 0.5 s"):
                await retriever.check()
            silent_server.stop()
            await asyncio.to_thread(search_server_factory, silent_server.port, "backend=bm25",
                                    f"index_dir={bm25_index}")
            return hung, elapsed, await retriever.search(queries[:2], 3)
        finally:
            await retriever.close()

    hung, elapsed, recovered = asyncio.run(run())
    assert 2 * policy.timeout_s <= elapsed <= policy.worst_case_s + 1.0
    assert [r.docs for r in hung] == [[], []]
    assert hung[0].error == (f"http backend at {url}: gave up after 2 attempts,"
                             " last error: TimeoutError: no answer within 0.5 s")
    assert recovered == results[:2]


def test_server_refuses_to_start_when_its_backend_is_unavailable(free_port):
    dead = f"http://127.0.0.1:{free_port()}/retrieve"
    done = subprocess.run([sys.executable, "-m", "llds_jax.search.server", "--port", str(free_port()),
                           "--set", "backend=http", "--set", f"url={dead}"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.startswith(f"python -m llds_jax.search.server: error: http backend at {dead} cannot serve"
                                  " searches: ClientConnectorError")
    assert done.stderr.count("\n") == 1, done.stderr


@pytest.mark.parametrize("payload, message", [
    ([], 'expected {"result": [...]}, got []'),
    ({"result": [[]]}, "1 result lists for 2 queries"),
    ({"result": [[{"id": "1", "contents": "x"}], []]}, "result item without document id/contents or score: "
                                                       "KeyError: 'document'"),
])
def test_client_rejects_answers_not_in_the_protocol_shape(payload, message):
    with pytest.raises(ResponseShapeError) as error:
        parse_response(payload, 2)
    assert str(error.value) == message
    assert parse_response({"result": [[{"document": {"id": 5, "contents": "c"}, "score": 1}], []]}, 2) == [
        SearchResult([Document("5", "c", 1.0)]), SearchResult([])]
