"""`make_retriever(cfg)`: the retriever a config asks for, with every key validated up front.

Config keys (a dict, or anything with `to_dict()` / `items()` such as ml_collections.ConfigDict):

- `backend`: "bm25" (default), "faiss", "e5_device", "elasticsearch" or "http".
- bm25 (embedded index, see bm25.py):
  - `index_dir` (str, required): folder written by `python -m index_builder CORPUS --to bm25 --out DIR`.
  - `workers` (int, 0): search threads, 0 = one per core of the machine; a batch is split across them.
- faiss (embedded dense retrieval with e5 query embeddings, see dense.py):
  - `index_path` (str, required): a faiss index file (Search-R1's `e5_Flat.index` / `e5_HNSW64.index`), or a folder
    written by `python -m index_builder CORPUS --to faiss --encoder e5 --out DIR`.
  - `corpus_path` (str, ""): the corpus of an index file (`wiki-18.jsonl`, row i = line i); "" for a folder.
  - `mmap` (bool, True): memory-map the index's vectors; `hnsw_ef_search` (int, 0): HNSW breadth, 0 = the file's.
  - `workers` (int, 0): calls searched at once, each whole on faiss's threads (one per core); 0 = one per core.
- e5_device (the exact Flat search on this process's devices, see dense_device.py): `index_path`, `corpus_path`
  as faiss's (a Flat index); `vector_dtype` ("bfloat16" or "int8", "bfloat16"): the rows on the chips;
  `candidates` (int, 32): candidates per query of the first pass (4x more for a query whose top-k is not proven);
  `max_candidates` (int, 4096): past it a query is scanned on the host; `block_rows` (int, 65536): rows a device
  scores at a time; `search_batch` (int, 64): queries per device call.
- faiss, e5_device and elasticsearch, the e5 encoder (e5.py):
  - `encoder_path` (str; required for faiss and e5_device; elasticsearch: "" = BM25, a folder = kNN): e5 model
    folder (local or gs://), e.g. a copy of intfloat/e5-base-v2.
  - `max_length` (int, 256): tokens per query; `encoder_batch_size` (int, 256): queries per device call;
    `encoder_dtype` ("float32" or "bfloat16", "float32"): compute dtype.
- elasticsearch (see elastic.py; credentials only from env LLDS_ES_API_KEY or LLDS_ES_USER + LLDS_ES_PASSWORD):
  - `hosts` (str or list of str, "http://127.0.0.1:9200"): cluster URLs, a string may be comma-separated.
  - `index` (str, required): index name.
  - `verify_certs` (bool, True): verify TLS certificates; `ca_certs` (str or None): CA bundle file.
  - `batch_size` (int, 64): queries per msearch request.
  - with `encoder_path`: `vector_field` (str, "embedding"), the dense_vector field; `num_candidates` (int, 100),
    candidates per shard of the approximate kNN search (at least k).
- http (a Search-R1 retrieval server, see http.py):
  - `url` (str, required): the endpoint, e.g. "http://127.0.0.1:8000/retrieve".
  - `batch_size` (int, 64): queries per POST.
  - `max_response_bytes` (int, 64 MiB, as the server's --max-response-bytes): the most bytes of one answer; a
    longer one is abandoned as it arrives and its queries fail (`Search failed: ...`, counted as a timeout is).
- elasticsearch and http, URLs: each needs a scheme (`http://`, `https://`); user info in one
  (`https://elastic:PASSWORD@host:9200`, the password may hold unencoded `/ # ? @ :` and spaces) is sent as basic
  auth and shown as `***@` in every message (`llds_jax.runtime.redaction`); no message quotes a key's value unredacted.
- elasticsearch and http, requests (see retry.py): `timeout_s` (float, 10.0) per attempt, `max_retries` (int, 3),
  `backoff_s` (float, 0.5) first pause before a retry, doubled each time, `max_concurrency` (int, 8) requests in
  flight.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import ml_collections

from llds_jax.runtime import redaction
from llds_jax.bounds import ConfigError
from llds_jax.search.retry import RequestPolicy
from llds_jax.search.types import Retriever

_REQUIRED = object()
_POLICY_KEYS = {"timeout_s": ((int, float), 10.0), "max_retries": ((int,), 3), "backoff_s": ((int, float), 0.5),
                "max_concurrency": ((int,), 8)}
_ENCODER_KEYS = {"max_length": ((int,), 256), "encoder_batch_size": ((int,), 256),
                 "encoder_dtype": ((str,), "float32")}
# backend -> key -> (accepted types, default or _REQUIRED)
_SPECS: dict[str, dict[str, tuple[tuple[type, ...], Any]]] = {
    "bm25": {"index_dir": ((str,), _REQUIRED), "workers": ((int,), 0)},
    "faiss": {"index_path": ((str,), _REQUIRED), "corpus_path": ((str,), ""), "encoder_path": ((str,), _REQUIRED),
              "mmap": ((bool,), True), "hnsw_ef_search": ((int,), 0), "workers": ((int,), 0), **_ENCODER_KEYS},
    "e5_device": {"index_path": ((str,), _REQUIRED), "corpus_path": ((str,), ""), "encoder_path": ((str,), _REQUIRED),
                  "vector_dtype": ((str,), "bfloat16"), "candidates": ((int,), 32), "max_candidates": ((int,), 4096),
                  "block_rows": ((int,), 65536), "search_batch": ((int,), 64), **_ENCODER_KEYS},
    "elasticsearch": {"hosts": ((str, list, tuple), "http://127.0.0.1:9200"), "index": ((str,), _REQUIRED),
                      "verify_certs": ((bool,), True), "ca_certs": ((str, type(None)), None),
                      "batch_size": ((int,), 64), "encoder_path": ((str,), ""), "vector_field": ((str,), "embedding"),
                      "num_candidates": ((int,), 100), **_ENCODER_KEYS, **_POLICY_KEYS},
    "http": {"url": ((str,), _REQUIRED), "batch_size": ((int,), 64), "max_response_bytes": ((int,), 64 << 20),
             **_POLICY_KEYS},
}
BACKENDS = tuple(_SPECS)
# Options of how a retriever is reached and how fast it answers, never of what it returns: where the server is, its
# retries and limits, batch sizes and workers, the exact e5_device search's passes and vector storage (its top-k is
# proven exact, llds_jax/search/device_search.py). A resume may change them (llds_jax.train.run_config.trained_on).
OPERATIONAL_KEYS = frozenset({"url", "hosts", "verify_certs", "ca_certs", "workers", "mmap", "batch_size",
                              "encoder_batch_size", "candidates", "max_candidates", "block_rows", "search_batch",
                              "vector_dtype", "max_response_bytes", *_POLICY_KEYS})
_CHOICES = {"encoder_dtype": ("float32", "bfloat16"), "vector_dtype": ("bfloat16", "int8")}
_NOT_NEGATIVE = ("workers",)  # 0: one per core
_POSITIVE = ("max_length", "encoder_batch_size", "num_candidates", "batch_size", "max_response_bytes", "candidates",
             "max_candidates", "block_rows", "search_batch")
_URL_KEYS = ("url", "hosts")


def _shown(value: Any) -> str:
    """`repr(value)` for a message, URL user info redacted."""
    return redaction.redact(repr(value))


def _check_urls(key: str, value: str | list | tuple) -> None:
    """Raises ValueError unless every URL of `value` (one, a list, or a comma-separated string of hosts) has a
    scheme; the message does not quote the URL (without a scheme its user info could not be found)."""
    if isinstance(value, str):
        urls = [u for u in value.split(",") if u.strip()] if key == "hosts" else [value]
    else:
        urls = list(value)
    for i, url in enumerate(urls):
        if not isinstance(url, str) or not redaction.SCHEME.match(url.strip()):
            which = f"entry {i + 1} of " if len(urls) > 1 else ""
            raise ConfigError(f"retriever config key {key!r}: {which}the value needs a scheme (http:// or https://),"
                              f" e.g. http://127.0.0.1:9200")


def _as_dict(cfg: Any) -> dict:
    if isinstance(cfg, ml_collections.ConfigDict):
        return cfg.to_dict()
    if isinstance(cfg, Mapping):
        return dict(cfg)
    raise TypeError(f"retriever config must be a mapping, got {type(cfg).__name__}")


def resolve_config(cfg: Any) -> dict:
    """The config with defaults filled in; raises ValueError naming the offending key."""
    given = _as_dict(cfg)
    backend = given.pop("backend", "bm25")
    if backend not in _SPECS:
        raise ConfigError(f"retriever config key 'backend': {backend!r} is not one of {', '.join(BACKENDS)}")
    spec = _SPECS[backend]
    for key in given:
        if key not in spec:
            raise ConfigError(f"retriever config key {key!r} is not an option of backend {backend!r}"
                              f" (options: {', '.join(spec)})")
    resolved = {"backend": backend}
    for key, (types, default) in spec.items():
        value = given.get(key, default)
        if value is _REQUIRED:
            raise ConfigError(f"retriever config key {key!r} is required for backend {backend!r}")
        is_bool = isinstance(value, bool)
        if not isinstance(value, types) or (is_bool and bool not in types):
            names = " or ".join(t.__name__ for t in types)
            raise ConfigError(f"retriever config key {key!r} must be {names}, got {_shown(value)}")
        if key in _CHOICES and value not in _CHOICES[key]:
            raise ConfigError(f"retriever config key {key!r} must be one of {', '.join(_CHOICES[key])}, got "
                              f"{_shown(value)}")
        if key in _POSITIVE and value < 1:
            raise ConfigError(f"retriever config key {key!r} must be >= 1, got {value!r}")
        if key in _NOT_NEGATIVE and value < 0:
            raise ConfigError(f"retriever config key {key!r} must be >= 0 (0: one per core), got {value!r}")
        if key in _URL_KEYS:
            _check_urls(key, value)
        resolved[key] = value
    return resolved


def request_policy(resolved: dict[str, Any]) -> RequestPolicy:
    """The requests' policy of a resolved (`resolve_config`) elasticsearch or http retriever config."""
    return RequestPolicy(timeout_s=float(resolved["timeout_s"]), max_retries=resolved["max_retries"],
                         backoff_s=float(resolved["backoff_s"]), max_concurrency=resolved["max_concurrency"])


def make_retriever(cfg: Any) -> Retriever:
    """The retriever `cfg` describes (keys in the module docstring). Call `await retriever.check()` before use."""
    c = resolve_config(cfg)
    backend = c["backend"]
    # Backends are imported on use: each pulls in its own client library (bm25s also initializes JAX).
    if backend == "bm25":
        from llds_jax.search.bm25 import Bm25Retriever

        return Bm25Retriever(c["index_dir"], workers=c["workers"])
    if backend == "faiss":
        from llds_jax.search.dense import FaissRetriever

        return FaissRetriever(c["index_path"], c["encoder_path"], corpus_path=c["corpus_path"],
                              max_length=c["max_length"], batch_size=c["encoder_batch_size"],
                              dtype=c["encoder_dtype"], mmap=c["mmap"], hnsw_ef_search=c["hnsw_ef_search"],
                              workers=c["workers"])
    if backend == "e5_device":
        from llds_jax.search.dense_device import DeviceFlatRetriever

        return DeviceFlatRetriever(c["index_path"], c["encoder_path"], corpus_path=c["corpus_path"],
                                   max_length=c["max_length"], batch_size=c["encoder_batch_size"],
                                   dtype=c["encoder_dtype"], vector_dtype=c["vector_dtype"],
                                   candidates=c["candidates"], max_candidates=c["max_candidates"],
                                   block_rows=c["block_rows"], search_batch=c["search_batch"])
    policy = request_policy(c)
    if backend == "elasticsearch":
        from llds_jax.search.elastic import ElasticsearchRetriever

        hosts = c["hosts"] if isinstance(c["hosts"], str) else list(c["hosts"])
        embedder = None
        if c["encoder_path"]:
            from llds_jax.search.dense import encoder_dim
            from llds_jax.search.e5 import E5Embedder

            encoder_dim(c["encoder_path"])  # a missing folder is named before anything heavy is read
            embedder = E5Embedder(c["encoder_path"], max_length=c["max_length"],
                                  batch_size=c["encoder_batch_size"], dtype=c["encoder_dtype"])
        return ElasticsearchRetriever(hosts, c["index"], policy=policy, batch_size=c["batch_size"],
                                      verify_certs=c["verify_certs"], ca_certs=c["ca_certs"], embedder=embedder,
                                      vector_field=c["vector_field"], num_candidates=c["num_candidates"])
    from llds_jax.search.http import HttpRetriever

    return HttpRetriever(c["url"], policy=policy, batch_size=c["batch_size"],
                         max_response_bytes=c["max_response_bytes"])
