"""make_retriever config: backends, defaults, and errors that name the offending key."""
import asyncio

import ml_collections
import pytest

from llds_jax import config as config_lib
from llds_jax.bounds import ConfigError
from llds_jax.config.sections import RetrieverConfig
from llds_jax.search import factory, make_retriever, options, resolve_config
from llds_jax.search.elastic import ElasticsearchRetriever
from llds_jax.search.http import HttpRetriever


def test_defaults_are_filled_in():
    assert resolve_config({"index_dir": "/idx"}).as_dict() == {"backend": "bm25", "index_dir": "/idx", "workers": 0}
    assert resolve_config({"backend": "http", "url": "http://127.0.0.1:1/retrieve"}).as_dict() == {
        "backend": "http", "url": "http://127.0.0.1:1/retrieve", "batch_size": 64, "max_response_bytes": 64 << 20,
        "timeout_s": 10.0,
        "max_retries": 3, "backoff_s": 0.5, "max_concurrency": 8}
    assert resolve_config({"backend": "faiss", "index_path": "/e5_Flat.index", "encoder_path": "/e5"}).as_dict() == {
        "backend": "faiss", "index_path": "/e5_Flat.index", "corpus_path": "", "encoder_path": "/e5", "mmap": True,
        "hnsw_ef_search": 0, "workers": 0, "max_length": 256, "encoder_batch_size": 256, "encoder_dtype": "float32"}
    assert resolve_config({"backend": "e5_device", "index_path": "/e5_Flat.index",
                           "encoder_path": "/e5"}).as_dict() == {
        "backend": "e5_device", "index_path": "/e5_Flat.index", "corpus_path": "", "encoder_path": "/e5",
        "vector_dtype": "bfloat16", "candidates": 32, "max_candidates": 4096, "block_rows": 65536,
        "search_batch": 64, "max_length": 256, "encoder_batch_size": 256, "encoder_dtype": "float32"}


@pytest.mark.parametrize("cfg, message", [
    ({"backend": "solr"},
     "retriever.backend must be one of ('bm25', 'faiss', 'e5_device', 'elasticsearch', 'http'), got 'solr'"),
    ({"backend": "e5_device", "index_path": "/i", "encoder_path": "/e", "vector_dtype": "float16"},
     "retriever.vector_dtype must be one of 'bfloat16', 'int8', got 'float16'"),
    ({"backend": "e5_device", "index_path": "/i", "encoder_path": "/e", "candidates": 0},
     "retriever.candidates must be >= 1, got 0"),
    ({"backend": "faiss", "index_path": "/i"}, "retriever.encoder_path is required for backend 'faiss'"),
    ({"backend": "faiss", "index_path": "/i", "encoder_path": "/e", "encoder_dtype": "fp8"},
     "retriever.encoder_dtype must be one of 'float32', 'bfloat16', got 'fp8'"),
    ({"backend": "elasticsearch", "index": "w", "num_candidates": 0}, "retriever.num_candidates must be >= 1, got 0"),
    ({"backend": "bm25", "index_dir": "/i", "workers": -1}, "retriever.workers must be >= 0 (0: one per core), got -1"),
    ({"backend": "bm25"}, "retriever.index_dir is required for backend 'bm25'"),
    ({"backend": "bm25", "index_dir": "/i", "url": "x"}, "retriever.url is not an option of backend 'bm25'"),
    ({"backend": "bm25", "index_dir": "/i", "workers": "4"}, "retriever.workers must be int, got '4'"),
    ({"backend": "bm25", "index_dir": "/i", "workers": True}, "retriever.workers must be int, got True"),
    ({"backend": "elasticsearch", "index": "w", "verify_certs": "no"}, "retriever.verify_certs must be bool"),
    ({"backend": "http", "url": "http://h/retrieve", "timeout_s": None},
     "retriever.timeout_s must be int or float, got None"),
    ({"backend": "http", "url": "http://h/retrieve", "max_retries": -1}, "retriever.max_retries must be >= 0, got -1"),
    ({"backend": "faiss", "index_path": "/i", "encoder_path": "/e", "hnsw_ef_search": -1},
     "retriever.hnsw_ef_search must be >= 0, got -1"),
])
def test_bad_config_names_the_key(cfg, message):
    with pytest.raises(ConfigError) as raised:
        resolve_config(cfg)
    assert str(raised.value).startswith(message)


def test_network_backends_from_the_run_configs_typed_section():
    section = lambda values: config_lib.build(RetrieverConfig, ml_collections.ConfigDict(values))  # noqa: E731

    async def run():
        es = make_retriever(section({
            "backend": "elasticsearch", "hosts": ["http://127.0.0.1:9", "http://127.0.0.1:10"], "index": "wiki",
            "timeout_s": 2, "max_retries": 1}))
        http = make_retriever(section({"backend": "http", "url": "http://127.0.0.1:9/retrieve"}))
        try:
            return (type(es), es.hosts, es.index, es.policy.timeout_s, es.policy.max_retries,
                    type(http), http.url, http.batch_size)
        finally:
            await es.close()
            await http.close()

    assert asyncio.run(run()) == (ElasticsearchRetriever, ["http://127.0.0.1:9", "http://127.0.0.1:10"], "wiki",
                                  2.0, 1, HttpRetriever, "http://127.0.0.1:9/retrieve", 64)


def test_operational_keys_are_the_options_declared_so():
    """A resume may change how the retriever is reached, never what it returns (llds_jax.train.run_config)."""
    assert factory.OPERATIONAL_KEYS == {
        "url", "hosts", "verify_certs", "ca_certs", "workers", "mmap", "batch_size", "encoder_batch_size",
        "candidates", "max_candidates", "block_rows", "search_batch", "vector_dtype", "max_response_bytes",
        "timeout_s", "max_retries", "backoff_s", "max_concurrency"}


def test_every_backend_is_registered_with_a_documented_option_per_key():
    assert options.BACKENDS.names() == ("bm25", "faiss", "e5_device", "elasticsearch", "http")
    for name in options.BACKENDS.names():
        rows = options.table(options.BACKENDS[name]).splitlines()[2:]
        assert len(rows) == len(resolve_config(_required(name)).as_dict()) - 1  # all but "backend"
        assert all(row.split(" | ")[-1].strip(" |") for row in rows), name
    assert "| `retriever.timeout_s` | float | 10.0 | > 0 | may change | seconds per attempt of a request |" in (
        options.table(options.BACKENDS["http"]))
    assert "| `retriever.index_dir` | str | required |  |  |" in options.table(options.BACKENDS["bm25"])


def _required(backend):
    """The least config of `backend`: its required options."""
    least = {"bm25": {"index_dir": "/i"}, "faiss": {"index_path": "/i", "encoder_path": "/e"},
             "e5_device": {"index_path": "/i", "encoder_path": "/e"}, "elasticsearch": {"index": "w"},
             "http": {"url": "http://h/retrieve"}}
    return {"backend": backend, **least[backend]}
