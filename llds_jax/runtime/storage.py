"""The run's writes to storage (checkpoints, metrics, the run folder's lease) as bounded operations with one-line
failures.

Storage fails in two ways a long run must survive without losing what it saved (docs/reliability.md):
- **it refuses** (a GCS endpoint that died, a disk that filled up or became read-only): the error of a write, which
  orbax, gcsfs or tensorstore word in many lines from several threads (gcsfs's own log of each failed request is
  dropped: `_ReraisedRequestErrors`), becomes one `StorageError` naming the
  operation, the path, where it lives (the GCS endpoint) and the reason; the command prints it as one line and
  exits with status 2. Checkpoints are written into a temporary folder and renamed when complete, so the earlier
  steps stay intact and the same command resumes from the newest complete one.
- **it stops answering** (a hung GCS endpoint: the clients' own retries and timeouts add up to many minutes): an
  operation that has not ended after `timeout_s` seconds (the run config's `train.storage_timeout_s`, 120 by
  default) ends the process from a monitor thread, with one line and exit status 2, since the thread that waits
  for storage cannot be interrupted. Once a stop signal arrived (`stop_requested`), operations get at most
  STOP_GRACE_S seconds more: a spot VM gives about 30 s.
An operation begun while a StorageError is being handled (a write on the way out of the failed run: the metrics'
last flush, releasing the run folder's lease) gets at most AFTER_FAILURE_S seconds, and if it does not end by then
the process ends with the failure's own line; but a checkpoint save in flight (`saves_state`) keeps its whole
timeout, counted from the save's start (`work_began`): it is what the run resumes from. Before, every such write
waited its whole timeout from its own start (a run whose endpoint died ended 154 s after it in CI, at the default
120 s: a metrics write failed after the clients' retries, then the wait for the save in flight began its 120 s).

Usage:
  with storage.operation("saving checkpoint step 3", path, timeout_s=120):
      ...  # any exception becomes StorageError; a hang ends the process after 120 s
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import NamedTuple, Optional

from llds_jax.runtime import gcs

STOP_GRACE_S = 20.0  # seconds an operation may still take once a stop signal arrived
AFTER_FAILURE_S = 5.0  # seconds for an operation begun while a StorageError is being handled
EXIT_STATUS = 2  # as the command's other one-line errors
_POLL_S = 0.25


class StorageError(OSError):
    """A storage operation of the run failed; the message names the operation, the path and its location, and why."""


class _ReraisedRequestErrors(logging.Filter):
    """Drops gcsfs's record of a request error that it raises anyway (its retry loop logs "<request> out of retries
    on exception" or "non-retriable exception" with the traceback, then raises): the storage operation that made
    the request reports the error once (`operation`), while these records repeated it with a traceback per request
    for as long as the clients retried a dead endpoint (about 100 s at the default `train.storage_timeout_s`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("out of retries on exception" in message or "non-retriable exception" in message)


logging.getLogger("gcsfs").addFilter(_ReraisedRequestErrors())


def where(path: str | os.PathLike) -> str:
    """`path` with where it lives: a gs:// path names the GCS endpoint (the emulator's in tests)."""
    path = os.fspath(path)
    return f"{path} (Google Cloud Storage at {gcs.endpoint()})" if gcs.is_gcs(path) else path


def reason(error: BaseException) -> str:
    """The first line of an error with its type; an OSError by its strerror (e.g. "No space left on device")."""
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def error_line(failure: StorageError) -> str:
    """The command's one line for a failed storage operation."""
    return f"llds_jax: error: {failure}; the same command resumes from the newest complete checkpoint"


class _Operation(NamedTuple):
    what: str
    path: str
    started: float  # time.monotonic()
    timeout_s: float
    failure: Optional[StorageError]  # the failure being handled when it began: the line to end with


class _Monitor:
    """The operations in progress, and a daemon thread that ends the process when one overruns its deadline."""

    def __init__(self):
        self.lock = threading.Lock()
        self.operations: dict[int, _Operation] = {}
        self.ids = itertools.count()
        self.stop_at: Optional[float] = None  # time.monotonic() of the stop signal
        self.thread: Optional[threading.Thread] = None

    def begin(self, operation: _Operation) -> int:
        with self.lock:
            key = next(self.ids)
            self.operations[key] = operation
            if self.thread is None:
                self.thread = threading.Thread(target=self.watch, name="storage-deadlines", daemon=True)
                self.thread.start()
        return key

    def end(self, key: int) -> None:
        with self.lock:
            self.operations.pop(key, None)

    def deadline(self, operation: _Operation) -> float:
        deadline = operation.started + operation.timeout_s
        if self.stop_at is not None:
            deadline = min(deadline, max(self.stop_at, operation.started) + STOP_GRACE_S)
        return deadline

    def watch(self) -> None:
        while True:
            time.sleep(_POLL_S)
            now = time.monotonic()
            with self.lock:
                overdue = [op for op in self.operations.values() if now >= self.deadline(op)]
            if overdue:
                _expire(overdue[0], now)


_MONITOR = _Monitor()


def _expire(operation: _Operation, now: float) -> None:
    """Ends the process, exit status 2, with one line: naming the operation that stopped answering, or the failure
    it was begun on the way out of."""
    if operation.failure is None:
        after_stop = "" if _MONITOR.stop_at is None else " (a stop was requested: nothing more can be saved)"
        failure = StorageError(f"{operation.what} {where(operation.path)}: no answer within "
                               f"{now - operation.started:.0f} s{after_stop}")
    else:
        failure = operation.failure
    print(error_line(failure), file=sys.stderr, flush=True)
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    os._exit(EXIT_STATUS)


def stop_requested() -> None:
    """Called when a stop signal arrives: every operation, running or later, gets at most STOP_GRACE_S seconds."""
    if _MONITOR.stop_at is None:
        _MONITOR.stop_at = time.monotonic()


def clear_stop_request() -> None:
    """Gives operations their whole timeout again (the signal handlers that called stop_requested are gone)."""
    _MONITOR.stop_at = None


@contextlib.contextmanager
def operation(what: str, path: str | os.PathLike, timeout_s: float, convert: bool = True,
              saves_state: bool = False, work_began: Optional[float] = None) -> Iterator[None]:
    """Runs the block as the storage operation `what` on `path`: a block running longer than `timeout_s` ends the
    process; with `convert`, any exception it raises becomes StorageError ("{what} {where(path)} failed:
    {reason}"), else it passes unchanged (a reader that judges its errors itself, e.g. Checkpointer.restore_latest).

    Begun while a StorageError is being handled (on the way out of the failed run), it gets at most AFTER_FAILURE_S
    seconds, unless it `saves_state` (a checkpoint's): then its timeout counts from `work_began` (time.monotonic()
    when the work it waits for began: a background save), but leaves it at least AFTER_FAILURE_S seconds."""
    now = time.monotonic()
    started, failure = now, None
    handling = sys.exc_info()[1]
    if isinstance(handling, StorageError):
        if not saves_state:
            failure, timeout_s = handling, min(timeout_s, AFTER_FAILURE_S)
        elif work_began is not None:
            started = min(now, max(work_began, now - timeout_s + AFTER_FAILURE_S))
    key = _MONITOR.begin(_Operation(what, os.fspath(path), started, timeout_s, failure))
    try:
        yield
    except StorageError:
        raise
    except Exception as e:  # noqa: BLE001 - orbax, gcsfs and tensorstore raise many types for one failed write
        if not convert:
            raise
        raise StorageError(f"{what} {where(path)} failed: {reason(e)}") from e
    finally:
        _MONITOR.end(key)
