"""The document store of an embedded index: passages on disk, read back one at a time by number.

Layout inside the index folder:
- `docs.jsonl`: one `{"id": str, "contents": str}` JSON object per line, in index order (document number 0, 1, ...).
- `doc_offsets.npy`: int64 byte offsets of each line start in `docs.jsonl`, plus the file size at the end
  (length num_docs + 1), loaded memory-mapped.

Nothing but the offsets' pages is held in RAM: `DocStore.get` reads one line with `os.pread` (thread-safe).
"""
from __future__ import annotations

import array
import json
import os

import numpy as np

DOCS_FILE = "docs.jsonl"
OFFSETS_FILE = "doc_offsets.npy"


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
        path = os.path.join(folder, DOCS_FILE)
        self._offsets = np.load(os.path.join(folder, OFFSETS_FILE), mmap_mode="r")
        self._fd = os.open(path, os.O_RDONLY)
        size = os.fstat(self._fd).st_size
        if int(self._offsets[-1]) != size:
            os.close(self._fd)
            raise ValueError(f"{path}: {size} bytes but {OFFSETS_FILE} expects {int(self._offsets[-1])}"
                             " (the index folder is incomplete or was modified)")

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def get(self, number: int) -> tuple[str, str]:
        """(id, contents) of document `number` (0-based index order)."""
        start, end = int(self._offsets[number]), int(self._offsets[number + 1])
        record = json.loads(os.pread(self._fd, end - start, start))
        return record["id"], record["contents"]

    def close(self) -> None:
        os.close(self._fd)
