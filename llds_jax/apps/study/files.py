"""A report's files: its markdown table and its JSON records, side by side in the report folder."""
from __future__ import annotations

import json
import os
from typing import Any


def write_markdown_and_json(out: str, stem: str, lines: list[str], records: Any) -> list[str]:
    """Writes `stem`.md (`lines`, one per line) and `stem`.json (`records`, indented) into `out`; returns their
    paths."""
    os.makedirs(out, exist_ok=True)
    paths = [os.path.join(out, f"{stem}.{ext}") for ext in ("md", "json")]
    with open(paths[0], "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(paths[1], "w") as f:
        json.dump(records, f, indent=2)
    return paths
