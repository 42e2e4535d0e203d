"""Builds the embedded BM25 index folder from a stream of documents, with memory bounded by one chunk.

Scoring (Lucene's BM25 with the classic (k1 + 1) numerator; ranking is identical to Lucene >= 8, which drops that
constant factor; document lengths are exact, not Lucene's 1-byte approximation):

    score(q, d) = sum over query terms t of  idf(t) * tf * (k1 + 1) / (tf + k1 * (1 - b + b * dl / avgdl))
    idf(t)      = ln(1 + (N - df + 0.5) / (df + 0.5))

with tf the count of t in d, dl the number of terms of d and avgdl their mean over the N documents (terms are the
output of `analyzer.analyze`, so stopwords do not count).

Index folder (the score arrays are bm25s's on-disk format: `bm25s.BM25.load(folder, mmap=True)` reads it too):
- `data.csc.index.npy` float32 [postings]: precomputed score of each (term, document) pair, grouped by term,
- `indices.csc.index.npy` int32 [postings]: the document number of each pair, ascending within a term,
- `indptr.csc.index.npy` int64 [terms + 1]: where each term's pairs start,
- `vocab.index.json` {term: term number}, `params.index.json` bm25s parameters (method "atire" with idf "lucene"
  is exactly the formula above),
- `docs.jsonl` + `doc_offsets.npy`: the document store (see docstore.py),
- `llds_index.json`: our manifest (analyzer, k1, b, counts).

Build in two passes, never holding the corpus: pass 1 (`add`) analyzes each document, assigns term numbers, appends
the term numbers to a temporary file and counts document frequencies per chunk; pass 2 (`finish`) re-reads the term
numbers chunk by chunk, computes scores and scatters them into the memory-mapped score arrays at their term's slot.
RAM: the vocabulary dict, a few arrays of length terms or documents, and one chunk. The folder is written under
`<out_dir>.partial` and renamed when complete, so a crashed build never leaves a loadable half index.
"""
from __future__ import annotations

import array
import dataclasses
import json
import os
import shutil

import numpy as np

from llds_jax.errors import InputError
from llds_jax.search import analyzer
from llds_jax.search.docstore import DocStoreWriter

MANIFEST_FILE = "llds_index.json"
FORMAT = "llds-bm25-v1"
DATA_FILE, INDICES_FILE, INDPTR_FILE = "data.csc.index.npy", "indices.csc.index.npy", "indptr.csc.index.npy"
VOCAB_FILE, PARAMS_FILE = "vocab.index.json", "params.index.json"
TOKENS_TMP = "term_numbers.tmp"


@dataclasses.dataclass(frozen=True)
class IndexStats:
    """Counts of a finished index; `bytes_on_disk` is the folder size in bytes."""

    num_docs: int
    num_terms: int
    num_postings: int
    avg_doc_len: float
    bytes_on_disk: int


def read_manifest(index_dir: str) -> dict:
    """The manifest of an index folder; raises naming the folder when it is not a complete index of ours."""
    path = os.path.join(index_dir, MANIFEST_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{index_dir}: not an embedded BM25 index folder ({MANIFEST_FILE} missing;"
                                " build one with `python -m index_builder --to bm25 ...`)")
    with open(path, encoding="utf-8") as f:
        manifest = json.load(f)
    if manifest.get("format") != FORMAT:
        raise InputError(f"{path}: format {manifest.get('format')!r}, this code reads {FORMAT!r}")
    if manifest.get("analyzer") != analyzer.ANALYZER_NAME:
        raise InputError(f"{path}: built with analyzer {manifest.get('analyzer')!r}, queries would be analyzed"
                         f" with {analyzer.ANALYZER_NAME!r}; rebuild the index")
    return manifest


def folder_bytes(folder: str) -> int:
    """Total size in bytes of the files directly inside `folder`."""
    return sum(e.stat().st_size for e in os.scandir(folder) if e.is_file())


def _sorted_counts(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct values of `keys` ascending, and how often each occurs (a sort; faster than np.unique here)."""
    keys = np.sort(keys)
    starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]]) if len(keys) else np.zeros(0, np.int64)
    return keys[starts], np.diff(np.r_[starts, len(keys)])


class Bm25IndexWriter:
    """Streams documents into a new index folder: `add` each document, then `finish` (or `abort`).

    `chunk_docs` documents are processed at a time (the memory bound); `k1` and `b` are the BM25 parameters.
    """

    def __init__(self, out_dir: str, *, k1: float = 0.9, b: float = 0.4, chunk_docs: int = 100_000):
        if os.path.exists(out_dir):
            raise FileExistsError(f"{out_dir}: already exists; remove it or choose another output folder")
        if chunk_docs < 1:
            raise ValueError(f"chunk_docs must be >= 1, got {chunk_docs}")
        self.out_dir = out_dir
        self.k1, self.b, self.chunk_docs = float(k1), float(b), int(chunk_docs)
        self._dir = out_dir.rstrip("/") + ".partial"
        shutil.rmtree(self._dir, ignore_errors=True)
        os.makedirs(self._dir)
        self._docs = DocStoreWriter(self._dir)
        self._tokens = open(os.path.join(self._dir, TOKENS_TMP), "wb")
        self._vocab: dict[str, int] = {}
        self._doc_len = array.array("i")
        self._doc_freq = np.zeros(0, dtype=np.int64)
        self._chunk_terms = array.array("i")
        self._chunk_lens: list[int] = []

    def add(self, doc_id: str, contents: str) -> None:
        """Indexes one document (all of `contents`, title line included); it gets the next document number."""
        vocab = self._vocab
        terms = [vocab.setdefault(t, len(vocab)) for t in analyzer.analyze(contents)]
        self._docs.add(doc_id, contents)
        self._chunk_terms.extend(terms)
        self._chunk_lens.append(len(terms))
        if len(self._chunk_lens) >= self.chunk_docs:
            self._flush_chunk()

    def _flush_chunk(self) -> None:
        """Pass 1 for the buffered chunk: term numbers to disk, document frequencies counted."""
        if not self._chunk_lens:
            return
        terms = np.frombuffer(self._chunk_terms, dtype=np.int32)
        lens = np.asarray(self._chunk_lens, dtype=np.int64)
        terms.tofile(self._tokens)
        self._doc_len.extend(self._chunk_lens)
        num_terms = len(self._vocab)
        if len(self._doc_freq) < num_terms:
            self._doc_freq = np.concatenate([self._doc_freq, np.zeros(num_terms - len(self._doc_freq), np.int64)])
        if num_terms:
            doc_in_chunk = np.repeat(np.arange(len(lens), dtype=np.int64), lens)
            distinct, _ = _sorted_counts(doc_in_chunk * num_terms + terms)  # one per (document, term) pair
            self._doc_freq += np.bincount(distinct % num_terms, minlength=num_terms)
        self._chunk_terms = array.array("i")
        self._chunk_lens = []

    def finish(self) -> IndexStats:
        """Pass 2: writes score arrays, vocabulary and manifest, and moves the folder to `out_dir`."""
        self._flush_chunk()
        self._tokens.close()
        num_docs = self._docs.close()
        if num_docs == 0:
            raise ValueError(f"{self.out_dir}: no documents were added")
        if num_docs >= 2**31:
            raise ValueError(f"{num_docs} documents: int32 document numbers allow < 2**31 per index")
        doc_len = np.frombuffer(self._doc_len, dtype=np.int32).astype(np.int64)
        doc_freq = self._doc_freq
        num_postings = int(doc_freq.sum())
        if num_postings == 0:
            raise ValueError(f"{self.out_dir}: the documents contain no indexable terms (only stopwords?)")
        avg_doc_len = float(doc_len.mean())
        indptr = np.zeros(len(doc_freq) + 1, dtype=np.int64)
        np.cumsum(doc_freq, out=indptr[1:])
        self._write_postings(doc_len, doc_freq, indptr, avg_doc_len, num_docs, num_postings)
        os.remove(os.path.join(self._dir, TOKENS_TMP))
        np.save(os.path.join(self._dir, INDPTR_FILE), indptr)
        self._write_json(VOCAB_FILE, self._vocab)
        self._write_json(PARAMS_FILE, {
            "k1": self.k1, "b": self.b, "delta": 0.5, "method": "atire", "idf_method": "lucene",
            "dtype": "float32", "int_dtype": "int32", "num_docs": num_docs, "backend": "numpy"})
        self._write_json(MANIFEST_FILE, {
            "format": FORMAT, "analyzer": analyzer.ANALYZER_NAME, "k1": self.k1, "b": self.b,
            "num_docs": num_docs, "num_terms": len(self._vocab), "num_postings": num_postings,
            "avg_doc_len": avg_doc_len})
        os.rename(self._dir, self.out_dir)
        return IndexStats(num_docs=num_docs, num_terms=len(self._vocab), num_postings=num_postings,
                          avg_doc_len=avg_doc_len, bytes_on_disk=folder_bytes(self.out_dir))

    def _write_postings(self, doc_len, doc_freq, indptr, avg_doc_len, num_docs, num_postings) -> None:
        idf = np.log1p((num_docs - doc_freq + 0.5) / (doc_freq + 0.5))
        length_norm = self.k1 * (1.0 - self.b + self.b * doc_len / avg_doc_len)
        data = np.lib.format.open_memmap(os.path.join(self._dir, DATA_FILE), "w+", np.float32, (num_postings,))
        indices = np.lib.format.open_memmap(os.path.join(self._dir, INDICES_FILE), "w+", np.int32, (num_postings,))
        all_terms = np.memmap(os.path.join(self._dir, TOKENS_TMP), dtype=np.int32, mode="r")
        doc_start = np.zeros(num_docs + 1, dtype=np.int64)
        np.cumsum(doc_len, out=doc_start[1:])
        next_slot = indptr[:-1].copy()  # where each term's next pair goes
        for first in range(0, num_docs, self.chunk_docs):
            last = min(first + self.chunk_docs, num_docs)
            span = last - first
            terms = np.asarray(all_terms[doc_start[first]:doc_start[last]], dtype=np.int64)
            doc_in_chunk = np.repeat(np.arange(span, dtype=np.int64), doc_len[first:last])
            # Sorting (term, document) keys groups the chunk's pairs by term, documents ascending.
            keys, tf = _sorted_counts(terms * span + doc_in_chunk)
            term, doc = keys // span, keys % span + first
            if not len(term):  # only documents without indexable terms
                continue
            run_start = np.flatnonzero(np.r_[True, term[1:] != term[:-1]])
            run_len = np.diff(np.r_[run_start, len(term)])
            slot = next_slot[term] + (np.arange(len(term)) - np.repeat(run_start, run_len))
            next_slot[term[run_start]] += run_len
            data[slot] = idf[term] * tf * (self.k1 + 1.0) / (tf + length_norm[doc])
            indices[slot] = doc
        data.flush()
        indices.flush()
        del data, indices, all_terms

    def _write_json(self, name: str, obj) -> None:
        with open(os.path.join(self._dir, name), "w", encoding="utf-8") as f:
            json.dump(obj, f, ensure_ascii=False)

    def abort(self) -> None:
        """Drops the partial folder (after an error); the writer is unusable afterwards."""
        self._tokens.close()
        self._docs.discard()
        shutil.rmtree(self._dir, ignore_errors=True)
