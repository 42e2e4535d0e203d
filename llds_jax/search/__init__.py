"""Retrieval for Search-R1 style rollouts: `await make_retriever(cfg).search(queries, k)`.

Backends (chosen by `cfg["backend"]`, keys documented in factory.py and docs/retrieval.md): "bm25" (embedded index,
default), "elasticsearch" (a cluster), "http" (a Search-R1 retrieval server). `python -m llds_jax.search.server`
serves any of them at Search-R1's `POST /retrieve`; `python -m index_builder` builds the indexes.
"""
from llds_jax.search.factory import make_retriever, resolve_config
from llds_jax.search.types import Document, Retriever, RetrieverUnavailableError, SearchResult

__all__ = ["Document", "Retriever", "RetrieverUnavailableError", "SearchResult", "make_retriever", "resolve_config"]
