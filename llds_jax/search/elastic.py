"""The Elasticsearch backend: BM25 or e5 kNN search of a cluster index with the official `AsyncElasticsearch` client.

Index layout (`index_body`, used by `index_builder`): one document per passage, `_id` = passage id, fields `id`
(keyword) and `contents` (text, `english` analyzer, BM25 similarity with k1 0.9, b 0.4); built with an encoder,
also a `dense_vector` field (`embedding`, the passage's unit e5 embedding, `dot_product` similarity, an HNSW
graph). A BM25 query is a `match` on `contents` (terms OR-ed, as Search-R1's pyserini BM25 does); a dense query
embeds the queries (e5.py, one batched call) and sends a top-level `knn` search (`knn_body`) per query. A batch goes
out as `msearch` requests of `batch_size` queries, at most `max_concurrency` in flight, each with the timeout/retry
policy of `retry.py`.

kNN scores: Elasticsearch reports `(1 + dot) / 2` for `dot_product`; the retriever returns `2 * score - 1`, the
inner product itself (what faiss and Search-R1's server return). The `hnsw` vector index keeps float32 vectors
(scores exact to float precision; 21M x 768 need ~62 GB of RAM across the cluster to search fast);
`int8_hnsw` (ES's default since 8.14, `--es-vector-index int8_hnsw`) quarters that and perturbs scores in the
third decimal. `num_candidates` (at least k) is the per-shard candidate list of the approximate search.

Credentials come from the environment only and are never logged: `LLDS_ES_API_KEY` (an encoded API key), or
`LLDS_ES_USER` with `LLDS_ES_PASSWORD` (basic auth). User info in a host URL (`https://elastic:PASSWORD@host:9200`;
the password may hold unencoded `/ # ? @ :` and spaces, `llds_jax.runtime.redaction`) is percent-encoded for the client,
which sends it as basic auth, and is in no message. TLS certificates are verified unless `verify_certs` is false;
`ca_certs` names a CA bundle file for private CAs.

Client versions: the 9.x Python client sends `Accept: ...; compatible-with=9`, which ES 8 servers reject with
`media_type_header_exception`. For an ES 8 cluster install `elasticsearch[async]>=8,<9`; for ES 9 use `>=9,<10`.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from llds_jax.bounds import AT_LEAST_1
from llds_jax.runtime import redaction
from llds_jax.errors import InputError
from llds_jax.search.dense_options import EncoderOptions
from llds_jax.search.options import REQUIRED, RetrieverOptions, option, register
from llds_jax.search.retry import GiveUpError, RequestPolicy, call_with_retries, describe
from llds_jax.search.types import BatchedRetriever, RetrieverUnavailableError, SearchResult, check_k, received

if TYPE_CHECKING:  # the encoder (and JAX) is imported only by a dense retriever, the client only when one is made
    import elasticsearch

    from llds_jax.search.e5 import E5Embedder

log = logging.getLogger(__name__)

API_KEY_ENV = "LLDS_ES_API_KEY"
USER_ENV = "LLDS_ES_USER"
PASSWORD_ENV = "LLDS_ES_PASSWORD"
SIMILARITY = "llds_bm25"
_ES8_HINT = ("; the elasticsearch 9.x Python client cannot talk to an ES 8 cluster: install"
             " 'elasticsearch[async]>=8,<9' for ES 8")


@register
@dataclasses.dataclass(frozen=True)
class ElasticsearchOptions(RetrieverOptions, EncoderOptions, RequestPolicy):
    """An Elasticsearch cluster: BM25, or e5 kNN with an encoder (llds_jax/search/elastic.py)."""

    BACKEND = "elasticsearch"

    hosts: str | tuple[str, ...] = option("http://127.0.0.1:9200", doc="cluster URLs (a string may be "
                                          "comma-separated; user info: basic auth)", operational=True, url=True)
    index: str = option(REQUIRED, doc="the index name")
    verify_certs: bool = option(True, doc="verify TLS certificates", operational=True)
    ca_certs: str | None = option(None, doc="a CA bundle file (None: the system's)", operational=True)
    batch_size: int = option(64, AT_LEAST_1, doc="queries per msearch request", operational=True)
    encoder_path: str = option("", doc="the e5 model folder of a kNN search (\"\": BM25)")
    vector_field: str = option("embedding", doc="with encoder_path: the dense_vector field")
    num_candidates: int = option(100, AT_LEAST_1, doc="with encoder_path: candidates per shard of the approximate "
                                                      "kNN search (at least k)")


VECTOR_FIELD = ElasticsearchOptions.vector_field
VECTOR_INDEXES = ("hnsw", "int8_hnsw")
# Similarities whose kNN score is (1 + x) / 2 for the inner product (cosine of unit vectors) x.
_HALF_SHIFTED = ("dot_product", "cosine")


def index_body(*, k1: float = 0.9, b: float = 0.4, shards: int = 1, replicas: int = 1, dense_dims: int = 0,
               vector_field: str = VECTOR_FIELD, vector_index: str = "hnsw") -> dict:
    """Settings and mappings of a passage index (keyword arguments of `indices.create`); with `dense_dims`, also a
    dense_vector field of that many dimensions (unit vectors, dot_product, `vector_index` "hnsw" or "int8_hnsw")."""
    body = {
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
    if dense_dims:
        body["mappings"]["properties"][vector_field] = {
            "type": "dense_vector", "dims": dense_dims, "index": True, "similarity": "dot_product",
            "index_options": {"type": vector_index}}
    return body


def match_body(query: str, k: int) -> dict:
    """The msearch body of a BM25 query: a `match` on `contents`, `k` hits with id and contents."""
    return {"query": {"match": {"contents": query}}, "size": k, "_source": ["id", "contents"]}


def knn_body(vector_d: Sequence[float], k: int, *, field: str = VECTOR_FIELD,
             num_candidates: int = ElasticsearchOptions.num_candidates) -> dict:
    """The msearch body of a dense query (ES 8.x/9.x top-level `knn` search): the `k` nearest of `field` to
    `vector_d`, with `num_candidates` (raised to k when smaller) candidates per shard; id and contents returned."""
    return {"knn": {"field": field, "query_vector": [float(x) for x in vector_d], "k": k,
                    "num_candidates": max(num_candidates, k)},
            "size": k, "_source": ["id", "contents"]}


def auth_from_env() -> dict:
    """Client auth keyword arguments read from LLDS_ES_API_KEY or LLDS_ES_USER/LLDS_ES_PASSWORD ({} if unset)."""
    api_key = os.environ.get(API_KEY_ENV)
    if api_key:
        return {"api_key": api_key}
    user, password = os.environ.get(USER_ENV), os.environ.get(PASSWORD_ENV)
    if bool(user) != bool(password):
        missing = PASSWORD_ENV if user else USER_ENV
        raise InputError(f"basic auth needs both {USER_ENV} and {PASSWORD_ENV}; {missing} is not set")
    return {"basic_auth": (user, password)} if user else {}


def parse_hosts(hosts: str | Sequence[str]) -> list[str]:
    """Host URLs from a list or a comma-separated string."""
    items = hosts.split(",") if isinstance(hosts, str) else list(hosts)
    items = [h.strip() for h in items if h.strip()]
    if not items:
        raise InputError("hosts: at least one Elasticsearch URL is needed, e.g. http://127.0.0.1:9200")
    return items


def hosts_for_display(hosts: Sequence[str]) -> str:
    """The host URLs with any user:password@ removed (found as `llds_jax.runtime.redaction` finds it; a host without a
    scheme, which no client accepts, loses everything up to its last `@`), for messages."""
    shown = [redaction.split_userinfo(host)[0] for host in hosts]
    return ",".join(host if "://" in host else host.rpartition("@")[2] for host in shown)


def make_client(hosts: Sequence[str], *, timeout_s: float | None,
                verify_certs: bool = ElasticsearchOptions.verify_certs,
                ca_certs: str | None = ElasticsearchOptions.ca_certs) -> elasticsearch.AsyncElasticsearch:
    """An AsyncElasticsearch client for `hosts` with env credentials; the client itself never retries.

    `timeout_s` bounds each request in seconds; None leaves that to the caller (the retriever's retry policy). User
    info in a host URL is percent-encoded (the client's URL parser needs it so); a host the client rejects raises
    ValueError with the URL redacted.
    """
    if not verify_certs:
        log.warning("elasticsearch at %s: TLS certificate verification is OFF", hosts_for_display(hosts))
    import elasticsearch  # here, not at the top: `--help` of the server and index_builder do not pay for it

    options = {"ca_certs": ca_certs} if ca_certs else {}
    try:
        return elasticsearch.AsyncElasticsearch(
            [redaction.encoded_userinfo(host) for host in hosts], request_timeout=timeout_s, max_retries=0,
            retry_on_timeout=False, verify_certs=verify_certs, **options, **auth_from_env())
    except ValueError as e:  # "Could not parse URL 'http://user:password@...'"
        raise InputError(f"elasticsearch hosts {hosts_for_display(hosts)}: {describe(e)}") from None


def is_permanent(error: BaseException) -> bool:
    """Whether an Elasticsearch error will not go away on retry (a 4xx other than 408/429, or a non-network bug)."""
    import elasticsearch  # loaded by then: only a client's requests raise these errors

    if isinstance(error, elasticsearch.ApiError):
        return 400 <= error.meta.status < 500 and error.meta.status not in (408, 429)
    return not isinstance(error, elasticsearch.TransportError) or isinstance(error, elasticsearch.SerializationError)


class ElasticsearchRetriever(BatchedRetriever):
    """BM25 search of `index` on the cluster at `hosts`, or kNN search of its `vector_field` with the query
    embeddings of `embedder` (an E5Embedder) when one is given (see the module docstring)."""

    backend = "elasticsearch"

    def __init__(self, hosts: str | Sequence[str], index: str, *, policy: RequestPolicy = RequestPolicy(),
                 batch_size: int = ElasticsearchOptions.batch_size,
                 verify_certs: bool = ElasticsearchOptions.verify_certs,
                 ca_certs: str | None = ElasticsearchOptions.ca_certs, embedder: E5Embedder | None = None,
                 vector_field: str = VECTOR_FIELD, num_candidates: int = ElasticsearchOptions.num_candidates):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        raw_hosts = parse_hosts(hosts)  # only the client sees them
        self.hosts = [redaction.redact(host) for host in raw_hosts]
        self.index = index
        self.policy = policy
        self.batch_size = batch_size
        self._where = f"elasticsearch backend at {hosts_for_display(raw_hosts)} (index {index!r})"
        self._client = make_client(raw_hosts, timeout_s=None, verify_certs=verify_certs, ca_certs=ca_certs)
        self._slots = asyncio.Semaphore(policy.max_concurrency)
        self.embedder, self.vector_field, self.num_candidates = embedder, vector_field, num_candidates
        self._embedding = (concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="es-embed")
                           if embedder is not None else None)

    async def search(self, queries: Sequence[str], k: int) -> list[SearchResult]:
        """Top-k documents per query; a dense retriever embeds all queries in one call first."""
        check_k(k)
        queries = list(queries)
        if self.embedder is None or not queries:
            return await super().search(queries, k)
        try:
            query_bd = await asyncio.get_running_loop().run_in_executor(
                self._embedding, self.embedder.embed_queries, queries)
        except Exception as e:  # a failure becomes an error result, never a crash
            message = f"{self._where}: embedding the queries failed: {describe(e)}"
            return [SearchResult([], message) for _ in queries]
        bodies = [knn_body(v, k, field=self.vector_field, num_candidates=self.num_candidates) for v in query_bd]
        n = self.batch_size
        answers = await asyncio.gather(*(self._msearch(bodies[i:i + n]) for i in range(0, len(bodies), n)))
        return [result for batch in answers for result in batch]

    async def _search_batch(self, queries: list[str], k: int) -> list[SearchResult]:
        return await self._msearch([match_body(query, k) for query in queries])

    async def _msearch(self, bodies: list[dict]) -> list[SearchResult]:
        """One msearch request of `bodies` (with its retries): one result per body."""
        searches = []
        for body in bodies:
            searches.append({"index": self.index})
            searches.append(body)
        async with self._slots:
            try:
                response = await call_with_retries(
                    lambda: self._client.msearch(searches=searches), self.policy,
                    what=f"{self._where} msearch", is_permanent=is_permanent)
            except GiveUpError as e:
                return [SearchResult([], str(e)) for _ in bodies]
        responses = response.body.get("responses") if isinstance(response.body, dict) else None
        if not isinstance(responses, list) or len(responses) != len(bodies):
            got = redaction.redact(str(response.body)[:200])
            message = f"{self._where} msearch: expected {len(bodies)} responses, got {got}"
            return [SearchResult([], message) for _ in bodies]
        return [self._result(item) for item in responses]

    def _result(self, item: dict) -> SearchResult:
        """One msearch response item as a result: its hits, or its error."""
        if "error" in item:
            error = item["error"]
            reason = f"{error.get('type')}: {error.get('reason')}" if isinstance(error, dict) else str(error)
            return SearchResult([], f"{self._where}: {redaction.redact(reason)}")
        try:
            return received([(hit["_source"].get("id", hit["_id"]), hit["_source"]["contents"],
                              self._score(hit["_score"])) for hit in item["hits"]["hits"]])
        except (KeyError, TypeError, ValueError) as e:
            return SearchResult([], f"{self._where}: a hit lacks _source.contents or _score ({describe(e)})")

    def _score(self, score: float) -> float:
        """A hit's score: BM25 as reported, a kNN one as the inner product (see the module docstring)."""
        return float(score) if self.embedder is None else 2.0 * float(score) - 1.0

    async def check(self) -> None:
        async def probe() -> bool:
            await self._client.info()  # a GET with a body: an ES 8 refusal of the 9.x client shows here
            exists = bool(await self._client.indices.exists(index=self.index))
            if exists and self.embedder is not None:
                mapping = await self._client.indices.get_mapping(index=self.index)
                self._check_vector_field(next(iter(mapping.body.values()), {}))
            return exists

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

    def _check_vector_field(self, mapping: dict) -> None:
        """Raises RetrieverUnavailableError naming the index field and the encoder when the index cannot answer
        this encoder's kNN queries."""
        field = mapping.get("mappings", {}).get("properties", {}).get(self.vector_field)
        encoder = f"retriever.encoder_path {self.embedder.path} ({self.embedder.dim} dimensions)"
        build = (f"build it with python -m index_builder CORPUS --to elasticsearch --encoder e5 --es-index"
                 f" {self.index}")
        if not isinstance(field, dict) or field.get("type") != "dense_vector":
            found = "missing" if not isinstance(field, dict) else f"of type {field.get('type')!r}"
            raise RetrieverUnavailableError(f"{self._where}: field {self.vector_field!r} is {found}, not a"
                                            f" dense_vector, but {encoder} asks for kNN search; {build}")
        if field.get("dims") != self.embedder.dim:
            raise RetrieverUnavailableError(f"{self._where}: field {self.vector_field!r} holds {field.get('dims')}"
                                            f"-dimensional vectors but {encoder} embeds {self.embedder.dim}")
        if field.get("similarity", "cosine") not in _HALF_SHIFTED:
            raise RetrieverUnavailableError(f"{self._where}: field {self.vector_field!r} has similarity"
                                            f" {field.get('similarity')!r}; e5 vectors need dot_product or cosine")

    async def close(self) -> None:
        await self._client.close()
        if self._embedding is not None:
            self._embedding.shutdown(wait=True)
