"""The build of `python -m index_builder` (its `__main__` parses the flags, then imports this module: the
backends' libraries, elasticsearch, faiss and jax, are imported only for a build, not for `--help`)."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import sys

import elasticsearch

from index_builder.corpus import CorpusError, CorpusReader
from index_builder.interrupt import sigint_interrupts
from index_builder.progress import Progress
from index_builder.summary import BuildSummary
from index_builder.to_bm25 import build_bm25
from index_builder.to_elasticsearch import BulkRejectedError, build_elasticsearch
from index_builder.to_faiss import build_faiss
from llds_jax.config.sections import TrainConfig
from llds_jax.runtime import output_folder
from llds_jax.runtime.lease import FolderNotWritableError, Lease, LeaseHeldError
from llds_jax.search import bm25_index, dense_index
from llds_jax.search.bm25_index import MANIFEST_FILE, TOKENS_TMP
from llds_jax.search.dense_index import BUILD_FILE, BuildSettingsError
from llds_jax.search.docstore import DOCS_FILE, OFFSETS_FILE
from llds_jax.search.e5 import E5Embedder
from llds_jax.search.elastic import hosts_for_display, make_client, parse_hosts
from llds_jax.search.retry import describe

EXIT_BAD_CORPUS = 2
EXIT_OUT_IN_USE = 2  # another build holds --out's lease, or --out's folder is not writable
EXIT_INDEX = 3
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command stopped by Ctrl-C
INDEX_FORMATS = (bm25_index.FORMAT, dense_index.FORMAT)
# What the bm25 and faiss writers put into --out and OUT.partial.
INDEX_ENTRIES = frozenset({MANIFEST_FILE, DOCS_FILE, OFFSETS_FILE, bm25_index.DATA_FILE, bm25_index.INDICES_FILE,
                           bm25_index.INDPTR_FILE, bm25_index.VOCAB_FILE, bm25_index.PARAMS_FILE, TOKENS_TMP,
                           dense_index.INDEX_NAME, BUILD_FILE, "shards"})


class EncoderError(ValueError):
    """The encoder folder is missing or not an e5 (BERT) model."""


def open_encoder(args: argparse.Namespace) -> E5Embedder:
    """The e5 embedder of --encoder-path; raises EncoderError (one line naming the flag and the folder)."""
    try:
        return E5Embedder(args.encoder_path, max_length=args.max_length, batch_size=args.embed_batch,
                          dtype=args.dtype)
    except (FileNotFoundError, ValueError) as e:
        raise EncoderError(f"e5 encoder (--encoder-path): {' '.join(str(e).split())}") from None


def open_corpus(args: argparse.Namespace) -> tuple[CorpusReader, Progress | None]:
    """The corpus reader and, unless --no-progress, its progress bar."""
    reader = CorpusReader(args.corpus, skip_bad=args.skip_bad)
    return reader, None if args.no_progress else Progress(reader.size, f"indexing {os.path.basename(args.corpus)}")


def _is_bm25_partial(folder: str) -> bool:
    """Whether the folder is an unfinished bm25 build (Bm25IndexWriter's: its term numbers, and a document store
    that is empty or starts with a document record)."""
    try:
        with open(os.path.join(folder, DOCS_FILE), "rb") as f:
            line = f.readline()
        record = json.loads(line) if line else {"id": "", "contents": ""}
    except (OSError, ValueError):
        return False
    return (os.path.isfile(os.path.join(folder, TOKENS_TMP)) and isinstance(record, dict)
            and record.keys() == {"id", "contents"})


def _is_index(folder: str) -> bool:
    """Whether the folder is an index the builder wrote: a finished one (its manifest), an unfinished faiss build
    (its build settings) or an unfinished bm25 one."""
    manifest = output_folder.read_json(os.path.join(folder, MANIFEST_FILE))
    settings = output_folder.read_json(os.path.join(folder, BUILD_FILE))
    return any(isinstance(record, dict) and record.get("format") in INDEX_FORMATS for record in (manifest, settings)) \
        or _is_bm25_partial(folder)


# An index folder (--out) or its unfinished build (OUT.partial) of an older version (before the marker).
INDEX = output_folder.Kind("index", strangers=output_folder.proven_by(_is_index, lambda entry: entry in INDEX_ENTRIES))


def claim_outputs(args: argparse.Namespace) -> None:
    """Before a bm25 or faiss build writes or deletes anything: OUT.partial (resumed or replaced by the build) and,
    with --overwrite, an existing --out (removed) must be the builder's own, else FolderNotOursError (one line;
    nothing written or deleted): a folder of the user's that happens to have the name is never removed."""
    partial = args.out.rstrip("/") + ".partial"
    if os.path.exists(partial):
        output_folder.claim(partial, "--out", INDEX)
    if args.overwrite and os.path.exists(args.out):
        output_folder.claim(args.out, "--out", INDEX)


def build(args: argparse.Namespace) -> BuildSummary:
    """Runs the build `args` describe; raises CorpusError, BulkRejectedError, LeaseHeldError (another build on
    --out), FolderNotOursError (--out or OUT.partial not the builder's) or the backend's errors."""
    if args.to in ("bm25", "faiss"):
        with Lease(args.out.rstrip("/") + ".lease", what=f"--out {args.out}",
                   timeout_s=TrainConfig.storage_timeout_s):  # as a run's storage operations
            claim_outputs(args)
            return build_local(args, *open_corpus(args))
    reader, progress = open_corpus(args)
    embedder = open_encoder(args) if args.encoder else None

    async def to_elasticsearch() -> BuildSummary:
        hosts = parse_hosts(args.es_hosts)
        client = make_client(hosts, timeout_s=args.es_timeout, verify_certs=not args.no_verify_certs,
                             ca_certs=args.ca_certs)
        try:
            return await build_elasticsearch(
                reader, client, args.es_index, location=f"{hosts_for_display(hosts)} index {args.es_index!r}",
                k1=args.k1, b=args.b, shards=args.es_shards, replicas=args.es_replicas, bulk_docs=args.bulk_docs,
                progress=progress, embedder=embedder, vector_index=args.es_vector_index)
        finally:
            await client.close()

    return asyncio.run(to_elasticsearch())


def build_local(args: argparse.Namespace, reader: CorpusReader, progress: Progress | None) -> BuildSummary:
    """The bm25 or faiss index of `reader` at --out (replaced with --overwrite)."""
    if args.overwrite and os.path.exists(args.out):
        remove_index(args.out)
    if args.to == "bm25":
        return build_bm25(reader, args.out, k1=args.k1, b=args.b, chunk_docs=args.chunk_docs, progress=progress)
    embedder = open_encoder(args) if args.encoder else None
    return build_faiss(reader, args.out, embedder, faiss_spec=args.faiss_index, shard_docs=args.shard_docs,
                       progress=progress)


def remove_index(folder: str) -> None:
    """Removes the index folder `folder` (--overwrite), its manifest first, so that an interrupted removal never
    leaves a folder that reads as a complete index (both index kinds need llds_index.json)."""
    manifest = os.path.join(folder, MANIFEST_FILE)
    if os.path.exists(manifest):
        os.remove(manifest)
    shutil.rmtree(folder)


def interrupted(args: argparse.Namespace) -> str:
    """The line printed when SIGINT stopped the build `args` describe: what it leaves behind."""
    if args.to == "elasticsearch":
        return f"index_builder: interrupted; index {args.es_index!r} may hold part of the corpus: re-run the same" \
               " command to resume"
    partial = args.out.rstrip("/") + ".partial"
    if args.to == "faiss":
        return f"index_builder: interrupted; {args.out} not created, the complete shards in {partial} are kept:" \
               " re-run the same command to resume"
    return f"index_builder: interrupted; {args.out} not created, {partial} removed"


def run(args: argparse.Namespace) -> int:
    """Runs the build `args` (index_builder.__main__.parse_args's) describe; returns the exit status (0 ok, 2
    malformed corpus or unusable encoder or settings, 3 index/cluster error, 130 interrupted by SIGINT)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("elastic_transport").setLevel(logging.WARNING)  # it logs every request at INFO
    # It warns of every failed request; the one-line error below says what failed.
    logging.getLogger("elastic_transport.node_pool").setLevel(logging.ERROR)
    try:
        with sigint_interrupts():
            summary = build(args)
    except KeyboardInterrupt:
        print(("" if args.no_progress else "\n") + interrupted(args), file=sys.stderr)  # "\n" ends the bar's line
        return EXIT_INTERRUPTED
    except (CorpusError, EncoderError, BuildSettingsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_CORPUS
    except (LeaseHeldError, FolderNotWritableError, output_folder.FolderNotOursError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_OUT_IN_USE
    except (BulkRejectedError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_INDEX
    except (elasticsearch.ApiError, elasticsearch.TransportError) as e:
        where = hosts_for_display(parse_hosts(args.es_hosts))
        print(f"error: elasticsearch at {where} failed ({describe(e)}); re-run the same command to resume",
              file=sys.stderr)
        return EXIT_INDEX
    print(summary.format())
    return 0
