"""What every retrieval backend returns, and the interface they share.

Documents are in Search-R1's wiki-18 shape: `contents` is the quoted title line, a newline, then the passage text
(`"\\"Paul Walker\\"\\nPaul William Walker IV was ..."`).
"""
from __future__ import annotations

import abc
import asyncio
import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class Document:
    """One retrieved passage. `score` is the backend's relevance score (BM25 for bm25/elasticsearch)."""

    id: str
    contents: str
    score: float

    @property
    def title(self) -> str:
        """First line of `contents`, quotes kept (what Search-R1 prints as `Doc i(Title: {title})`)."""
        return self.contents.split("\n", 1)[0]

    @property
    def text(self) -> str:
        """The lines of `contents` after the title, joined by newlines ("" when there is only a title)."""
        parts = self.contents.split("\n", 1)
        return parts[1] if len(parts) == 2 else ""


@dataclasses.dataclass(frozen=True)
class SearchResult:
    """The answer to one query: up to k documents, best first, or `error` (a message) and no documents.
    `bad_documents`: hits the backend returned that were dropped (`received`)."""

    docs: list[Document]
    error: str | None = None
    bad_documents: int = 0


# A wiki-18 passage is ~100 words; an observation keeps at most rollout.max_observation_tokens of it. A document
# longer than this is cut where it enters the process, so that no text of any size is held or tokenized whole.
MAX_DOCUMENT_CHARS = 1 << 16


def received(hits: Sequence[tuple[object, object, float]]) -> SearchResult:
    """The result of one query from a remote backend's (id, contents, score) hits, as they enter the process: a
    hit whose contents is not a string (null, an object) is dropped and counted in `bad_documents`, never an error
    of the run; contents longer than MAX_DOCUMENT_CHARS is cut to that many characters."""
    docs = [Document(id=str(doc_id), contents=contents[:MAX_DOCUMENT_CHARS], score=score)
            for doc_id, contents, score in hits if isinstance(contents, str)]
    return SearchResult(docs, bad_documents=len(hits) - len(docs))


class RetrieverUnavailableError(RuntimeError):
    """Raised by `Retriever.check` when the backend cannot answer; the message names the backend and address."""


class Retriever(abc.ABC):
    """An async, batched retriever. Backend failures never raise from `search`: they become `SearchResult.error`."""

    #: Backend name as in the config ("bm25", "elasticsearch", "http").
    backend: str

    @abc.abstractmethod
    async def search(self, queries: Sequence[str], k: int) -> list[SearchResult]:
        """Top-`k` documents for each query, one result per query in order."""

    @abc.abstractmethod
    async def check(self) -> None:
        """Raises RetrieverUnavailableError (naming backend and address) unless a search can be served now."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Releases connections, files and threads; the retriever is unusable afterwards."""

    async def __aenter__(self) -> Retriever:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()


class BatchedRetriever(Retriever):
    """A network retriever: `search` splits the queries into requests of `batch_size` and sends them concurrently
    (the subclass bounds how many are in flight)."""

    batch_size: int

    async def search(self, queries: Sequence[str], k: int) -> list[SearchResult]:
        """Top-k documents per query; failures after retries become one error result per query."""
        check_k(k)
        queries = list(queries)
        batches = [queries[i:i + self.batch_size] for i in range(0, len(queries), self.batch_size)]
        answers = await asyncio.gather(*(self._search_batch(batch, k) for batch in batches))
        return [result for batch in answers for result in batch]

    @abc.abstractmethod
    async def _search_batch(self, queries: list[str], k: int) -> list[SearchResult]:
        """One request for `queries` (at most batch_size), with its retries."""


def check_k(k: int) -> int:
    """Validates a requested number of documents per query (an int >= 1)."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k (documents per query) must be an int >= 1, got {k!r}")
    return k
