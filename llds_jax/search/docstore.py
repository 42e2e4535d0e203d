"""The document store of an embedded index: passages on disk, read back one at a time by number.

Layout inside the index folder:
- `docs.jsonl`: one `{"id": str, "contents": str}` JSON object per line, in index order (document number 0, 1, ...).
- `doc_offsets.npy`: int64 byte offsets of each line start in `docs.jsonl`, plus the file size at the end
  (length num_docs + 1), loaded memory-mapped.

Nothing but the offsets' pages is held in RAM: `DocStore.get` reads one line with `os.pread` (thread-safe).
`DocStore.max_record_bytes` bounds what any document's `{"id": ..., "contents": ...}` JSON takes (the retrieval
server's response estimate), from the offsets alone.

`DocStore.of_corpus` opens a wiki-18 JSONL file itself the same way (row i = line i, as faiss rows of Search-R1's
e5 index are): its line offsets are computed in one streaming pass and cached next to it as `FILE.offsets.npy`.
"""
from __future__ import annotations

import array
import functools
import json
import logging
import os

import numpy as np

from llds_jax.errors import InputError

DOCS_FILE = "docs.jsonl"
OFFSETS_FILE = "doc_offsets.npy"
CORPUS_OFFSETS_SUFFIX = ".offsets.npy"
_GZIP_MAGIC = b"\x1f\x8b"
_SCAN_BYTES = 64 << 20
_OFFSETS_PER_SCAN = 1 << 20  # offsets read at a time by `longest_line` (8 MiB)
# How much longer than its corpus line (newline included, if any) a document's record can be once re-encoded: an
# integer id gains its quotes (2) and a compact line the spaces after ":" (2) and "," (1); strings never grow.
_CORPUS_RECORD_SLACK = 5

log = logging.getLogger(__name__)


def line_offsets(path: str) -> np.ndarray:
    """int64 byte offsets of each line start of the file `path`, plus its size at the end (a last line without a
    newline still counts). One streaming pass, `_SCAN_BYTES` at a time."""
    starts = [np.zeros(1, np.int64)]
    position = 0
    with open(path, "rb") as f:
        while chunk := f.read(_SCAN_BYTES):
            newlines = np.flatnonzero(np.frombuffer(chunk, np.uint8) == ord("\n"))
            starts.append(newlines.astype(np.int64) + position + 1)
            position += len(chunk)
    offsets = np.concatenate(starts)
    if offsets[-1] != position:  # no newline at the end: the last line ends at the file's end
        offsets = np.append(offsets, position)
    return offsets


def longest_line(offsets: np.ndarray) -> int:
    """The largest gap between consecutive `offsets` (bytes of the longest line, its newline included); 0 for none.
    Reads `_OFFSETS_PER_SCAN` offsets at a time, so a memory-mapped array is never copied whole."""
    return max((int(np.diff(offsets[i:i + _OFFSETS_PER_SCAN + 1]).max())
                for i in range(0, len(offsets) - 1, _OFFSETS_PER_SCAN)), default=0)


class DocStoreWriter:
    """Appends documents to `folder`/docs.jsonl; `close` writes the offsets file."""

    def __init__(self, folder: str):
        self._path = os.path.join(folder, DOCS_FILE)
        self._offsets_path = os.path.join(folder, OFFSETS_FILE)
        self._file = open(self._path, "wb")
        self._offsets = array.array("q", [0])

    def add(self, doc_id: str, contents: str) -> None:
        """Appends one document (it gets the next document number)."""
        line = json.dumps({"id": doc_id, "contents": contents}, ensure_ascii=False).encode("utf-8") + b"\n"
        self._file.write(line)
        self._offsets.append(self._offsets[-1] + len(line))

    def close(self) -> int:
        """Finishes the store; returns the number of documents written."""
        self._file.close()
        np.save(self._offsets_path, np.frombuffer(self._offsets, dtype=np.int64))
        return len(self._offsets) - 1

    def discard(self) -> None:
        """Closes the file without writing offsets (the build failed; the caller removes the folder)."""
        self._file.close()


class DocStore:
    """Read access to a folder's document store."""

    def __init__(self, folder: str):
        self._open(os.path.join(folder, DOCS_FILE), np.load(os.path.join(folder, OFFSETS_FILE), mmap_mode="r"),
                   f"{OFFSETS_FILE} expects", "the index folder is incomplete or was modified",
                   record_slack=-1)  # each line is exactly a record (DocStoreWriter) and its newline

    @classmethod
    def of_corpus(cls, path: str) -> DocStore:
        """The rows of a plain (not gzip) JSONL corpus, row i = line i. The offsets are read from `path` +
        ".offsets.npy" when it matches the file's size, else computed and saved there (kept in memory only when
        the folder is not writable)."""
        with open(path, "rb") as f:
            if f.read(2) == _GZIP_MAGIC:
                raise InputError(f"{path}: rows are read by byte offset, which a gzip file does not allow;"
                                 " decompress it (gunzip -k)")
        cache = path + CORPUS_OFFSETS_SUFFIX
        offsets = np.load(cache, mmap_mode="r") if os.path.exists(cache) else None
        if offsets is None or int(offsets[-1]) != os.path.getsize(path):
            log.info("%s: indexing line offsets (one pass over the file)", path)
            offsets = line_offsets(path)
            try:
                np.save(cache, offsets)
            except OSError as e:
                log.warning("cannot cache the line offsets at %s (%s); they stay in memory", cache, e.strerror)
        store = cls.__new__(cls)
        store._open(path, offsets, "its line offsets expect", "the corpus changed while they were read",
                    record_slack=_CORPUS_RECORD_SLACK)
        return store

    def _open(self, path: str, offsets: np.ndarray, expects: str, why: str, *, record_slack: int) -> None:
        self._offsets = offsets
        self._record_slack = record_slack  # max_record_bytes - longest line (bytes)
        self._fd = os.open(path, os.O_RDONLY)
        size = os.fstat(self._fd).st_size
        if int(self._offsets[-1]) != size:
            os.close(self._fd)
            raise InputError(f"{path}: {size} bytes but {expects} {int(self._offsets[-1])} ({why})")

    def __len__(self) -> int:
        return len(self._offsets) - 1

    @functools.cached_property
    def max_record_bytes(self) -> int:
        """Upper bound, in bytes, of `json.dumps({"id": id, "contents": contents}, ensure_ascii=False)` in UTF-8 for
        any document `get` returns: exact (the longest record) for an index folder's store; for a corpus, its
        longest line + 5, which holds for lines of wiki-18's shape (a string or integer id, string contents). One
        pass over the offsets (168 MB at wiki-18's 21M lines), on first use."""
        return longest_line(self._offsets) + self._record_slack

    def get(self, number: int) -> tuple[str, str]:
        """(id, contents) of document `number` (0-based index order)."""
        start, end = int(self._offsets[number]), int(self._offsets[number + 1])
        record = json.loads(os.pread(self._fd, end - start, start))
        return str(record["id"]), record["contents"]

    def close(self) -> None:
        os.close(self._fd)
