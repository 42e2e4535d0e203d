"""The embedded BM25 backend: an index folder built by `index_builder`, searched in this process.

The score arrays (bm25s's on-disk format, see bm25_index.py) are opened memory-mapped, so RAM holds the vocabulary
dict and the pages queries touch; passages are read from the document store per hit. Searches run on a thread
pool, never on the event loop. Only documents with a positive score are returned (a query whose terms occur nowhere
gets no documents), as Lucene does.

Query evaluation costs O(postings of the query terms), not O(documents): each term's precomputed scores are added
into a per-thread accumulator at its documents, the candidates are gathered back, and top-k is selected among them
(a document appears once per distinct query term, so the best k * terms entries hold the best k documents). bm25s's
own numpy path zero-fills and partitions an array of all N documents per query: fine at 100k passages, but 2-4 s
for a rare-term query at wiki-18's 21M (a mostly-zero array is argpartition's worst case); see docs/retrieval.md.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import os
import threading
from collections.abc import Iterator, Sequence

import numpy as np

from llds_jax.errors import InputError
from llds_jax.search import analyzer
from llds_jax.search.bm25_index import DATA_FILE, INDICES_FILE, INDPTR_FILE, VOCAB_FILE, read_manifest
from llds_jax.search.docstore import DocStore
from llds_jax.search.local import LocalRetriever
from llds_jax.search.options import ONE_PER_CORE, REQUIRED, RetrieverOptions, option, register


@register
@dataclasses.dataclass(frozen=True)
class Bm25Options(RetrieverOptions):
    """The embedded BM25 index, searched in this process (llds_jax/search/bm25.py)."""

    BACKEND = "bm25"

    index_dir: str = option(REQUIRED, doc="the folder of `python -m index_builder CORPUS --to bm25 --out DIR` (local "
                                          "or gs://)")
    workers: int = option(0, ONE_PER_CORE, doc="search threads; a batch is split across them (0: one per core)",
                          operational=True)


def top_k_postings(accumulator: np.ndarray, postings: Sequence[tuple[np.ndarray, np.ndarray, int]],
                   k: int) -> tuple[np.ndarray, np.ndarray]:
    """(document numbers, scores) of the best `k` documents with a positive score, best first, ties by number.

    `postings` holds one (document numbers, scores) pair per distinct query term with the term's count in the query
    (a term twice in the query counts twice, as in Lucene); documents are distinct within a term. `accumulator` is
    a float32 array of length num_docs, all zero, and is left all zero. Cost: O(postings) while the postings are
    fewer than half the documents, else O(documents).
    """
    if not postings:
        return np.zeros(0, np.int64), np.zeros(0, np.float32)
    for docs, scores, count in postings:
        np.add.at(accumulator, docs, scores if count == 1 else scores * np.float32(count))
    if 2 * sum(len(docs) for docs, _, _ in postings) < len(accumulator):
        candidates = np.concatenate([docs for docs, _, _ in postings])
        values = accumulator[candidates]
        accumulator[candidates] = 0.0
        keep = k * len(postings)  # a document appears once per term: the best `keep` entries hold the best k
    else:  # most documents match: reading the whole accumulator is cheaper
        candidates = np.flatnonzero(accumulator)
        values = accumulator[candidates]
        accumulator.fill(0.0)
        keep = k
    if len(candidates) > keep:  # everything scoring at least the keep-th best entry, ties included
        chosen = values >= np.partition(values, -keep)[-keep]
        candidates, values = candidates[chosen], values[chosen]
    order = np.lexsort((candidates, -values))
    candidates, values = candidates[order], values[order]
    _, first = np.unique(candidates, return_index=True)
    first = np.sort(first)[:k]
    return candidates[first].astype(np.int64), values[first]


class Bm25Retriever(LocalRetriever):
    """Searches the index folder `index_dir` with `workers` threads (a batch is split across them; 0: one per core).

    RAM: the vocabulary dict, plus one float32 accumulator of length num_docs per worker thread (84 MB at 21M).
    """

    backend = "bm25"

    def __init__(self, index_dir: str, *, workers: int = Bm25Options.workers):
        if workers < 0:
            raise ValueError(f"workers must be >= 0 (0: one per core), got {workers}")
        self.index_dir = index_dir
        self.manifest = read_manifest(index_dir)
        self._data = np.load(os.path.join(index_dir, DATA_FILE), mmap_mode="r")
        self._indices = np.load(os.path.join(index_dir, INDICES_FILE), mmap_mode="r")
        self._indptr = np.load(os.path.join(index_dir, INDPTR_FILE), mmap_mode="r")
        with open(os.path.join(index_dir, VOCAB_FILE), encoding="utf-8") as f:
            self._vocab: dict[str, int] = json.load(f)
        docs = DocStore(index_dir)
        if len(docs) != self.manifest["num_docs"] or len(self._indptr) != len(self._vocab) + 1:
            raise InputError(f"{index_dir}: files disagree with {self.manifest} (an incomplete copy?)")
        self._local = threading.local()
        super().__init__(index_dir, docs, workers)

    @property
    def max_document_bytes(self) -> int:
        """The most bytes one hit's `{"id": ..., "contents": ...}` takes in UTF-8 JSON (the server's response
        estimate; `DocStore.max_record_bytes`)."""
        return self._docs.max_record_bytes

    def top_k(self, query: str, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(document numbers, scores) of the best `k` documents for `query` (see `top_k_postings`)."""
        counts = collections.Counter(self._vocab[t] for t in analyzer.analyze(query) if t in self._vocab)
        scores = getattr(self._local, "scores", None)
        if scores is None:
            scores = self._local.scores = np.zeros(self.num_docs, dtype=np.float32)
        postings = []
        for term, count in counts.items():
            start, end = int(self._indptr[term]), int(self._indptr[term + 1])
            postings.append((self._indices[start:end], self._data[start:end], count))
        return top_k_postings(scores, postings, k)

    def _top_k_rows(self, queries: list[str], k: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        return (self.top_k(query, k) for query in queries)
