"""The Elasticsearch backend against noida-db (or the cluster at env LLDS_ES_URL): retrieval, index settings,
credentials, health check, and faults (server stopped mid-run, server that never answers, recovery)."""
import asyncio
import time

import pytest
from aiohttp import web
from elasticsearch import Elasticsearch

from index_builder.__main__ import main as index_builder_main
from llds_jax.search import RetrieverUnavailableError, make_retriever
from llds_jax.search.elastic import ElasticsearchRetriever, auth_from_env, hosts_for_display
from llds_jax.search.retry import RequestPolicy
from llds_jax.search.synthetic import SyntheticCorpus

FAST_FAIL = RequestPolicy(timeout_s=0.5, max_retries=1, backoff_s=0.1, max_concurrency=2)


@pytest.fixture(scope="module")
def tiny_corpus(tmp_path_factory):
    """(path, corpus) of 40 passages, for the fault tests' own servers."""
    corpus = SyntheticCorpus(40, seed=11, n_planted=2, vocab_size=300, words_per_doc=(10, 20))
    return corpus.write(str(tmp_path_factory.mktemp("tiny") / "tiny.jsonl")), corpus


def test_planted_documents_are_retrieved(es_url, es_index, small_corpus):
    corpus = small_corpus[1]
    queries = [p.query for p in corpus.planted]

    async def run():
        retriever = make_retriever({"backend": "elasticsearch", "hosts": es_url, "index": es_index,
                                    "batch_size": 3, "max_concurrency": 2})
        try:
            await retriever.check()
            return await retriever.search(queries, k=3)
        finally:
            await retriever.close()

    results = asyncio.run(run())
    assert [r.error for r in results] == [None] * len(queries)
    assert [r.docs[0].id for r in results] == [p.doc_id for p in corpus.planted]
    records = {r["id"]: r["contents"] for r in corpus.records()}
    for result in results:
        assert len(result.docs) == 3
        assert [d.contents for d in result.docs] == [records[d.id] for d in result.docs]
        assert result.docs[0].score > result.docs[1].score >= result.docs[2].score > 0


def test_index_has_bm25_similarity_and_english_analyzer(es_url, es_index):
    client = Elasticsearch(es_url)
    try:
        info = client.indices.get(index=es_index)[es_index]
    finally:
        client.close()
    similarity = info["settings"]["index"]["similarity"]["llds_bm25"]
    assert (similarity["type"], float(similarity["k1"]), float(similarity["b"])) == ("BM25", 0.9, 0.4)
    assert info["mappings"]["properties"]["contents"] == {"type": "text", "analyzer": "english",
                                                          "similarity": "llds_bm25"}


def test_missing_index_is_reported_by_check_and_per_query(es_url):
    async def run():
        retriever = ElasticsearchRetriever(es_url, "llds-no-such-index", policy=FAST_FAIL)
        try:
            with pytest.raises(RetrieverUnavailableError) as error:
                await retriever.check()
            return str(error.value), await retriever.search(["a", "b"], 2)
        finally:
            await retriever.close()

    message, results = asyncio.run(run())
    assert message.startswith(f"elasticsearch backend at {es_url} (index 'llds-no-such-index'): the index does not")
    assert [r.docs for r in results] == [[], []]
    assert all("index_not_found_exception" in r.error for r in results)


def test_credentials_come_from_env_and_are_never_shown(monkeypatch, free_port):
    monkeypatch.delenv("LLDS_ES_API_KEY", raising=False)
    monkeypatch.setenv("LLDS_ES_USER", "elastic")
    monkeypatch.delenv("LLDS_ES_PASSWORD", raising=False)
    with pytest.raises(ValueError, match="needs both LLDS_ES_USER and LLDS_ES_PASSWORD; LLDS_ES_PASSWORD is not set"):
        auth_from_env()
    monkeypatch.setenv("LLDS_ES_PASSWORD", "s3cret-pw")
    assert auth_from_env() == {"basic_auth": ("elastic", "s3cret-pw")}
    monkeypatch.setenv("LLDS_ES_API_KEY", "s3cret-key")
    assert auth_from_env() == {"api_key": "s3cret-key"}
    assert hosts_for_display(["https://u:s3cret-url@es.example:9200/x"]) == "https://es.example:9200/x"

    port = free_port()

    async def run():
        retriever = ElasticsearchRetriever(f"http://u:s3cret-url@127.0.0.1:{port}", "wiki", policy=FAST_FAIL)
        try:
            with pytest.raises(RetrieverUnavailableError) as error:
                await retriever.check()
            return str(error.value), (await retriever.search(["q"], 1))[0].error
        finally:
            await retriever.close()

    check_message, search_error = asyncio.run(run())
    assert check_message.startswith(f"elasticsearch backend at http://127.0.0.1:{port} (index 'wiki') cannot serve")
    assert search_error.startswith(f"elasticsearch backend at http://127.0.0.1:{port} (index 'wiki') msearch:")
    assert "s3cret" not in check_message + search_error


def build_small_index(url, corpus_path, name="wiki"):
    assert index_builder_main([corpus_path, "--to", "elasticsearch", "--es-hosts", url, "--es-index", name,
                               "--no-progress"]) == 0


def assert_failed_fast(results, started, what):
    elapsed = time.monotonic() - started
    assert elapsed <= FAST_FAIL.worst_case_s + 1.0, f"{what}: took {elapsed:.1f} s"
    assert all(r.docs == [] and r.error.startswith("elasticsearch backend at") for r in results), results
    return elapsed


def test_server_stopped_mid_run_gives_errors_then_recovers(noida_factory, tiny_corpus):
    path, corpus = tiny_corpus
    server = noida_factory()
    build_small_index(server.url, path)
    query, answer = corpus.planted[0].query, corpus.planted[0].doc_id

    async def run():
        retriever = ElasticsearchRetriever(server.url, "wiki", policy=FAST_FAIL)
        try:
            before = await retriever.search([query], 1)
            server.stop()
            started = time.monotonic()
            during = await retriever.search([query, "second query"], 1)
            assert_failed_fast(during, started, "stopped server")
            server.start()
            after = await retriever.search([query], 1)
            return before, during, after
        finally:
            await retriever.close()

    before, during, after = asyncio.run(run())
    assert before[0].docs[0].id == answer
    assert "gave up after 2 attempts, last error: ConnectionError" in during[0].error
    assert after[0].error is None and after[0].docs[0].id == answer


def test_server_that_never_answers_times_out_then_recovers(noida_factory, silent_server, tiny_corpus):
    path, corpus = tiny_corpus
    query, answer = corpus.planted[1].query, corpus.planted[1].doc_id

    async def run():
        retriever = ElasticsearchRetriever(f"http://127.0.0.1:{silent_server.port}", "wiki", policy=FAST_FAIL)
        try:
            started = time.monotonic()
            hung = await retriever.search([query, "another"], 1)
            elapsed = assert_failed_fast(hung, started, "silent server")
            assert elapsed >= 2 * FAST_FAIL.timeout_s  # both attempts waited for their timeout
            with pytest.raises(RetrieverUnavailableError, match="no answer within 0.5 s"):
                await retriever.check()
            silent_server.stop()
            server = noida_factory(silent_server.port)  # the real service comes back on the same address
            await asyncio.to_thread(build_small_index, server.url, path)
            return hung, await retriever.search([query], 1)
        finally:
            await retriever.close()

    hung, recovered = asyncio.run(run())
    assert "last error: TimeoutError: no answer within 0.5 s" in hung[0].error
    assert len(recovered) == 1 and recovered[0].error is None and recovered[0].docs[0].id == answer


def test_check_explains_an_es8_cluster_refusing_the_9x_client(free_port):
    """An ES 8 server answers the 9.x client's `compatible-with=9` header with 400 media_type_header_exception."""
    port = free_port()
    refusal = {"error": {"type": "media_type_header_exception",
                         "reason": "Invalid media-type value on headers [Accept, Content-Type]"}, "status": 400}

    async def handler(request):
        return web.json_response(refusal, status=400, headers={"X-Elastic-Product": "Elasticsearch"})

    async def run():
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        retriever = ElasticsearchRetriever(f"http://127.0.0.1:{port}", "wiki", policy=FAST_FAIL)
        try:
            with pytest.raises(RetrieverUnavailableError) as error:
                await retriever.check()
            return str(error.value)
        finally:
            await retriever.close()
            await runner.cleanup()

    message = asyncio.run(run())
    assert message.startswith(f"elasticsearch backend at http://127.0.0.1:{port} (index 'wiki') cannot serve searches:"
                              " BadRequestError")
    assert message.endswith("install 'elasticsearch[async]>=8,<9' for ES 8")


def test_malformed_msearch_answers_become_error_results(free_port):
    port = free_port()
    answers = [{"responses": []},
               {"responses": [{"hits": {"hits": [{"_id": "1", "_score": 2.0, "_source": {"id": "1"}}]}},
                              {"hits": {"hits": [{"_id": "2", "_score": 1.0, "_source": {"contents": '"T"\nx'}}]}}]}]

    async def handler(request):
        return web.json_response(answers.pop(0), headers={"X-Elastic-Product": "Elasticsearch"})

    async def run():
        app = web.Application()
        app.router.add_post("/_msearch", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        retriever = ElasticsearchRetriever(f"http://127.0.0.1:{port}", "wiki", policy=FAST_FAIL)
        try:
            return await retriever.search(["a", "b"], 1), await retriever.search(["a", "b"], 1)
        finally:
            await retriever.close()
            await runner.cleanup()

    short, broken_hit = asyncio.run(run())
    where = f"elasticsearch backend at http://127.0.0.1:{port} (index 'wiki')"
    assert short[0] == short[1] and short[0].docs == []
    assert short[0].error == f"{where} msearch: expected 2 responses, got {{'responses': []}}"
    assert broken_hit[0].docs == [] and broken_hit[0].error == (
        f"{where}: a hit lacks _source.contents or _score (KeyError: 'contents')")
    assert broken_hit[1].error is None and broken_hit[1].docs[0].id == "2"  # _id when _source has no id
