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
  and exits 0. Searches in flight are abandoned (`requested`), never retried, once a stop is requested. The
  evaluation of the start and the final one (`defer(ABANDON_EVALUATION)`) poll it too but have nothing to save:
  the signal's log line says what the stop does (before issue 66 it said "checkpoint, then exit" where nothing was
  saved).

A second SIGINT raises KeyboardInterrupt at once, so Ctrl-C twice still aborts a hung run.

A StopRequested raised where Python calls back into Python code from C (JAX's garbage-collection callback
`_xla_gc_callback`, a `__del__`, a weakref callback) cannot propagate: Python hands it to `sys.unraisablehook`, which
printed "Exception ignored in ..." with a traceback, and drops it. While the guard is active its hook drops that
report and, RERAISE_S later, has a helper thread deliver SIGTERM to the main thread again (`_thread.interrupt_main`:
no signal leaves the process), whose handler raises the StopRequested again, by then outside the callback. Likewise
asyncio's report of a StopRequested that landed in its socket transport ("Fatal write error on socket transport",
a stop during the retriever's start-up check, which then fails as the stop) is dropped while the guard is active.

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

import _thread
import logging
import signal
import sys
import threading
import types

from llds_jax.runtime import distributed, storage

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)
RERAISE_S = 0.005  # seconds until a StopRequested that a callback dropped is raised again
SAVE_AND_EXIT = "checkpoint, then exit"  # what a stop in defer mode does: the training loop's
ABANDON_EVALUATION = "the evaluation is abandoned; nothing to save, then exit"  # an evaluation's without a step


class StopRequested(Exception):
    """A stop signal arrived while there was nothing to save (`phase`, e.g. "start-up"): the command ends with exit
    status 0 and the same command starts the work again."""

    def __init__(self, signal_name: str, phase: str):
        super().__init__(f"stopped by {signal_name} during {phase}: nothing to save; the same command starts again")
        self.signal_name, self.phase = signal_name, phase


class StepInterrupted(Exception):
    """A stop signal arrived in the middle of a training step; `phase` is "rollout", "updates" or "evaluation"."""

    def __init__(self, phase: str):
        super().__init__(phase)
        self.phase = phase


def _reports_no_stop(record: logging.LogRecord) -> bool:
    """False for a log record about a StopRequested (asyncio's report of the stop landing in its transport)."""
    return not (record.exc_info and isinstance(record.exc_info[1], StopRequested))


class PreemptionGuard:
    """Context manager that installs the SIGTERM/SIGINT handlers and restores the previous ones on exit. It starts
    in abort mode (`phase` names what runs, for the message); `defer()` switches to recording the signal."""

    def __init__(self, phase: str = "start-up"):
        self.signal_name: str | None = None  # name of the first signal received, e.g. "SIGTERM"
        self.phase = phase
        self._abort = True
        self._on_stop = SAVE_AND_EXIT  # what a stop in defer mode does, for the signal's log line
        self._aborted_phase: str | None = None  # the phase a signal in abort mode interrupted
        self._previous: dict[int, object] = {}
        self._previous_hook = sys.unraisablehook
        self._active = False
        self._dropped = False  # a StopRequested was dropped by a callback: the next SIGTERM raises it again

    def __enter__(self) -> "PreemptionGuard":
        for signum in SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        self._previous_hook, self._active = sys.unraisablehook, True
        sys.unraisablehook = self._unraisable
        logging.getLogger("asyncio").addFilter(_reports_no_stop)
        return self

    def reinstall(self) -> None:
        """Installs the handlers again, over those installed since (`jax.distributed.initialize` installs a
        SIGTERM handler of its own, which would otherwise take the signal); `__exit__` still restores the ones from
        before `__enter__`."""
        for signum in SIGNALS:
            signal.signal(signum, self._handle)

    def __exit__(self, exc_type, exc, traceback) -> None:
        self._active = False
        logging.getLogger("asyncio").removeFilter(_reports_no_stop)
        if sys.unraisablehook == self._unraisable:  # else a hook installed since forwards to ours, which forwards
            sys.unraisablehook = self._previous_hook
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

    def defer(self, on_stop: str = SAVE_AND_EXIT) -> None:
        """Defer mode: a signal is recorded for `should_stop()` and `requested`; the caller does `on_stop` (said in
        the signal's log line) and exits. Raises StopRequested if a signal came in abort mode and the code it
        landed in swallowed the exception."""
        if self._aborted_phase is not None:
            raise StopRequested(self.signal_name, self._aborted_phase)
        self._abort, self._on_stop = False, on_stop

    def _handle(self, signum: int, frame: types.FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self._dropped and signum == signal.SIGTERM:  # the guard's own delivery (`_unraisable`)
            self._dropped = False
            if self._active and not isinstance(sys.exc_info()[1], StopRequested):
                raise StopRequested(self.signal_name, self._aborted_phase)
            return
        if self.signal_name is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt(f"second signal ({name}) after {self.signal_name}")
        if self.signal_name is None:
            self.signal_name = name
            storage.stop_requested()  # storage operations get a few seconds more, not their whole timeout
            if self._abort:
                self._aborted_phase = self.phase
                raise StopRequested(name, self.phase)
            log.warning("received %s: stopping (%s)", name, self._on_stop)

    def _unraisable(self, unraisable) -> None:
        """sys.unraisablehook while the guard is active: a StopRequested a callback could not raise is raised again
        moments later (the module docstring), without a report; anything else goes to the previous hook."""
        if self._active and isinstance(unraisable.exc_value, StopRequested):
            self._dropped = True
            threading.Timer(RERAISE_S, _thread.interrupt_main, (signal.SIGTERM,)).start()
            return
        self._previous_hook(unraisable)

    @property
    def requested(self) -> bool:
        """Whether this process received a stop signal (no collective: enough to abandon work, e.g. searches)."""
        return self.signal_name is not None

    def should_stop(self) -> bool:
        """Whether any process received a stop signal; a collective, so every process calls it at every step."""
        return distributed.any_process(self.requested)
