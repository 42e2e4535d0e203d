"""The http backend: a client of a Search-R1 retrieval server (Search-R1's own, or ours in server.py).

Protocol (docs/method.md): `POST {url}` with `{"queries": [str, ...], "topk": k, "return_scores": true}`
returns `{"result": [[{"document": {"id": str, "contents": str}, "score": float}, ...], ...]}`, one list per query
in order. A batch is sent as requests of `batch_size` queries, at most `max_concurrency` in flight, each under the
timeout/retry policy of `retry.py`.

User info in the URL (`http://user:password@host:8000/retrieve`, the password may hold unencoded `/ # ? @ :` and
spaces) is sent as basic auth, never as part of the request URL, and every message shows the URL as
`llds_jax.runtime.redaction.redact` makes it (`http://***@host:8000/retrieve`).
"""
from __future__ import annotations

import asyncio
import base64
import dataclasses
import json

import aiohttp

from llds_jax.bounds import AT_LEAST_1
from llds_jax.runtime import redaction
from llds_jax.search.options import REQUIRED, RetrieverOptions, option, register
from llds_jax.search.retry import GiveUpError, RequestPolicy, call_with_retries, describe
from llds_jax.search.types import BatchedRetriever, RetrieverUnavailableError, SearchResult, received


@register
@dataclasses.dataclass(frozen=True)
class HttpOptions(RetrieverOptions, RequestPolicy):
    """A Search-R1 retrieval server (llds_jax/search/http.py)."""

    BACKEND = "http"

    url: str = option(REQUIRED, doc="the endpoint, e.g. http://127.0.0.1:8000/retrieve (user info: basic auth)",
                      operational=True, url=True)
    batch_size: int = option(64, AT_LEAST_1, doc="queries per POST", operational=True)
    max_response_bytes: int = option(64 << 20, AT_LEAST_1, doc="the most bytes of one answer (as the server's "
                                     "--max-response-bytes); a longer one fails its queries", operational=True)


class HttpStatusError(Exception):
    """The server answered with a non-200 status; the message holds the start of its body."""

    def __init__(self, status: int, body: str):
        super().__init__(f"HTTP {status}: {body[:300]}")
        self.status = status


class ResponseShapeError(ValueError):
    """The server's JSON is not the Search-R1 response shape."""


class ResponseTooLargeError(ValueError):
    """The answer passed the retriever's `max_response_bytes`: abandoned as it arrived, not retried (the same
    request would get the same answer); its queries fail as a timed-out request's do."""


def is_permanent(error: BaseException) -> bool:
    """Whether a request error will not go away on retry (a 4xx other than 408/429, or a malformed answer)."""
    if isinstance(error, HttpStatusError):
        return 400 <= error.status < 500 and error.status not in (408, 429)
    return not isinstance(error, aiohttp.ClientError)


def request_target(url: str) -> tuple[str, dict[str, str]]:
    """(`url` without its user info, the request headers: that user info as a basic-auth `Authorization` header,
    UTF-8 as RFC 7617 has it, or none without one); the user info found and percent-decoded as
    `llds_jax.runtime.redaction.credentials` does."""
    found = redaction.credentials(url)
    if found is None:
        return url, {}
    bare, user, password = found
    return bare, {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def parse_response(payload: object, num_queries: int) -> list[SearchResult]:
    """The result of each query of a `return_scores: true` response (`types.received`: a document whose contents
    is not a string is dropped and counted); raises ResponseShapeError on any other mismatch."""
    if not isinstance(payload, dict) or not isinstance(payload.get("result"), list):
        raise ResponseShapeError(f'expected {{"result": [...]}}, got {str(payload)[:200]}')
    result = payload["result"]
    if len(result) != num_queries:
        raise ResponseShapeError(f"{len(result)} result lists for {num_queries} queries")
    try:
        return [received([(item["document"]["id"], item["document"]["contents"], float(item["score"]))
                          for item in hits]) for hits in result]
    except (KeyError, TypeError, ValueError) as e:
        raise ResponseShapeError(f"result item without document id/contents or score: {describe(e)}") from e


class HttpRetriever(BatchedRetriever):
    """Searches through the Search-R1 retrieval server at `url` (the full endpoint, e.g. http://host:8000/retrieve).

    `url` (the attribute) is the redacted URL, for messages; requests go to the URL without its user info, with
    that user info as basic auth."""

    backend = "http"

    def __init__(self, url: str, *, policy: RequestPolicy = RequestPolicy(), batch_size: int = HttpOptions.batch_size,
                 max_response_bytes: int = HttpOptions.max_response_bytes):
        if batch_size < 1 or max_response_bytes < 1:
            raise ValueError(f"batch_size and max_response_bytes must be >= 1, got {batch_size}, "
                             f"{max_response_bytes}")
        self.max_response_bytes = max_response_bytes
        self.url = redaction.redact(url)
        self._endpoint, self._headers = request_target(url)
        self.policy = policy
        self.batch_size = batch_size
        self._slots = asyncio.Semaphore(policy.max_concurrency)
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:  # created on first use, inside the event loop that uses it
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        return self._session

    async def _post(self, session: aiohttp.ClientSession, queries: list[str], k: int) -> list[SearchResult]:
        body = {"queries": queries, "topk": k, "return_scores": True}
        async with session.post(self._endpoint, json=body, headers=self._headers) as response:
            text = (await self._read_at_most(response)).decode(response.get_encoding())
            if response.status != 200:
                raise HttpStatusError(response.status, text)
        return parse_response(json.loads(text), len(queries))

    async def _read_at_most(self, response: aiohttp.ClientResponse) -> bytes:
        """The body, read in chunks; ResponseTooLargeError once it passes max_response_bytes (before issue 58 an
        endless answer took the client from 37 MB to 1.47 GB in one 5 s attempt)."""
        chunks, size = [], 0
        async for chunk in response.content.iter_chunked(1 << 16):
            size += len(chunk)
            if size > self.max_response_bytes:
                raise ResponseTooLargeError(f"the answer passed max_response_bytes = {self.max_response_bytes} "
                                            f"bytes (retriever.max_response_bytes)")
            chunks.append(chunk)
        return b"".join(chunks)

    async def _search_batch(self, queries: list[str], k: int) -> list[SearchResult]:
        async with self._slots:
            try:
                return await call_with_retries(lambda: self._post(self._client(), queries, k), self.policy,
                                               what=f"http backend at {self.url}", is_permanent=is_permanent)
            except GiveUpError as e:
                return [SearchResult([], str(e)) for _ in queries]

    async def check(self) -> None:
        """Raises RetrieverUnavailableError unless the server answers a one-query search. The check has its own
        session, closed on every path: searches in flight keep theirs, and a caller that fails after the check and
        before any search leaves no session open."""
        try:
            async with aiohttp.ClientSession() as session:
                await asyncio.wait_for(self._post(session, ["retriever check"], 1), self.policy.timeout_s)
        except asyncio.TimeoutError as e:
            raise RetrieverUnavailableError(
                f"http backend at {self.url}: no answer within {self.policy.timeout_s:g} s") from e
        except Exception as e:
            raise RetrieverUnavailableError(f"http backend at {self.url} cannot serve searches: {describe(e)}") from e

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
