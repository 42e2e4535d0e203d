"""Retrieval for Search-R1 style rollouts: `await make_retriever(cfg).search(queries, k)`.

Backends (chosen by `cfg["backend"]`; each declares its options beside its code, llds_jax.search.options, and the
README's config table has a block per backend): "bm25" (embedded index, default), "faiss" (e5 dense retrieval over a
faiss index, e.g. Search-R1's), "e5_device" (the exact e5 search on the run's own chips), "elasticsearch" (a
cluster: BM25, or e5 kNN with `encoder_path`), "http" (a Search-R1 retrieval server). `python -m llds_jax.search.server`
serves any of them at Search-R1's `POST /retrieve`; `python -m index_builder` builds the indexes.
"""
from llds_jax.search.factory import make_retriever, resolve_config
from llds_jax.search.types import Document, Retriever, RetrieverUnavailableError, SearchResult

__all__ = ["Document", "Retriever", "RetrieverUnavailableError", "SearchResult", "make_retriever", "resolve_config"]
