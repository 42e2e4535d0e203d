"""Graceful stop on SIGTERM (TPU maintenance, spot preemption, `kill`) and SIGINT (Ctrl-C).

A spot VM gets about 30 s from the notice to the kill, so a stop must end the process within seconds in every
phase of a run (docs/reliability.md). The guard is installed when the command starts and is in one of two modes:

- **abort** (start-up, loading, the retriever's start-up check, the evaluation of the start, eval and export
  modes): there is no state worth saving (a rerun repeats the work), so the signal raises `StopRequested` in the
  main thread at once; the command ends with exit status 0. Library code may catch it where it lands and raise
  an error of its own (asyncio's socket transports fail the connection with it, and the retriever's check then
  reports an unusable backend): any error that leaves the guard after such a signal ends as `StopRequested`.
- **defer** (the training loop, `defer()`): the handler only records the signal; the loop polls
  `guard.should_stop()` between sampler sessions, between updates and at the end of each step, saves a checkpoint
  and exits 0. Searches in flight are abandoned (`requested`), never retried, once a stop is requested.

A second SIGINT raises KeyboardInterrupt at once, so Ctrl-C twice still aborts a hung run.

Usage:
  with PreemptionGuard() as guard:
      ... start-up: a signal raises StopRequested ...
      guard.defer()
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

from llds_jax import distributed, storage

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequested(Exception):
    """A stop signal arrived while there was nothing to save (`phase`, e.g. "start-up"): the command ends with exit
    status 0 and the same command starts the work again."""

    def __init__(self, signal_name: str, phase: str):
        super().__init__(f"stopped by {signal_name} during {phase}: nothing to save; the same command starts again")
        self.signal_name, self.phase = signal_name, phase


class PreemptionGuard:
    """Context manager that installs the SIGTERM/SIGINT handlers and restores the previous ones on exit. It starts
    in abort mode (`phase` names what runs, for the message); `defer()` switches to recording the signal."""

    def __init__(self, phase: str = "start-up"):
        self.signal_name: str | None = None  # name of the first signal received, e.g. "SIGTERM"
        self.phase = phase
        self._abort = True
        self._aborted_phase: str | None = None  # the phase a signal in abort mode interrupted
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "PreemptionGuard":
        for signum in SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def reinstall(self) -> None:
        """Installs the handlers again, over those installed since (`jax.distributed.initialize` installs a
        SIGTERM handler of its own, which would otherwise take the signal); `__exit__` still restores the ones from
        before `__enter__`."""
        for signum in SIGNALS:
            signal.signal(signum, self._handle)

    def __exit__(self, exc_type, exc, traceback) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
        storage.clear_stop_request()
        if (self._aborted_phase is not None and isinstance(exc, Exception)
                and not isinstance(exc, StopRequested)):  # the stop, turned into another error where it landed
            raise StopRequested(self.signal_name, self._aborted_phase) from exc

    def abort_during(self, phase: str) -> None:
        """Abort mode for `phase` (nothing to save): a signal raises StopRequested, at once if one came already."""
        self.phase, self._abort = phase, True
        if self.signal_name is not None:
            self._aborted_phase = phase
            raise StopRequested(self.signal_name, phase)

    def defer(self) -> None:
        """Defer mode: a signal is recorded for `should_stop()` and `requested`; the caller saves and exits.
        Raises StopRequested if a signal came in abort mode and the code it landed in swallowed the exception."""
        if self._aborted_phase is not None:
            raise StopRequested(self.signal_name, self._aborted_phase)
        self._abort = False

    def _handle(self, signum: int, frame: types.FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signal_name is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt(f"second signal ({name}) after {self.signal_name}")
        if self.signal_name is None:
            self.signal_name = name
            storage.stop_requested()  # storage operations get a few seconds more, not their whole timeout
            if self._abort:
                self._aborted_phase = self.phase
                raise StopRequested(name, self.phase)
            log.warning("received %s: stopping (checkpoint, then exit)", name)

    @property
    def requested(self) -> bool:
        """Whether this process received a stop signal (no collective: enough to abandon work, e.g. searches)."""
        return self.signal_name is not None

    def should_stop(self) -> bool:
        """Whether any process received a stop signal; a collective, so every process calls it at every step."""
        return distributed.any_process(self.requested)
