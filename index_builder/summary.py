"""What a build reports at the end."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class BuildSummary:
    """Counts of one run: `docs_indexed` new this run, `docs_already_present` (skipped on an Elasticsearch resume),
    `lines_skipped` (malformed, with --skip-bad); `seconds` wall time; `index_docs` and `index_bytes` of the whole
    index afterwards; `location` the folder or host/index."""

    location: str
    docs_indexed: int
    docs_already_present: int
    lines_skipped: int
    seconds: float
    index_docs: int
    index_bytes: int

    def format(self) -> str:
        rate = self.docs_indexed / self.seconds if self.seconds > 0 else 0.0
        lines = [
            f"index: {self.location}",
            f"documents indexed this run: {self.docs_indexed:,} in {self.seconds:.1f} s ({rate:,.0f} docs/s)",
        ]
        if self.docs_already_present:
            lines.append(f"documents already present (resume): {self.docs_already_present:,}")
        lines.append(f"malformed lines skipped: {self.lines_skipped:,}")
        lines.append(f"index now holds {self.index_docs:,} documents, {self.index_bytes / 2**20:,.1f} MiB")
        return "\n".join(lines)
