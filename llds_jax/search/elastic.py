"""The Elasticsearch backend: BM25 search of a cluster index with the official `AsyncElasticsearch` client.

Index layout (`index_body`, used by `index_builder`): one document per passage, `_id` = passage id, fields `id`
(keyword) and `contents` (text, `english` analyzer, BM25 similarity with k1 0.9, b 0.4). A query is a `match` on
`contents` (terms OR-ed, as Search-R1's pyserini BM25 does); a batch goes out as `msearch` requests of
`batch_size` queries, at most `max_concurrency` in flight, each with the timeout/retry policy of `retry.py`.

Credentials come from the environment only and are never logged: `LLDS_ES_API_KEY` (an encoded API key), or
`LLDS_ES_USER` with `LLDS_ES_PASSWORD` (basic auth). TLS certificates are verified unless `verify_certs` is false;
`ca_certs` names a CA bundle file for private CAs.

Client versions: the 9.x Python client sends `Accept: ...; compatible-with=9`, which ES 8 servers reject with
`media_type_header_exception`. For an ES 8 cluster install `elasticsearch[async]>=8,<9`; for ES 9 use `>=9,<10`.
"""
from __future__ import annotations

import asyncio
import logging
import os
import urllib.parse
from collections.abc import Sequence

import elasticsearch

from llds_jax.search.retry import GiveUpError, RequestPolicy, call_with_retries, describe
from llds_jax.search.types import BatchedRetriever, Document, RetrieverUnavailableError, SearchResult

log = logging.getLogger(__name__)

API_KEY_ENV = "LLDS_ES_API_KEY"
USER_ENV = "LLDS_ES_USER"
PASSWORD_ENV = "LLDS_ES_PASSWORD"
SIMILARITY = "llds_bm25"
_ES8_HINT = ("; the elasticsearch 9.x Python client cannot talk to an ES 8 cluster: install"
             " 'elasticsearch[async]>=8,<9' for ES 8")


def index_body(*, k1: float = 0.9, b: float = 0.4, shards: int = 1, replicas: int = 1) -> dict:
    """Settings and mappings of a passage index (keyword arguments of `indices.create`)."""
    return {
        "settings": {
            "number_of_shards": shards,
            "number_of_replicas": replicas,
            "index": {"similarity": {SIMILARITY: {"type": "BM25", "k1": k1, "b": b}}},
        },
        "mappings": {
            "properties": {
                "id": {"type": "keyword"},
                "contents": {"type": "text", "analyzer": "english", "similarity": SIMILARITY},
            },
        },
    }


def auth_from_env() -> dict:
    """Client auth keyword arguments read from LLDS_ES_API_KEY or LLDS_ES_USER/LLDS_ES_PASSWORD ({} if unset)."""
    api_key = os.environ.get(API_KEY_ENV)
    if api_key:
        return {"api_key": api_key}
    user, password = os.environ.get(USER_ENV), os.environ.get(PASSWORD_ENV)
    if bool(user) != bool(password):
        missing = PASSWORD_ENV if user else USER_ENV
        raise ValueError(f"basic auth needs both {USER_ENV} and {PASSWORD_ENV}; {missing} is not set")
    return {"basic_auth": (user, password)} if user else {}


def parse_hosts(hosts: str | Sequence[str]) -> list[str]:
    """Host URLs from a list or a comma-separated string."""
    items = hosts.split(",") if isinstance(hosts, str) else list(hosts)
    items = [h.strip() for h in items if h.strip()]
    if not items:
        raise ValueError("hosts: at least one Elasticsearch URL is needed, e.g. http://127.0.0.1:9200")
    return items


def hosts_for_display(hosts: Sequence[str]) -> str:
    """The host URLs with any user:password@ removed, for messages."""
    shown = []
    for host in hosts:
        parts = urllib.parse.urlsplit(host)
        netloc = parts.netloc.rsplit("@", 1)[-1]
        shown.append(urllib.parse.urlunsplit(parts._replace(netloc=netloc)))
    return ",".join(shown)


def make_client(hosts: Sequence[str], *, timeout_s: float | None, verify_certs: bool = True,
                ca_certs: str | None = None) -> elasticsearch.AsyncElasticsearch:
    """An AsyncElasticsearch client for `hosts` with env credentials; the client itself never retries.

    `timeout_s` bounds each request in seconds; None leaves that to the caller (the retriever's retry policy).
    """
    if not verify_certs:
        log.warning("elasticsearch at %s: TLS certificate verification is OFF", hosts_for_display(hosts))
    options = {"ca_certs": ca_certs} if ca_certs else {}
    return elasticsearch.AsyncElasticsearch(
        list(hosts), request_timeout=timeout_s, max_retries=0, retry_on_timeout=False,
        verify_certs=verify_certs, **options, **auth_from_env())


def is_permanent(error: BaseException) -> bool:
    """Whether an Elasticsearch error will not go away on retry (a 4xx other than 408/429, or a non-network bug)."""
    if isinstance(error, elasticsearch.ApiError):
        return 400 <= error.meta.status < 500 and error.meta.status not in (408, 429)
    return not isinstance(error, elasticsearch.TransportError) or isinstance(error, elasticsearch.SerializationError)


class ElasticsearchRetriever(BatchedRetriever):
    """BM25 search of `index` on the cluster at `hosts` (see the module docstring)."""

    backend = "elasticsearch"

    def __init__(self, hosts: str | Sequence[str], index: str, *, policy: RequestPolicy = RequestPolicy(),
                 batch_size: int = 64, verify_certs: bool = True, ca_certs: str | None = None):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.hosts = parse_hosts(hosts)
        self.index = index
        self.policy = policy
        self.batch_size = batch_size
        self._where = f"elasticsearch backend at {hosts_for_display(self.hosts)} (index {index!r})"
        self._client = make_client(self.hosts, timeout_s=None, verify_certs=verify_certs, ca_certs=ca_certs)
        self._slots = asyncio.Semaphore(policy.max_concurrency)

    async def _search_batch(self, queries: list[str], k: int) -> list[SearchResult]:
        searches = []
        for query in queries:
            searches.append({"index": self.index})
            searches.append({"query": {"match": {"contents": query}}, "size": k, "_source": ["id", "contents"]})
        async with self._slots:
            try:
                response = await call_with_retries(
                    lambda: self._client.msearch(searches=searches), self.policy,
                    what=f"{self._where} msearch", is_permanent=is_permanent)
            except GiveUpError as e:
                return [SearchResult([], str(e)) for _ in queries]
        responses = response.body.get("responses") if isinstance(response.body, dict) else None
        if not isinstance(responses, list) or len(responses) != len(queries):
            message = f"{self._where} msearch: expected {len(queries)} responses, got {str(response.body)[:200]}"
            return [SearchResult([], message) for _ in queries]
        return [self._result(item) for item in responses]

    def _result(self, item: dict) -> SearchResult:
        """One msearch response item as a result: its hits, or its error."""
        if "error" in item:
            error = item["error"]
            reason = f"{error.get('type')}: {error.get('reason')}" if isinstance(error, dict) else str(error)
            return SearchResult([], f"{self._where}: {reason}")
        try:
            return SearchResult([Document(id=str(hit["_source"].get("id", hit["_id"])),
                                          contents=hit["_source"]["contents"], score=float(hit["_score"]))
                                 for hit in item["hits"]["hits"]])
        except (KeyError, TypeError, ValueError) as e:
            return SearchResult([], f"{self._where}: a hit lacks _source.contents or _score ({describe(e)})")

    async def check(self) -> None:
        async def probe() -> bool:
            await self._client.info()  # a GET with a body: an ES 8 refusal of the 9.x client shows here
            return bool(await self._client.indices.exists(index=self.index))

        try:
            exists = await asyncio.wait_for(probe(), self.policy.timeout_s)
        except asyncio.TimeoutError as e:
            raise RetrieverUnavailableError(
                f"{self._where}: no answer within {self.policy.timeout_s:g} s") from e
        except Exception as e:
            text = describe(e)
            hint = _ES8_HINT if "compatible-with" in text or "media_type_header" in text else ""
            raise RetrieverUnavailableError(f"{self._where} cannot serve searches: {text}{hint}") from e
        if not exists:
            raise RetrieverUnavailableError(
                f"{self._where}: the index does not exist (build it: python -m index_builder CORPUS"
                f" --to elasticsearch --es-index {self.index})")

    async def close(self) -> None:
        await self._client.close()
