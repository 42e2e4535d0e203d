"""Reads a wiki-18 style corpus: JSON lines `{"id": "0", "contents": "\\"Title\\"\\nbody"}`, plain or gzip.

Every passage carries its line number; a malformed line raises `CorpusError` whose message starts with `file:line:`
and says why, or, with `skip_bad`, is counted and logged instead. Blank lines are ignored; a corpus without any
passage raises `CorpusError` once read. Ids may be JSON strings or integers (stored as strings); other fields on a
line are ignored.
"""
from __future__ import annotations

import dataclasses
import gzip
import logging
import os
from collections.abc import Iterator

from llds_jax.data.jsonl import JsonlLines, parse_object

log = logging.getLogger(__name__)
_GZIP_MAGIC = b"\x1f\x8b"
_LOGGED_SKIPS = 10  # skipped lines logged one by one; the rest are only counted


@dataclasses.dataclass(frozen=True)
class Passage:
    """One corpus line: passage `id`, `contents` (title line + text) and its 1-based `line` number."""

    id: str
    contents: str
    line: int


class CorpusError(ValueError):
    """A malformed corpus line; the message is `file:line: reason`."""


def parse_line(raw: bytes) -> tuple[str, str]:
    """(id, contents) of one corpus line; raises ValueError with the reason when it is malformed."""
    record = parse_object(raw)
    for key in ("id", "contents"):
        if key not in record:
            raise ValueError(f'missing key "{key}"')
    doc_id, contents = record["id"], record["contents"]
    if isinstance(doc_id, bool) or not isinstance(doc_id, (str, int)):
        raise ValueError(f'"id" must be a string or integer, got {type(doc_id).__name__}')
    if not isinstance(contents, str):
        raise ValueError(f'"contents" must be a string, got {type(contents).__name__}')
    return str(doc_id), contents


class CorpusReader:
    """Iterates the passages of `path` once; `position` and `size` (bytes of the file on disk) measure progress."""

    def __init__(self, path: str, *, skip_bad: bool = False):
        self.path = path
        self.skip_bad = skip_bad
        self.size = os.path.getsize(path)
        self.skipped = 0
        self._raw = open(path, "rb")
        self._compressed = self._raw.read(2) == _GZIP_MAGIC
        self._raw.seek(0)

    @property
    def position(self) -> int:
        """Bytes of the file (compressed bytes for .gz) consumed so far."""
        return self.size if self._raw.closed else self._raw.tell()

    def __iter__(self) -> Iterator[Passage]:
        stream = gzip.GzipFile(fileobj=self._raw, mode="rb") if self._compressed else self._raw
        lines = JsonlLines(stream)
        passages = 0
        try:
            for number, raw in lines:
                try:
                    doc_id, contents = parse_line(raw)
                except ValueError as e:
                    where = f"{self.path}:{number}: {e}"
                    if not self.skip_bad:
                        raise CorpusError(f"{where} (pass --skip-bad to skip malformed lines)") from e
                    self.skipped += 1
                    if self.skipped <= _LOGGED_SKIPS:
                        log.warning("skipped %s", where)
                    continue
                passages += 1
                yield Passage(doc_id, contents, number)
        except (OSError, EOFError) as e:  # a truncated or corrupt .gz
            raise CorpusError(f"{self.path}: cannot read past line {lines.line}: {e}") from e
        finally:
            self.close()
        if not passages:
            why = (f"all {self.skipped} non-blank lines are malformed" if self.skipped else
                   "the file is empty" if lines.line == 0 else "it has only blank lines")
            raise CorpusError(f"{self.path}: no passages to index ({why})")

    def close(self) -> None:
        self._raw.close()
