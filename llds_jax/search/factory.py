"""`make_retriever(cfg)`: the retriever a config asks for, with every key validated up front.

Config keys (a dict, or anything with `to_dict()` / `items()` such as ml_collections.ConfigDict):

- `backend`: "bm25" (default), "elasticsearch" or "http".
- bm25 (embedded index, see bm25.py):
  - `index_dir` (str, required): folder written by `python -m index_builder CORPUS --to bm25 --out DIR`.
  - `workers` (int, 2): search threads; a batch is split across them.
- elasticsearch (see elastic.py; credentials only from env LLDS_ES_API_KEY or LLDS_ES_USER + LLDS_ES_PASSWORD):
  - `hosts` (str or list of str, "http://127.0.0.1:9200"): cluster URLs, a string may be comma-separated.
  - `index` (str, required): index name.
  - `verify_certs` (bool, True): verify TLS certificates; `ca_certs` (str or None): CA bundle file.
  - `batch_size` (int, 64): queries per msearch request.
- http (a Search-R1 retrieval server, see http.py):
  - `url` (str, required): the endpoint, e.g. "http://127.0.0.1:8000/retrieve".
  - `batch_size` (int, 64): queries per POST.
- elasticsearch and http, requests (see retry.py): `timeout_s` (float, 10.0) per attempt, `max_retries` (int, 3),
  `backoff_s` (float, 0.5) first pause before a retry, doubled each time, `max_concurrency` (int, 8) requests in
  flight.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import ml_collections

from llds_jax.search.retry import RequestPolicy
from llds_jax.search.types import Retriever

_REQUIRED = object()
_POLICY_KEYS = {"timeout_s": ((int, float), 10.0), "max_retries": ((int,), 3), "backoff_s": ((int, float), 0.5),
                "max_concurrency": ((int,), 8)}
# backend -> key -> (accepted types, default or _REQUIRED)
_SPECS: dict[str, dict[str, tuple[tuple[type, ...], Any]]] = {
    "bm25": {"index_dir": ((str,), _REQUIRED), "workers": ((int,), 2)},
    "elasticsearch": {"hosts": ((str, list, tuple), "http://127.0.0.1:9200"), "index": ((str,), _REQUIRED),
                      "verify_certs": ((bool,), True), "ca_certs": ((str, type(None)), None),
                      "batch_size": ((int,), 64), **_POLICY_KEYS},
    "http": {"url": ((str,), _REQUIRED), "batch_size": ((int,), 64), **_POLICY_KEYS},
}
BACKENDS = tuple(_SPECS)


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
        raise ValueError(f"retriever config key 'backend': {backend!r} is not one of {', '.join(BACKENDS)}")
    spec = _SPECS[backend]
    for key in given:
        if key not in spec:
            raise ValueError(f"retriever config key {key!r} is not an option of backend {backend!r}"
                             f" (options: {', '.join(spec)})")
    resolved = {"backend": backend}
    for key, (types, default) in spec.items():
        value = given.get(key, default)
        if value is _REQUIRED:
            raise ValueError(f"retriever config key {key!r} is required for backend {backend!r}")
        is_bool = isinstance(value, bool)
        if not isinstance(value, types) or (is_bool and bool not in types):
            names = " or ".join(t.__name__ for t in types)
            raise ValueError(f"retriever config key {key!r} must be {names}, got {value!r}")
        resolved[key] = value
    return resolved


def make_retriever(cfg: Any) -> Retriever:
    """The retriever `cfg` describes (keys in the module docstring). Call `await retriever.check()` before use."""
    c = resolve_config(cfg)
    backend = c["backend"]
    # Backends are imported on use: each pulls in its own client library (bm25s also initializes JAX).
    if backend == "bm25":
        from llds_jax.search.bm25 import Bm25Retriever

        return Bm25Retriever(c["index_dir"], workers=c["workers"])
    policy = RequestPolicy(timeout_s=float(c["timeout_s"]), max_retries=c["max_retries"],
                           backoff_s=float(c["backoff_s"]), max_concurrency=c["max_concurrency"])
    if backend == "elasticsearch":
        from llds_jax.search.elastic import ElasticsearchRetriever

        hosts = c["hosts"] if isinstance(c["hosts"], str) else list(c["hosts"])
        return ElasticsearchRetriever(hosts, c["index"], policy=policy, batch_size=c["batch_size"],
                                      verify_certs=c["verify_certs"], ca_certs=c["ca_certs"])
    from llds_jax.search.http import HttpRetriever

    return HttpRetriever(c["url"], policy=policy, batch_size=c["batch_size"])
