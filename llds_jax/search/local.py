"""`LocalRetriever`: the shared part of the embedded backends (bm25.py, dense.py), whose index lives in this process.

Searches run on the retriever's own worker threads, never on the event loop: `search` splits a batch into one
part per worker and runs `search_blocking` on each (a backend that searches a whole call on many cores itself,
faiss, sets `split_calls = False`: each call then runs whole on one worker, and several calls run at once).
`workers` 0 means one per core of the machine (`os.cpu_count()`). Passages are read from a `DocStore` by row
number. A failure during `search` becomes one error result per query; `check` runs a one-query search and reads the
last row.
"""
from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import os
from collections.abc import Iterable, Sequence

import numpy as np

from llds_jax.search.docstore import DocStore
from llds_jax.search.types import Document, Retriever, RetrieverUnavailableError, SearchResult, check_k

CHECK_QUERIES, CHECK_K = ("index check",), 1  # `check`'s search: one query for the top 1


def machine_workers(workers: int) -> int:
    """`workers`, or the machine's cores (`os.cpu_count()`) when it is 0."""
    return workers or os.cpu_count() or 1


class LocalRetriever(Retriever):
    """An embedded retriever of the index at `index` (a path, named in errors) with passages in `docs`, searched
    on `workers` threads.

    A subclass sets `backend`, opens its index and `docs`, then calls this `__init__` last (it starts the threads);
    it implements `_top_k_rows`, and overrides `num_docs` when its index holds fewer rows than `docs`.
    """

    split_calls = True  # a call's queries are split over the workers

    def __init__(self, index: str, docs: DocStore, workers: int):
        self._where = f"{self.backend} backend (index {index})"
        self._docs = docs
        self._workers = workers = machine_workers(workers)
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix=f"{self.backend}-search")

    @property
    def num_docs(self) -> int:
        """Rows a search can return (document numbers 0 .. num_docs - 1)."""
        return len(self._docs)

    @abc.abstractmethod
    def _top_k_rows(self, queries: list[str], k: int) -> Iterable[tuple[np.ndarray, np.ndarray]]:
        """Per query (at least one, k checked), (rows [<= k] int, -1 for none; scores [<= k] float), best first."""

    def search_blocking(self, queries: Sequence[str], k: int) -> list[SearchResult]:
        """`search` on the calling thread (for benchmarks and tools; raises on failure)."""
        check_k(k)
        queries = list(queries)
        if not queries:
            return []
        return [SearchResult([Document(*self._docs.get(int(r)), score=float(s)) for r, s in zip(rows, scores)
                              if r >= 0]) for rows, scores in self._top_k_rows(queries, k)]

    async def search(self, queries: Sequence[str], k: int) -> list[SearchResult]:
        """Top-k documents per query; the batch is split over the worker threads."""
        check_k(k)
        queries = list(queries)
        if not queries:
            return []
        loop = asyncio.get_running_loop()
        size = -(-len(queries) // self._workers) if self.split_calls else len(queries)
        parts = [queries[i:i + size] for i in range(0, len(queries), size)]
        try:
            answers = await asyncio.gather(
                *(loop.run_in_executor(self._pool, self.search_blocking, part, k) for part in parts))
        except Exception as e:  # a failure becomes an error result, never a crash
            message = f"{self._where} failed: {type(e).__name__}: {e}"
            return [SearchResult([], message) for _ in queries]
        return [result for part in answers for result in part]

    async def check(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._pool, self.search_blocking, CHECK_QUERIES, CHECK_K)
            await loop.run_in_executor(self._pool, self._docs.get, self.num_docs - 1)
        except Exception as e:
            raise RetrieverUnavailableError(f"{self._where} cannot serve searches: {type(e).__name__}: {e}") from e

    async def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._docs.close()
