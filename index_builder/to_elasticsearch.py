"""Corpus -> Elasticsearch index through `async_streaming_bulk`, resumable.

Each passage is sent as `create` with `_id` = passage id, so re-running an interrupted build skips what is already
indexed (the cluster answers 409 for those, counted as already present) instead of duplicating it. The index is
created with `llds_jax.search.elastic.index_body` when it does not exist yet.
"""
from __future__ import annotations

import time
from collections.abc import Iterator

import elasticsearch
from elasticsearch.helpers import async_streaming_bulk

from index_builder.corpus import CorpusReader
from index_builder.progress import Progress
from index_builder.summary import BuildSummary
from llds_jax.search.elastic import index_body


class BulkRejectedError(RuntimeError):
    """The cluster refused a document for a reason other than "already exists"."""


async def build_elasticsearch(reader: CorpusReader, client: elasticsearch.AsyncElasticsearch, index: str, *,
                              location: str, k1: float = 0.9, b: float = 0.4, shards: int = 1, replicas: int = 1,
                              bulk_docs: int = 500, progress: Progress | None = None) -> BuildSummary:
    """Indexes the passages of `reader` into `index` (created if missing), `bulk_docs` per bulk request.

    `location` names the target (hosts and index) in messages and the summary.
    """
    start = time.monotonic()
    if not await client.indices.exists(index=index):
        await client.indices.create(index=index, **index_body(k1=k1, b=b, shards=shards, replicas=replicas))

    def actions() -> Iterator[dict]:
        for passage in reader:
            if progress:
                progress.advance(reader.position)
            yield {"_op_type": "create", "_index": index, "_id": passage.id,
                   "_source": {"id": passage.id, "contents": passage.contents}}

    indexed = present = 0
    async for ok, item in async_streaming_bulk(client, actions(), chunk_size=bulk_docs, raise_on_error=False,
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
    return BuildSummary(location=location, docs_indexed=indexed, docs_already_present=present,
                        lines_skipped=reader.skipped, seconds=time.monotonic() - start, index_docs=count,
                        index_bytes=size)
