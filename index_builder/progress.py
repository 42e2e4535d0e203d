"""The build progress bar: tqdm over the corpus bytes (so the ETA is right), with documents and docs/s shown."""
from __future__ import annotations

import time

from tqdm import tqdm


class Progress:
    """Call `advance(position)` after each document with the reader's byte position; `close` at the end."""

    def __init__(self, total_bytes: int, desc: str, *, every_docs: int = 1000):
        self._bar = tqdm(total=total_bytes, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                         mininterval=0.5, dynamic_ncols=True)
        self._every = every_docs
        self._start = time.monotonic()
        self._shown = 0
        self.docs = 0

    def advance(self, position: int) -> None:
        self.docs += 1
        if self.docs % self._every == 0:
            self._show(position)

    def _show(self, position: int) -> None:
        rate = self.docs / max(time.monotonic() - self._start, 1e-9)
        self._bar.set_postfix_str(f"{self.docs:,} docs, {rate:,.0f} docs/s", refresh=False)
        self._bar.update(position - self._shown)
        self._shown = position

    def close(self, position: int) -> None:
        self._show(position)
        self._bar.close()
