"""The e5 retriever on the run's own chips (`backend = "e5_device"`): the paper's exact Flat inner-product search,
with the index's vectors sharded over the devices (device_index.py) and its top-k proven exact (device_search.py).

It reads the same files as the faiss backend (dense.py): Search-R1's `e5_Flat.index` with its corpus, or a folder
of `python -m index_builder CORPUS --to faiss --encoder e5` (Flat). The float32 vectors stay memory-mapped on the
host (the re-ranking reads a few candidates' rows per query); the chips hold them in bfloat16 (`vector_dtype`,
2 bytes a number) or int8 with per-row scales (1 byte). Queries are embedded on the default device by the e5
encoder (e5.py), as the faiss backend does, then searched on the chips; one worker thread serves the calls (the
device programs run one at a time anyway).

Devices: the devices of this process (`jax.local_devices()`): a host's chips, the 8 CPU devices of a test. In a
run of several processes each host holds the whole index over its own chips and searches it alone, as its rollout
samples alone on them: a search over every chip of the slice would be a collective program that all hosts must
call in step, while each host's conversations reach their searches at their own pace. The price is memory: on a
v4 host (4 chips) wiki-18 takes 4.0 GB per chip in int8 (8.1 GB in bfloat16), where the whole slice would share it.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence

import jax
import numpy as np

from llds_jax.errors import InputError
from llds_jax.search.dense import read_checked_index
from llds_jax.search.dense_options import DeviceFlatOptions
from llds_jax.search.device_index import flat_vectors, load
from llds_jax.search.device_search import ExactSearcher
from llds_jax.search.docstore import DocStore
from llds_jax.search.e5 import E5Embedder
from llds_jax.search.local import LocalRetriever


class DeviceFlatRetriever(LocalRetriever):
    """Exact top-k passages of a faiss Flat index searched on this process's devices (see the module docstring).

    index_path, corpus_path, encoder_path, max_length, batch_size, dtype: as FaissRetriever's. vector_dtype:
    "bfloat16" or "int8". candidates: candidates per query of the first pass; max_candidates: the most before a
    query is scanned on the host; block_rows: rows a device scores at a time; search_batch: queries per device call.
    """

    backend = "e5_device"

    def __init__(self, index_path: str, encoder_path: str, *, corpus_path: str = DeviceFlatOptions.corpus_path,
                 max_length: int = DeviceFlatOptions.max_length,
                 batch_size: int = DeviceFlatOptions.encoder_batch_size,
                 dtype: str = DeviceFlatOptions.encoder_dtype, vector_dtype: str = DeviceFlatOptions.vector_dtype,
                 candidates: int = DeviceFlatOptions.candidates, max_candidates: int = DeviceFlatOptions.max_candidates,
                 block_rows: int = DeviceFlatOptions.block_rows, search_batch: int = DeviceFlatOptions.search_batch):
        self.index_path, self.encoder_path = index_path, encoder_path
        self._faiss, file = read_checked_index(index_path, encoder_path, corpus_path, mmap=True)  # kept: mapped
        self.vectors_nd = flat_vectors(self._faiss, file)
        docs = DocStore.of_corpus(corpus_path) if corpus_path else DocStore(index_path)
        if len(docs) < len(self.vectors_nd):
            docs.close()
            raise InputError(f"corpus {corpus_path or index_path} has {len(docs):,} lines but faiss index {file} "
                             f"has {len(self.vectors_nd):,} rows (row i is line i)")
        self.device_index = load(self.vectors_nd, jax.local_devices(), dtype=vector_dtype, block_rows=block_rows,
                                 what=f"e5_device index {file}")
        self.searcher = ExactSearcher(self.device_index, self.vectors_nd, candidates=candidates,
                                      max_candidates=max_candidates, max_batch=search_batch)
        self.embedder = E5Embedder(encoder_path, max_length=max_length, batch_size=batch_size, dtype=dtype)
        super().__init__(index_path, docs, workers=1)

    @property
    def num_docs(self) -> int:
        """The index's rows (the corpus may hold more lines)."""
        return len(self.vectors_nd)

    @property
    def max_document_bytes(self) -> int:
        """As FaissRetriever's: the most bytes one hit takes in the server's JSON answer."""
        return self._docs.max_record_bytes

    def top_k(self, queries: Sequence[str], k: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per query (rows [<= k] int64, exact scores [<= k] float32), faiss IndexFlatIP's order."""
        query_bd = self.embedder.embed_queries(queries)
        return [(a.ids, a.scores.astype(np.float32)) for a in self.searcher.search(query_bd, k)]

    def _top_k_rows(self, queries: list[str], k: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        return iter(self.top_k(queries, k))
