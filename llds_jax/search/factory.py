"""`make_retriever(cfg)`: the retriever a config asks for, with every key validated up front.

`cfg` (the run config's typed `retriever` section, or a mapping) holds `backend` ("bm25", the
default; "faiss", "e5_device", "elasticsearch" or "http") and that backend's options, each declared beside the
backend's code (`llds_jax.search.options`: `bm25.Bm25Options`, `dense_options.FaissOptions` and
`DeviceFlatOptions`, `elastic.ElasticsearchOptions`, `http.HttpOptions`; the README's config table has a block per
backend). This module imports the declarations (which registers them); the backends themselves are imported on use
(each pulls in its own client library, faiss or JAX).

URLs (elasticsearch's `hosts`, http's `url`) need a scheme (`http://`, `https://`); user info in one
(`https://elastic:PASSWORD@host:9200`, the password may hold unencoded `/ # ? @ :` and spaces) is sent as basic
auth and shown as `***@` in every message (`llds_jax.runtime.redaction`); no message quotes a key's value unredacted.
Elasticsearch credentials come only from env LLDS_ES_API_KEY or LLDS_ES_USER + LLDS_ES_PASSWORD.
"""
from __future__ import annotations

from typing import Any

from llds_jax.search import options
from llds_jax.search.bm25 import Bm25Options
from llds_jax.search.dense_options import DeviceFlatOptions, FaissOptions
from llds_jax.search.elastic import ElasticsearchOptions
from llds_jax.search.http import HttpOptions
from llds_jax.search.retry import RequestPolicy
from llds_jax.search.types import Retriever

# Options of how a retriever is reached and how fast it answers, never of what it returns (declared
# `operational`): where the server is, its retries and limits, batch sizes and workers, the exact e5_device search's
# passes and vector storage (its top-k is proven exact, llds_jax/search/device_search.py). A resume may change them
# (llds_jax.train.run_config.trained_on).
OPERATIONAL_KEYS = options.operational_keys()


def resolve_config(cfg: Any) -> options.RetrieverOptions:
    """The options of the backend `cfg` names, defaults filled in; ConfigError naming the offending key."""
    return options.resolve(cfg)


def make_retriever(cfg: Any) -> Retriever:
    """The retriever `cfg` describes (keys in the README's blocks). Call `await retriever.check()` before use."""
    c = resolve_config(cfg)
    if isinstance(c, Bm25Options):
        from llds_jax.search.bm25 import Bm25Retriever

        return Bm25Retriever(c.index_dir, workers=c.workers)
    if isinstance(c, FaissOptions):
        from llds_jax.search.dense import FaissRetriever

        return FaissRetriever(c.index_path, c.encoder_path, corpus_path=c.corpus_path, max_length=c.max_length,
                              batch_size=c.encoder_batch_size, dtype=c.encoder_dtype, mmap=c.mmap,
                              hnsw_ef_search=c.hnsw_ef_search, workers=c.workers)
    if isinstance(c, DeviceFlatOptions):
        from llds_jax.search.dense_device import DeviceFlatRetriever

        return DeviceFlatRetriever(c.index_path, c.encoder_path, corpus_path=c.corpus_path,
                                   max_length=c.max_length, batch_size=c.encoder_batch_size, dtype=c.encoder_dtype,
                                   vector_dtype=c.vector_dtype, candidates=c.candidates,
                                   max_candidates=c.max_candidates, block_rows=c.block_rows,
                                   search_batch=c.search_batch)
    policy = RequestPolicy.of(c)
    if isinstance(c, ElasticsearchOptions):
        from llds_jax.search.elastic import ElasticsearchRetriever

        hosts = c.hosts if isinstance(c.hosts, str) else list(c.hosts)
        embedder = None
        if c.encoder_path:
            from llds_jax.search.dense import encoder_dim
            from llds_jax.search.e5 import E5Embedder

            encoder_dim(c.encoder_path)  # a missing folder is named before anything heavy is read
            embedder = E5Embedder(c.encoder_path, max_length=c.max_length, batch_size=c.encoder_batch_size,
                                  dtype=c.encoder_dtype)
        return ElasticsearchRetriever(hosts, c.index, policy=policy, batch_size=c.batch_size,
                                      verify_certs=c.verify_certs, ca_certs=c.ca_certs, embedder=embedder,
                                      vector_field=c.vector_field, num_candidates=c.num_candidates)
    assert isinstance(c, HttpOptions), type(c)
    from llds_jax.search.http import HttpRetriever

    return HttpRetriever(c.url, policy=policy, batch_size=c.batch_size, max_response_bytes=c.max_response_bytes)
