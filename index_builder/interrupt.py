"""SIGINT during a build: a KeyboardInterrupt that reaches the build's own code, whatever the process inherited and
whatever Python runs when the signal arrives.

Two things let a build run on to its end after SIGINT. A process started with SIGINT ignored (a non-interactive
shell starts a background job `cmd &` so) keeps it ignored: Python installs no handler then. And a KeyboardInterrupt
raised where Python calls back into Python code from C (gc callbacks, `__del__` methods, weakref callbacks,
generator finalizers) is handed to `sys.unraisablehook`, which prints it ("Exception ignored in: ...") and drops
it; JAX, which `index_builder` imports for the e5 encoder, registers a gc callback, so a signal that came during a
garbage collection could be lost.

`sigint_interrupts` installs, for the block, a handler for SIGINT and SIGALRM that raises KeyboardInterrupt and, from
the first SIGINT on, keeps an interval timer of `RETRY_S` running until the block ends: each SIGALRM raises the
interrupt again, so one that was dropped (handed to the unraisable hook, which for a KeyboardInterrupt prints
nothing inside the block) or swallowed (a finalizer's `except BaseException: pass`, run by the same garbage
collection) is raised again moments later, by then out of the frame that lost it. (Sending SIGINT again would not
do: `signal.raise_signal` and `os.kill` run the handler at once, inside the same frame.) Once a KeyboardInterrupt is
being handled (the build's clean-up in `except`/`finally` blocks) the handler does nothing, so neither the timer nor
a second Ctrl-C cuts the clean-up short.
"""
from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType

RETRY_S = 0.005  # seconds between raisings of a pending KeyboardInterrupt (until the block ends)
_SIGNALS = (signal.SIGINT, signal.SIGALRM)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    """SIGINT's and SIGALRM's handler: KeyboardInterrupt, with the timer that raises it again started, unless one is
    being handled already (the clean-up)."""
    if not isinstance(sys.exc_info()[1], KeyboardInterrupt):
        signal.setitimer(signal.ITIMER_REAL, RETRY_S, RETRY_S)
        raise KeyboardInterrupt


def _quiet(previous: Callable) -> Callable:
    """An unraisable hook that drops a KeyboardInterrupt silently (the timer raises it again) and passes anything
    else to `previous`."""

    def hook(unraisable) -> None:
        if not isinstance(unraisable.exc_value, KeyboardInterrupt):
            previous(unraisable)

    return hook


@contextlib.contextmanager
def sigint_interrupts() -> Iterator[None]:
    """Inside the block SIGINT raises KeyboardInterrupt in the code it interrupts (see the module docstring), even
    when the process started with SIGINT ignored; the handlers and `sys.unraisablehook` are restored after and the
    timer stopped. Off the main thread (where Python handles no signals) the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handlers = {signum: signal.signal(signum, _interrupt) for signum in _SIGNALS}
    hook, sys.unraisablehook = sys.unraisablehook, _quiet(sys.unraisablehook)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        sys.unraisablehook = hook
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
