"""make_retriever config: backends, defaults, and errors that name the offending key."""
import asyncio

import ml_collections
import pytest

from llds_jax.search import make_retriever, resolve_config
from llds_jax.search.elastic import ElasticsearchRetriever
from llds_jax.search.http import HttpRetriever


def test_defaults_are_filled_in():
    assert resolve_config({"index_dir": "/idx"}) == {"backend": "bm25", "index_dir": "/idx", "workers": 0}
    assert resolve_config({"backend": "http", "url": "http://127.0.0.1:1/retrieve"}) == {
        "backend": "http", "url": "http://127.0.0.1:1/retrieve", "batch_size": 64, "max_response_bytes": 64 << 20,
        "timeout_s": 10.0,
        "max_retries": 3, "backoff_s": 0.5, "max_concurrency": 8}
    assert resolve_config({"backend": "faiss", "index_path": "/e5_Flat.index", "encoder_path": "/e5"}) == {
        "backend": "faiss", "index_path": "/e5_Flat.index", "corpus_path": "", "encoder_path": "/e5", "mmap": True,
        "hnsw_ef_search": 0, "workers": 0, "max_length": 256, "encoder_batch_size": 256, "encoder_dtype": "float32"}
    assert resolve_config({"backend": "e5_device", "index_path": "/e5_Flat.index", "encoder_path": "/e5"}) == {
        "backend": "e5_device", "index_path": "/e5_Flat.index", "corpus_path": "", "encoder_path": "/e5",
        "vector_dtype": "bfloat16", "candidates": 32, "max_candidates": 4096, "block_rows": 65536,
        "search_batch": 64, "max_length": 256, "encoder_batch_size": 256, "encoder_dtype": "float32"}


@pytest.mark.parametrize("cfg, message", [
    ({"backend": "solr"}, "key 'backend': 'solr' is not one of bm25, faiss, e5_device, elasticsearch, http"),
    ({"backend": "e5_device", "index_path": "/i", "encoder_path": "/e", "vector_dtype": "float16"},
     "key 'vector_dtype' must be one of bfloat16, int8, got 'float16'"),
    ({"backend": "e5_device", "index_path": "/i", "encoder_path": "/e", "candidates": 0},
     "key 'candidates' must be >= 1, got 0"),
    ({"backend": "faiss", "index_path": "/i"}, "key 'encoder_path' is required for backend 'faiss'"),
    ({"backend": "faiss", "index_path": "/i", "encoder_path": "/e", "encoder_dtype": "fp8"},
     "key 'encoder_dtype' must be one of float32, bfloat16, got 'fp8'"),
    ({"backend": "elasticsearch", "index": "w", "num_candidates": 0}, "key 'num_candidates' must be >= 1, got 0"),
    ({"backend": "bm25", "index_dir": "/i", "workers": -1}, "key 'workers' must be >= 0 .0: one per core., got -1"),
    ({"backend": "bm25"}, "key 'index_dir' is required for backend 'bm25'"),
    ({"backend": "bm25", "index_dir": "/i", "url": "x"}, "key 'url' is not an option of backend 'bm25'"),
    ({"backend": "bm25", "index_dir": "/i", "workers": "4"}, "key 'workers' must be int, got '4'"),
    ({"backend": "bm25", "index_dir": "/i", "workers": True}, "key 'workers' must be int, got True"),
    ({"backend": "elasticsearch", "index": "w", "verify_certs": "no"}, "key 'verify_certs' must be bool"),
    ({"backend": "http", "url": "http://h/retrieve", "timeout_s": None}, "key 'timeout_s' must be int or float"),
])
def test_bad_config_names_the_key(cfg, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        resolve_config(cfg)


def test_network_backends_from_configdict():
    async def run():
        es = make_retriever(ml_collections.ConfigDict({
            "backend": "elasticsearch", "hosts": ["http://127.0.0.1:9", "http://127.0.0.1:10"], "index": "wiki",
            "timeout_s": 2, "max_retries": 1}))
        http = make_retriever(ml_collections.ConfigDict({"backend": "http", "url": "http://127.0.0.1:9/retrieve"}))
        try:
            return (type(es), es.hosts, es.index, es.policy.timeout_s, es.policy.max_retries,
                    type(http), http.url, http.batch_size)
        finally:
            await es.close()
            await http.close()

    assert asyncio.run(run()) == (ElasticsearchRetriever, ["http://127.0.0.1:9", "http://127.0.0.1:10"], "wiki",
                                  2.0, 1, HttpRetriever, "http://127.0.0.1:9/retrieve", 64)
