"""The options of the e5 backends (`llds_jax.search.options`): the e5 query encoder's (e5.py; faiss, e5_device and
a dense elasticsearch take them), a dense index's files, and the faiss (dense.py) and e5_device (dense_device.py)
backends'. Declared apart from their code, which loads faiss and JAX, so that a config is checked without them."""
from __future__ import annotations

import dataclasses

from llds_jax.bounds import AT_LEAST_1, NON_NEGATIVE
from llds_jax.search.options import ONE_PER_CORE, REQUIRED, Options, RetrieverOptions, option, register

ENCODER_DTYPES = ("float32", "bfloat16")
VECTOR_DTYPES = ("bfloat16", "int8")


@dataclasses.dataclass(frozen=True)
class EncoderOptions(Options):
    """The e5 query encoder (e5.py)."""

    max_length: int = option(256, AT_LEAST_1, doc="tokens per query (longer ones are cut)")
    encoder_batch_size: int = option(256, AT_LEAST_1, doc="queries per device call of the encoder",
                                     operational=True)
    encoder_dtype: str = option("float32", choices=ENCODER_DTYPES, doc="the encoder's compute dtype")


@dataclasses.dataclass(frozen=True)
class DenseIndexOptions(EncoderOptions):
    """An e5 index (faiss's file or an index_builder folder) and its encoder."""

    index_path: str = option(REQUIRED, doc="a faiss index file (Search-R1's e5_Flat.index) or a folder of "
                                           "`python -m index_builder CORPUS --to faiss --encoder e5`")
    corpus_path: str = option("", doc="the corpus of an index file (wiki-18.jsonl, row i = line i); \"\": a folder's")
    encoder_path: str = option(REQUIRED, doc="the e5 model folder (local or gs://), e.g. intfloat/e5-base-v2")


@register
@dataclasses.dataclass(frozen=True)
class FaissOptions(RetrieverOptions, DenseIndexOptions):
    """e5 query embeddings searched in a faiss index in this process (llds_jax/search/dense.py)."""

    BACKEND = "faiss"

    mmap: bool = option(True, doc="memory-map the index's vectors", operational=True)
    hnsw_ef_search: int = option(0, NON_NEGATIVE, doc="HNSW search breadth (0: the file's)")
    workers: int = option(0, ONE_PER_CORE, doc="calls searched at once, each on faiss's threads (0: one per core)",
                          operational=True)


@register
@dataclasses.dataclass(frozen=True)
class DeviceFlatOptions(RetrieverOptions, DenseIndexOptions):
    """The exact Flat search on this process's devices, its top-k proven exact (llds_jax/search/dense_device.py)."""

    BACKEND = "e5_device"

    vector_dtype: str = option("bfloat16", choices=VECTOR_DTYPES, doc="the rows on the chips (int8: with per-row "
                                                                      "scales)", operational=True)
    candidates: int = option(32, AT_LEAST_1, doc="candidates per query of the first pass (4x more for a query "
                                                 "whose top-k is not proven)", operational=True)
    max_candidates: int = option(4096, AT_LEAST_1, doc="past it a query is scanned on the host", operational=True)
    block_rows: int = option(65536, AT_LEAST_1, doc="rows a device scores at a time", operational=True)
    search_batch: int = option(64, AT_LEAST_1, doc="queries per device call", operational=True)
