"""Reading JSON-lines files record by record, with errors that name file:line.

`iter_jsonl` reads a file and stops at the first bad line. A reader with its own policy for bad lines (the corpus
reader of index_builder skips and counts them on request) builds on the two pieces it uses: `JsonlLines` (line
numbers, blank lines passed over) and `parse_object` (one line's JSON object, or the reason it is none).
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator

from etils import epath

from llds_jax.errors import InputError


def parse_object(raw: bytes) -> dict:
    """The JSON object on one line (UTF-8 bytes; its line ending is dropped first, so that a column in an error is
    one of this line, and a line cut inside a string reads "Unterminated string").

    Raises ValueError with the reason alone, for the caller to prefix with file:line: "not UTF-8 (...)",
    "invalid JSON (... at column N)" or "expected a JSON object, got <type>".
    """
    try:
        text = raw.rstrip(b"\r\n").decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 ({e.reason} at byte {e.start})") from e
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"invalid JSON ({e.msg} at column {e.colno})") from e
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    return record


class JsonlLines:
    """Iterates (1-based line number, raw bytes) over the non-blank lines of `lines` (a binary file or any
    iterable of byte lines). `line` is the number of the last line read, blank ones included: 0 before the first,
    and still 0 after iterating an empty file."""

    def __init__(self, lines: Iterable[bytes]):
        self._lines = lines
        self.line = 0

    def __iter__(self) -> Iterator[tuple[int, bytes]]:
        for number, raw in enumerate(self._lines, start=1):
            self.line = number
            if raw.strip():
                yield number, raw


def iter_jsonl(path: str | os.PathLike) -> Iterator[tuple[str, dict]]:
    """Yields ("<path>:<line>", record) for each non-blank line of a JSONL file (local or gs://).

    Raises ValueError "<path>:<line>: <reason>" (see `parse_object`) at the first line that is not UTF-8, not
    valid JSON or not a JSON object.
    """
    with epath.Path(path).open("rb") as f:
        for lineno, raw in JsonlLines(f):
            where = f"{path}:{lineno}"
            try:
                record = parse_object(raw)
            except ValueError as e:
                raise InputError(f"{where}: {e}") from None
            yield where, record
