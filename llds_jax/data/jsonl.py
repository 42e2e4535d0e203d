"""Reading JSON-lines files record by record, with errors that name file:line."""
from __future__ import annotations

import json
import os
from collections.abc import Iterator

from etils import epath


def iter_jsonl(path: str | os.PathLike) -> Iterator[tuple[str, dict]]:
    """Yields ("<path>:<line>", record) for each non-blank line of a JSONL file (local or gs://).

    Raises ValueError naming file:line for a line that is not valid JSON or not a JSON object.
    """
    with epath.Path(path).open("r", encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
            yield where, record
