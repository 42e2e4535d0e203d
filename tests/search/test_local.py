"""LocalRetriever, the shared part of the embedded backends: batch split over workers, failures as error
results, check, close; a fake index of three rows stands in for bm25/faiss."""
import asyncio
import threading

import numpy as np
import pytest

from llds_jax.search.docstore import DocStore, DocStoreWriter
from llds_jax.search.local import LocalRetriever
from llds_jax.search.types import Document, RetrieverUnavailableError, SearchResult


class FakeRetriever(LocalRetriever):
    """Row i scores 1.0 for query "i"; "-" pads with row -1 (faiss's none); "boom", or any query once `broken`,
    raises."""

    backend = "fake"

    def __init__(self, folder, workers):
        self.threads = set()
        self.broken = False
        super().__init__(folder, DocStore(folder), workers)

    def _top_k_rows(self, queries, k):
        self.threads.add(threading.current_thread().name)
        for query in queries:
            if query == "boom" or self.broken:
                raise OSError("disk gone")
            rows = [int(query)] if query.isdigit() else [-1]
            yield np.array(rows[:k]), np.ones(len(rows[:k]), np.float32)


@pytest.fixture
def folder(tmp_path):
    writer = DocStoreWriter(str(tmp_path))
    for i in range(3):
        writer.add(f"d{i}", f'"T{i}"\nbody {i}')
    writer.close()
    return str(tmp_path)


def test_search_splits_over_workers_keeps_order_and_drops_missing_rows(folder):
    retriever = FakeRetriever(folder, workers=2)

    async def run():
        async with retriever:
            await retriever.check()
            return await retriever.search(["2", "-", "0"], 1), await retriever.search([], 1)

    results, none = asyncio.run(run())
    assert results == [SearchResult([Document("d2", '"T2"\nbody 2', 1.0)]), SearchResult([]),
                       SearchResult([Document("d0", '"T0"\nbody 0', 1.0)])]
    assert none == [] and retriever.num_docs == 3
    assert retriever.threads and all(name.startswith("fake-search") for name in retriever.threads)


def test_failures_become_error_results_and_check_names_the_index(folder):
    retriever = FakeRetriever(folder, workers=1)
    results = asyncio.run(retriever.search(["0", "boom"], 1))
    assert results == [SearchResult([], f"fake backend (index {folder}) failed: OSError: disk gone")] * 2
    with pytest.raises(ValueError, match="must be an int >= 1"):
        retriever.search_blocking(["0"], 0)
    retriever.broken = True
    with pytest.raises(RetrieverUnavailableError,
                       match=f"^fake backend \\(index {folder}\\) cannot serve searches: OSError: disk gone$"):
        asyncio.run(retriever.check())
    asyncio.run(retriever.close())
