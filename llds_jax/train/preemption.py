"""Graceful stop on SIGTERM (TPU maintenance, spot preemption, `kill`) and SIGINT (Ctrl-C).

The handler only records the signal; the training loop polls `guard.should_stop()` once per step, saves a
checkpoint and exits 0. A second SIGINT raises KeyboardInterrupt at once, so Ctrl-C twice still aborts a hung run.

Usage:
  with PreemptionGuard() as guard:
      for step in ...:
          ...
          if guard.should_stop():
              checkpointer.save(step, ...); checkpointer.wait_until_finished()
              break
"""
from __future__ import annotations

import logging
import signal
import types

from llds_jax import distributed

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class PreemptionGuard:
    """Context manager that installs the SIGTERM/SIGINT handlers and restores the previous ones on exit."""

    def __init__(self):
        self.signal_name: str | None = None  # name of the first signal received, e.g. "SIGTERM"
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "PreemptionGuard":
        for signum in SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc_info) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: types.FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signal_name is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt(f"second signal ({name}) after {self.signal_name}")
        if self.signal_name is None:
            self.signal_name = name
            log.warning("received %s: stopping after this step (checkpoint, then exit)", name)

    @property
    def requested(self) -> bool:
        """Whether this process received a stop signal."""
        return self.signal_name is not None

    def should_stop(self) -> bool:
        """Whether any process received a stop signal; a collective, so every process calls it at every step."""
        return distributed.any_process(self.requested)
