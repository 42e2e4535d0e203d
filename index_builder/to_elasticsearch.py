"""Corpus -> Elasticsearch index through `async_streaming_bulk`, resumable.

Each passage is sent as `create` with `_id` = passage id, so re-running an interrupted build skips what is already
indexed (the cluster answers 409 for those, counted as already present) instead of duplicating it. The index is
created with `llds_jax.search.elastic.index_body` when it does not exist yet.

With an encoder (`--encoder e5`) each document also carries its passage's e5 embedding in the dense_vector field:
passages go in groups of `bulk_docs`; an `mget` asks which of a group's ids are indexed already (those are counted
as present and not embedded again, so a resumed build embeds only what is missing), the rest are embedded in one
batched call and sent.
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING

import elasticsearch
from elasticsearch.helpers import async_streaming_bulk

from index_builder.corpus import CorpusReader
from index_builder.progress import Progress
from index_builder.summary import BuildSummary
from index_builder.corpus import Passage
from llds_jax.search.elastic import VECTOR_FIELD, index_body

if TYPE_CHECKING:
    from llds_jax.search.e5 import E5Embedder


class BulkRejectedError(RuntimeError):
    """The cluster refused a document for a reason other than "already exists"."""


async def build_elasticsearch(reader: CorpusReader, client: elasticsearch.AsyncElasticsearch, index: str, *,
                              location: str, k1: float = 0.9, b: float = 0.4, shards: int = 1, replicas: int = 1,
                              bulk_docs: int = 500, progress: Progress | None = None,
                              embedder: E5Embedder | None = None, vector_index: str = "hnsw") -> BuildSummary:
    """Indexes the passages of `reader` into `index` (created if missing), `bulk_docs` per bulk request; with
    `embedder` (an E5Embedder) also their embeddings (dense_vector field, `vector_index` "hnsw" or "int8_hnsw").

    `location` names the target (hosts and index) in messages and the summary.
    """
    start = time.monotonic()
    if not await client.indices.exists(index=index):
        dims = embedder.dim if embedder is not None else 0
        await client.indices.create(index=index, **index_body(k1=k1, b=b, shards=shards, replicas=replicas,
                                                               dense_dims=dims, vector_index=vector_index))
    elif embedder is not None:
        await check_dense_index(client, index, location, embedder)

    def actions() -> Iterator[dict]:
        for passage in reader:
            if progress:
                progress.advance(reader.position)
            yield {"_op_type": "create", "_index": index, "_id": passage.id,
                   "_source": {"id": passage.id, "contents": passage.contents}}

    found = 0

    async def dense_actions() -> AsyncIterator[dict]:
        group: list[Passage] = []
        for passage in reader:
            if progress:
                progress.advance(reader.position)
            group.append(passage)
            if len(group) == bulk_docs:
                for action in await embedded(group):
                    yield action
                group = []
        if group:
            for action in await embedded(group):
                yield action

    async def embedded(group: list[Passage]) -> list[dict]:
        nonlocal found
        answer = await client.mget(index=index, ids=[p.id for p in group], source=False)
        present_ids = {doc["_id"] for doc in answer["docs"] if doc.get("found")}
        todo: dict[str, Passage] = {}
        for passage in group:
            if passage.id not in present_ids:
                todo.setdefault(passage.id, passage)  # a repeated id keeps its first passage, as without encoder
        found += len(group) - len(todo)  # indexed already, or repeated in the group
        if not todo:
            return []
        emb_nd = embedder.embed_passages([p.contents for p in todo.values()])
        return [{"_op_type": "create", "_index": index, "_id": p.id,
                 "_source": {"id": p.id, "contents": p.contents, VECTOR_FIELD: v.tolist()}}
                for p, v in zip(todo.values(), emb_nd)]

    indexed = present = 0
    stream = dense_actions() if embedder is not None else actions()
    async for ok, item in async_streaming_bulk(client, stream, chunk_size=bulk_docs, raise_on_error=False,
                                               yield_ok=True, max_retries=3, initial_backoff=1):
        result = item["create"]
        if ok:
            indexed += 1
        elif result.get("status") == 409:
            present += 1
        else:
            raise BulkRejectedError(f"{location}: document id {result.get('_id')!r} rejected"
                                    f" (HTTP {result.get('status')}): {result.get('error')}")
    if progress:
        progress.close(reader.position)
    await client.indices.refresh(index=index)
    count = (await client.count(index=index))["count"]
    stats = await client.indices.stats(index=index, metric="store")
    size = stats["_all"]["primaries"]["store"]["size_in_bytes"]
    return BuildSummary(location=location, docs_indexed=indexed, docs_already_present=present + found,
                        lines_skipped=reader.skipped, seconds=time.monotonic() - start, index_docs=count,
                        index_bytes=size)


async def check_dense_index(client: elasticsearch.AsyncElasticsearch, index: str, location: str,
                            embedder: E5Embedder) -> None:
    """Raises BulkRejectedError naming the index field and the encoder when an existing index cannot take this
    encoder's vectors (built without --encoder, or with another encoder)."""
    mapping = next(iter((await client.indices.get_mapping(index=index)).body.values()), {})
    field = mapping.get("mappings", {}).get("properties", {}).get(VECTOR_FIELD)
    if not isinstance(field, dict) or field.get("type") != "dense_vector":
        raise BulkRejectedError(f"{location} exists without a dense_vector field {VECTOR_FIELD!r} (a BM25 index);"
                                f" --encoder e5 ({embedder.path}) needs a new --es-index")
    if field.get("dims") != embedder.dim:
        raise BulkRejectedError(f"{location}: field {VECTOR_FIELD!r} holds {field.get('dims')}-dimensional vectors"
                                f" but encoder {embedder.path} embeds {embedder.dim}")
