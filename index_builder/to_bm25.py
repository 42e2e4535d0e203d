"""Corpus -> embedded BM25 index folder (llds_jax.search.bm25_index), streamed with bounded memory."""
from __future__ import annotations

import logging
import time

from index_builder.corpus import CorpusReader
from index_builder.progress import Progress
from index_builder.summary import BuildSummary
from llds_jax.search.bm25_index import Bm25IndexWriter

log = logging.getLogger(__name__)


def build_bm25(reader: CorpusReader, out_dir: str, *, k1: float = 0.9, b: float = 0.4, chunk_docs: int = 100_000,
               progress: Progress | None = None) -> BuildSummary:
    """Indexes the passages of `reader` into the new folder `out_dir`, `chunk_docs` documents in memory at a time.

    On any error, an interrupt included, nothing is left at `out_dir`.
    """
    start = time.monotonic()
    writer = Bm25IndexWriter(out_dir, k1=k1, b=b, chunk_docs=chunk_docs)
    try:
        for passage in reader:
            writer.add(passage.id, passage.contents)
            if progress:
                progress.advance(reader.position)
        if progress:
            progress.close(reader.position)
        log.info("pass 2 of 2: writing the score arrays of %s", out_dir)
        stats = writer.finish()
    except BaseException:
        writer.abort()
        raise
    log.info("%s: %d documents, %d distinct terms, %d postings", out_dir, stats.num_docs, stats.num_terms,
             stats.num_postings)
    return BuildSummary(location=out_dir, docs_indexed=stats.num_docs, docs_already_present=0,
                        lines_skipped=reader.skipped, seconds=time.monotonic() - start, index_docs=stats.num_docs,
                        index_bytes=stats.bytes_on_disk)
