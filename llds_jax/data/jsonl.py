"""Reading JSON-lines files record by record, with errors that name file:line."""
from __future__ import annotations

import json
import os
from collections.abc import Iterator

from etils import epath


def iter_jsonl(path: str | os.PathLike) -> Iterator[tuple[str, dict]]:
    """Yields ("<path>:<line>", record) for each non-blank line of a JSONL file (local or gs://).

    Raises ValueError naming file:line for a line that is not UTF-8, not valid JSON or not a JSON object.
    """
    with epath.Path(path).open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{where}: not UTF-8 ({e.reason} at byte {e.start})") from None
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
            yield where, record
