"""The embedded dense backend: e5 query embeddings (e5.py) searched in a faiss inner-product index in this process.

The index is either Search-R1's own file (`e5_Flat.index`, `e5_HNSW64.index`), read as it is, with its corpus
(`wiki-18.jsonl`, row i = line i, read by byte offset: `DocStore.of_corpus`), or a folder written by
`python -m index_builder CORPUS --to faiss --encoder e5` (dense_index.py), which holds its passages.

Flat indexes are memory-mapped (`mmap`, faiss's IO_FLAG_MMAP_IFC): the vectors stay in the page cache, not in the
process's own memory. A Flat search reads every vector once per batch (21M x 768 float32 = 62 GB for wiki-18), so
a host should keep the file in its page cache (RAM above the index size) or the search is disk-bound; HNSW reads
a few thousand vectors per query. Scores are faiss's inner products (cosine similarities of unit vectors), as
Search-R1's server returns them.

Queries are embedded in batches under jit on the default JAX device, then searched with faiss's own threads (OpenMP,
one per core: faiss splits a call's queries over them, or runs its BLAS path from 167 queries of 768 dimensions on);
each call runs whole on one of `workers` threads (0: one per core), never on the event loop, so a call never
queues behind another.
"""
from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import faiss
import numpy as np

from llds_jax.bounds import ConfigError
from llds_jax.errors import InputError
from llds_jax.model.hf_io import read_config
from llds_jax.search import dense_index
from llds_jax.search.dense_options import FaissOptions
from llds_jax.search.docstore import DocStore
from llds_jax.search.e5 import E5Embedder
from llds_jax.search.local import LocalRetriever


def read_faiss_index(path: str, *, mmap: bool = FaissOptions.mmap) -> faiss.Index:
    """The faiss index file `path` (memory-mapped vectors when `mmap`); raises naming the file."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"faiss index {path} not found")
    flags = faiss.IO_FLAG_MMAP_IFC | faiss.IO_FLAG_READ_ONLY if mmap else 0
    try:
        return faiss.read_index(path, flags)
    except RuntimeError as e:
        reason = " ".join(str(e).split()).split("Error: ")[-1][:200]
        raise InputError(f"faiss index {path}: not readable by faiss ({reason})") from None


def encoder_dim(encoder_path: str) -> int:
    """The embedding size (hidden_size) an encoder folder declares, read from its config.json alone."""
    try:
        return int(read_config(encoder_path)["hidden_size"])
    except FileNotFoundError:
        raise FileNotFoundError(f"encoder folder {encoder_path} (retriever.encoder_path): no config.json there"
                                " (an e5 model folder, e.g. intfloat/e5-base-v2)") from None
    except KeyError:
        raise InputError(f"encoder folder {encoder_path}: config.json has no hidden_size") from None


def check_compatible(index: faiss.Index, index_path: str, dim: int, encoder_path: str) -> None:
    """Raises ValueError naming both sides when the index cannot hold this encoder's embeddings."""
    if index.d != dim:
        raise InputError(f"faiss index {index_path} holds {index.d}-dimensional vectors but encoder {encoder_path}"
                         f" embeds {dim} dimensions (config.json hidden_size): use the index built with this encoder")
    if index.metric_type != faiss.METRIC_INNER_PRODUCT:
        raise InputError(f"faiss index {index_path} uses metric {index.metric_type}, not inner product: e5"
                         f" embeddings of encoder {encoder_path} are compared by inner product")


class FaissRetriever(LocalRetriever):
    """Top-k passages of a faiss index for e5 query embeddings (see the module docstring).

    index_path: a faiss index file (with `corpus_path`) or an index folder of ours (`corpus_path` "": its passages).
    encoder_path: the e5 model folder (local or gs://). max_length, batch_size, dtype: E5Embedder's.
    hnsw_ef_search: HNSW search breadth (0 keeps the file's; Search-R1 keeps faiss's default 16).
    workers: calls searched at once (0: one per core).
    """

    backend = "faiss"
    split_calls = False  # faiss spreads a call's queries over its own threads

    def __init__(self, index_path: str, encoder_path: str, *, corpus_path: str = FaissOptions.corpus_path,
                 max_length: int = FaissOptions.max_length, batch_size: int = FaissOptions.encoder_batch_size,
                 dtype: str = FaissOptions.encoder_dtype, mmap: bool = FaissOptions.mmap,
                 hnsw_ef_search: int = FaissOptions.hnsw_ef_search, workers: int = FaissOptions.workers):
        self.index_path, self.encoder_path = index_path, encoder_path
        self.index, file = read_checked_index(index_path, encoder_path, corpus_path, mmap)
        if hnsw_ef_search:
            if not hasattr(self.index, "hnsw"):
                raise ConfigError(f"retriever.hnsw_ef_search is set but faiss index {file} is not HNSW")
            self.index.hnsw.efSearch = hnsw_ef_search
        corpus = corpus_path or os.path.join(index_path, dense_index.DOCS_NAME)
        docs = DocStore.of_corpus(corpus_path) if corpus_path else DocStore(index_path)
        if len(docs) < self.index.ntotal:
            docs.close()
            raise InputError(f"corpus {corpus} has {len(docs):,} lines but faiss index {file} has"
                             f" {self.index.ntotal:,} rows (row i is line i): the wrong corpus, or a truncated one")
        self.embedder = E5Embedder(encoder_path, max_length=max_length, batch_size=batch_size, dtype=dtype)
        super().__init__(index_path, docs, workers=workers)

    @property
    def num_docs(self) -> int:
        """The index's rows (the corpus may hold more lines)."""
        return int(self.index.ntotal)

    @property
    def max_document_bytes(self) -> int:
        """The most bytes one hit's `{"id": ..., "contents": ...}` takes in UTF-8 JSON (the server's response
        estimate; `DocStore.max_record_bytes`: an upper bound over the corpus's lines)."""
        return self._docs.max_record_bytes

    def top_k(self, queries: Sequence[str], k: int) -> tuple[np.ndarray, np.ndarray]:
        """(rows [B, O] int64, -1 where the index has fewer; scores [B, O] float32) of the best O = k per query (B:
        the queries, O: the top k)."""
        query_bd = self.embedder.embed_queries(queries)
        scores_bo, rows_bo = self.index.search(query_bd, k)
        return rows_bo, scores_bo

    def _top_k_rows(self, queries: list[str], k: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        return zip(*self.top_k(queries, k))


def read_checked_index(index_path: str, encoder_path: str, corpus_path: str, mmap: bool) -> tuple[Any, str]:
    """(the faiss index of `index_path`, its file): a file, or the project's index folder, checked against the
    encoder's dimension (read first, before anything heavy) and refused when it holds no vectors (before issue 66
    it served empty results and its check failed with "OSError: [Errno 22] Invalid argument"); a bare index file
    needs `corpus_path`."""
    dim = encoder_dim(encoder_path)
    folder = os.path.isdir(index_path)
    file = dense_index.index_file(index_path) if folder else index_path
    if not folder and not corpus_path:
        raise ConfigError(f"faiss index {index_path} is a file: retriever.corpus_path must name its corpus"
                          " (wiki-18.jsonl, row i = line i)")
    index = read_faiss_index(file, mmap=mmap)
    if index.ntotal == 0:
        raise InputError(f"faiss index {file} (retriever.index_path) is empty: it holds no vectors, so a search "
                         "would find nothing; build it over a corpus with passages")
    check_compatible(index, file, dim, encoder_path)
    return index, file
