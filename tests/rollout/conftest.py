"""Test doubles for the rollout: fake retrievers (the scripted engine: tests/rollout/scripted_engine.py)."""
from __future__ import annotations

import asyncio
import types
from typing import Optional

import pytest

from llds_jax.search.types import Document, Retriever, SearchResult


class FakeRetriever(Retriever):
    """Async retriever over a dict query -> list of contents; queries in `errors` fail with that message."""

    backend = "fake"

    def __init__(self, corpus: dict, errors: Optional[dict] = None, delay_s: float = 0.0,
                 raises: Optional[Exception] = None):
        self.corpus, self.errors, self.delay_s, self.raises = corpus, errors or {}, delay_s, raises
        self.calls: list = []

    async def search(self, queries, k):
        self.calls.append((list(queries), k))
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.raises is not None:
            raise self.raises
        results = []
        for q in queries:
            if q in self.errors:
                results.append(SearchResult([], self.errors[q]))
            else:
                contents = self.corpus.get(q, [])[:k]
                results.append(SearchResult([Document(str(j), c, 0.0) for j, c in enumerate(contents)]))
        return results

    async def check(self):
        pass

    async def close(self):
        pass


@pytest.fixture
def doubles():
    """The test doubles of this file (conftest modules are not importable by name)."""
    return types.SimpleNamespace(FakeRetriever=FakeRetriever)
