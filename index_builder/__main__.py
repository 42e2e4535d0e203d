"""Builds a retrieval index from a wiki-18 style corpus (JSON lines, plain or .gz).

    python -m index_builder wiki-18.jsonl.gz --to bm25 --out /data/wiki18_bm25
    python -m index_builder wiki-18.jsonl.gz --to elasticsearch --es-hosts https://es:9200 --es-index wiki18
    python -m index_builder wiki-18.jsonl --to faiss --encoder e5 --encoder-path /models/e5-base-v2 --out /data/e5
    python -m index_builder wiki-18.jsonl --to elasticsearch --encoder e5 --encoder-path /models/e5-base-v2 \
        --es-hosts https://es:9200 --es-index wiki18_e5

A malformed line stops the build with `file:line: reason` (exit status 2), or with --skip-bad is skipped and
counted. Elasticsearch and faiss builds are resumable: re-run the same command and documents already indexed are
skipped (faiss: after the last complete shard of `OUT.partial`). A missing or unusable encoder folder is exit status 2.
SIGINT (Ctrl-C, `kill -INT`) stops any build within moments, even one started with SIGINT ignored (as a
non-interactive shell starts `cmd &`): one line on stderr saying what is left, exit status 130. `--out` is only ever
created complete (renamed from `OUT.partial`); bm25 removes `OUT.partial`, faiss keeps its complete shards there.
One build per `--out`: a bm25 or faiss build holds the lease file `OUT.lease` (llds_jax.runtime.lease) while it runs; a
second build on the same `--out` stops with one line naming the first (exit status 2). An `OUT.partial`, and with
--overwrite an `--out`, that is not the builder's own (llds_jax.runtime.output_folder: a folder of the user's that
has the name) is left as it is, with one line and exit status 2.
Elasticsearch credentials come from LLDS_ES_API_KEY or LLDS_ES_USER + LLDS_ES_PASSWORD.
"""
from __future__ import annotations

import argparse
import os
import sys

from llds_jax.search.elastic import VECTOR_INDEXES


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m index_builder", description=__doc__.split("\n")[0])
    parser.add_argument("corpus", help="corpus file: JSON lines {id, contents}, plain or gzip")
    parser.add_argument("--to", choices=("bm25", "faiss", "elasticsearch"), required=True,
                        help="index kind to build (faiss and elasticsearch with --encoder e5: dense)")
    parser.add_argument("--encoder", choices=("e5",), help="embed passages with this encoder (dense retrieval)")
    parser.add_argument("--skip-bad", action="store_true", help="skip and count malformed lines instead of stopping")
    parser.add_argument("--k1", type=float, default=0.9, help="BM25 k1 (default 0.9)")
    parser.add_argument("--b", type=float, default=0.4, help="BM25 b (default 0.4)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    bm25 = parser.add_argument_group("--to bm25")
    bm25.add_argument("--out", help="index folder to create")
    bm25.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    bm25.add_argument("--chunk-docs", type=int, default=100_000,
                      help="documents processed at a time, the memory bound (default 100000)")
    dense = parser.add_argument_group("--encoder e5 (--to faiss, or --to elasticsearch for kNN)")
    dense.add_argument("--encoder-path", help="e5 model folder, local or gs:// (e.g. a copy of intfloat/e5-base-v2)")
    dense.add_argument("--max-length", type=int, default=256, help="tokens per passage (default 256, Search-R1's)")
    dense.add_argument("--embed-batch", type=int, default=256, help="passages per device call (default 256)")
    dense.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                       help="encoder compute dtype (default float32; bfloat16 is faster on accelerators)")
    dense.add_argument("--faiss-index", default="Flat",
                       help="faiss index factory string (default Flat, as Search-R1's e5_Flat.index; or HNSW64)")
    dense.add_argument("--shard-docs", type=int, default=100_000,
                       help="--to faiss: passages per resumable shard (default 100000)")
    es = parser.add_argument_group("--to elasticsearch")
    es.add_argument("--es-hosts", default="http://127.0.0.1:9200", help="comma-separated cluster URLs")
    es.add_argument("--es-index", help="index name (created if missing, resumed if present)")
    es.add_argument("--es-shards", type=int, default=1, help="primary shards of a new index (default 1)")
    es.add_argument("--es-replicas", type=int, default=1, help="replicas of a new index (default 1)")
    es.add_argument("--es-vector-index", choices=VECTOR_INDEXES, default="hnsw",
                    help="--encoder e5: dense_vector index type (default hnsw: float32, exact scores; int8_hnsw: 4x"
                         " less memory)")
    es.add_argument("--bulk-docs", type=int, default=500, help="documents per bulk request (default 500)")
    es.add_argument("--es-timeout", type=float, default=60.0, help="seconds per request (default 60)")
    es.add_argument("--ca-certs", help="CA bundle file for TLS")
    es.add_argument("--no-verify-certs", action="store_true", help="do not verify TLS certificates (unsafe)")
    args = parser.parse_args(argv)
    if not os.path.isfile(args.corpus):
        parser.error(f"{args.corpus}: no such file")
    if args.to in ("bm25", "faiss") and not args.out:
        parser.error(f"--to {args.to} needs --out FOLDER")
    if args.to == "faiss" and args.encoder is None:
        parser.error("--to faiss needs --encoder e5")
    if args.to == "bm25" and args.encoder:
        parser.error("--to bm25 takes no --encoder (BM25 is lexical); use --to faiss or --to elasticsearch")
    if args.encoder and not args.encoder_path:
        parser.error("--encoder e5 needs --encoder-path FOLDER (the e5 model)")
    if args.to == "elasticsearch" and not args.es_index:
        parser.error("--to elasticsearch needs --es-index NAME")
    return args


def main(argv: list[str] | None = None) -> int:
    """Command line entry point; returns the exit status (index_builder.build.run's)."""
    args = parse_args(argv)
    from index_builder import build  # the backends' libraries: only once the flags are valid

    return build.run(args)


if __name__ == "__main__":
    sys.exit(main())
