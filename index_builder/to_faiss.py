"""Corpus -> dense index folder (llds_jax.search.dense_index): e5 embeddings in batches, a faiss index, resumable.

Passages are read in groups of `group_docs` (at most `shard_docs`), embedded by `E5Embedder.embed_passages`
(sorted by length inside the group, so batches are padded little; jit on the default device), and handed to the
writer, which keeps them in shards of `shard_docs`. Re-running an interrupted build resumes after its last complete
shard: the passages before it are read and skipped, not embedded again.
"""
from __future__ import annotations

import logging
import os
import time

from index_builder.corpus import CorpusReader
from index_builder.progress import Progress
from index_builder.summary import BuildSummary
from llds_jax.search.dense_index import BuildSettingsError, DenseIndexWriter
from llds_jax.search.e5 import E5Embedder

log = logging.getLogger(__name__)


def build_faiss(reader: CorpusReader, out_dir: str, embedder: E5Embedder, *, faiss_spec: str = "Flat",
                shard_docs: int = 100_000, group_docs: int = 4096,
                progress: Progress | None = None) -> BuildSummary:
    """Embeds the passages of `reader` and writes (or resumes) the index folder `out_dir`."""
    start = time.monotonic()
    settings = {"encoder": embedder.path, "max_length": embedder.max_length, "dtype": embedder.cfg.dtype,
                "corpus": os.path.abspath(reader.path), "corpus_bytes": reader.size}
    writer = DenseIndexWriter(out_dir, dim=embedder.dim, faiss_spec=faiss_spec, shard_docs=shard_docs,
                              settings=settings)
    if writer.resume_docs:
        log.info("resuming %s after %d complete shards (%d passages)", writer.partial, writer.done_shards,
                 writer.resume_docs)
    seen = embedded = 0
    group_docs = min(group_docs, shard_docs)  # shards are written as their passages are embedded
    group: list = []

    def flush() -> None:
        nonlocal embedded
        writer.add([p.id for p in group], [p.contents for p in group],
                   embedder.embed_passages([p.contents for p in group]))
        embedded += len(group)
        group.clear()

    for passage in reader:
        seen += 1
        if progress:
            progress.advance(reader.position)
        if seen <= writer.resume_docs:
            continue
        group.append(passage)
        if len(group) == group_docs:
            flush()
    if group:
        flush()
    if progress:
        progress.close(reader.position)
    if seen < writer.resume_docs:
        raise BuildSettingsError(f"{reader.path} has {seen} passages, fewer than the {writer.resume_docs} of the"
                                 f" partial build {writer.partial}: the corpus changed; remove {writer.partial}")
    log.info("building the faiss %s index of %s", faiss_spec, out_dir)
    stats = writer.finish()
    return BuildSummary(location=out_dir, docs_indexed=embedded, docs_already_present=writer.resume_docs,
                        lines_skipped=reader.skipped, seconds=time.monotonic() - start, index_docs=stats.num_docs,
                        index_bytes=stats.bytes_on_disk)
