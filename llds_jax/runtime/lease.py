"""One writer per output folder: a lease file that a run (or an index build) holds while it writes.

Two runs on one run folder would both resume, both write checkpoints and interleave their metrics; two index builds
on one `--out` would write over each other. So the writer first takes the folder's lease: a small JSON file
(`{"host", "pid", "start_ticks", "started", "heartbeat", "token"}`, times in unix seconds) written where the
folder lives (local or gs://), refreshed every `heartbeat_s` seconds by a background thread and deleted at the
end. A second writer finds it and stops with `LeaseHeldError` naming the holder.

A lease is stale, and taken over with a warning, when its holder is gone:
- on the same host (same host name): its process no longer runs (pid, and its start time in /proc where there is
  one, so a reused pid is not taken for the holder);
- from another host: its heartbeat is older than `stale_after_s` (default 120 s: a run killed with `kill -9` or a
  lost VM keeps its folder for that long; a stop with SIGTERM/SIGINT releases the lease at once).

Taking the lease is also the check that the folder is writable, made before anything heavy is loaded
(`FolderNotWritableError`). GCS offers no atomic create through the clients used here, so two writers starting
within the same second may both write the lease; each reads its write back and the one that lost stops. Local
folders use an exclusive create.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Optional

from etils import epath

from llds_jax.runtime import storage

log = logging.getLogger(__name__)

HEARTBEAT_S = 30.0
STALE_AFTER_S = 120.0


class LeaseHeldError(RuntimeError):
    """Another live process holds the folder's lease; the message names it."""


class FolderNotWritableError(OSError):
    """The folder (or its lease file) cannot be created or written; the message names the folder and the reason."""


def process_start_ticks(pid: int) -> Optional[int]:
    """The start time of process `pid` in clock ticks since boot (/proc/PID/stat field 22), or None where there is
    no /proc or no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def process_alive(pid: int, start_ticks: Optional[int]) -> bool:
    """Whether process `pid` of this host runs and, when `start_ticks` is known, is the one that started then."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        pass
    return start_ticks is None or process_start_ticks(pid) in (None, start_ticks)


class Lease:
    """`with Lease(path, what="run folder gs://b/r"):` holds the lease file `path` for the block.

    Args:
      path: the lease file (local or gs://); its folder is created.
      what: how messages name the folder, e.g. "run_dir /runs/x".
      heartbeat_s: seconds between refreshes of the heartbeat.
      stale_after_s: seconds after which another host's lease without a heartbeat is stale.
      timeout_s: seconds taking or releasing the lease may take before the process ends (llds_jax.runtime.storage).
    """

    def __init__(self, path: str | os.PathLike, what: str, timeout_s: float, heartbeat_s: float = HEARTBEAT_S,
                 stale_after_s: float = STALE_AFTER_S):
        self.path = epath.Path(path)
        self.what, self.timeout_s = what, timeout_s
        self.heartbeat_s, self.stale_after_s = heartbeat_s, stale_after_s
        self.record = {"host": socket.gethostname(), "pid": os.getpid(),
                       "start_ticks": process_start_ticks(os.getpid()), "started": time.time(),
                       "heartbeat": time.time(), "token": uuid.uuid4().hex}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._overwrite = False  # the last `holder()` found an unreadable or impossible lease file

    def __enter__(self) -> "Lease":
        self.acquire()
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()

    def holder(self, take_over: bool = True) -> Optional[dict]:
        """The record of the lease file; None when there is none, and also when it is unreadable or impossible (a
        write cut short by a full disk, a heartbeat that is not a number or lies in the future): such a lease
        holds nothing, and the caller overwrites it (with one warning line).

        take_over False (the release): a file that cannot be read raises its OSError (storage that stopped
        answering), and an impossible record is None without a warning."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return None
        except OSError as e:
            if not take_over:
                raise
            return self._impossible(str(e))
        try:
            record = json.loads(text)
        except ValueError:
            return self._impossible("empty" if not text.strip() else "not JSON") if take_over else None
        problem = self._problem(record)
        if problem is None:
            return record
        return self._impossible(problem) if take_over else None

    def _problem(self, record: object) -> Optional[str]:
        """What makes a lease record impossible (None: nothing)."""
        if not isinstance(record, dict):
            return f"not a record: {str(record)[:60]}"
        for key in ("started", "heartbeat"):
            value = record.get(key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
                return f"{key} is not a time: {str(value)[:60]!r}"
        if not isinstance(record.get("pid"), int) or not isinstance(record.get("host"), str):
            return f"no pid and host: {str(record)[:100]}"
        if record["heartbeat"] - time.time() > self.stale_after_s:
            return f"its heartbeat is {record['heartbeat'] - time.time():.0f} s in the future"
        return None

    def _impossible(self, problem: str) -> None:
        self._overwrite = True
        log.warning("%s: unreadable lease file %s (%s): taking it over", self.what, self.path, problem)
        return None

    def is_live(self, record: dict) -> bool:
        """Whether the holder of `record` still runs (see the module docstring)."""
        if record.get("host") == self.record["host"] and isinstance(record.get("pid"), int):
            return process_alive(record["pid"], record.get("start_ticks"))
        return time.time() - float(record.get("heartbeat", 0)) < self.stale_after_s

    def describe(self, record: dict) -> str:
        """"pid P on host H (started <UTC time>, last heartbeat N s ago)"."""
        started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(record.get("started", 0))))
        beat = time.time() - float(record.get("heartbeat", 0))
        return (f"pid {record.get('pid')} on host {record.get('host')} (started {started}, last heartbeat "
                f"{beat:.0f} s ago)")

    def acquire(self) -> None:
        """Takes the lease or raises LeaseHeldError (a live holder) or FolderNotWritableError."""
        with storage.operation("taking the lease", self.path, self.timeout_s, convert=False):
            self._acquire()
        self._thread = threading.Thread(target=self._beat, name="lease-heartbeat", daemon=True)
        self._thread.start()

    def _acquire(self) -> None:
        make_folder(self.path.parent, self.what)
        self._overwrite = False
        current = self.holder()
        if current is not None and current.get("token") != self.record["token"]:
            if self.is_live(current):
                raise self._held(current)
            log.warning("%s: taking over the lease of %s: that process is gone", self.what, self.describe(current))
            self._write(exclusive=False)
        else:
            self._write(exclusive=not self._overwrite)  # an unreadable file is there: written over
        written = self.holder()
        if written is None or written.get("token") != self.record["token"]:  # another writer came in between
            raise self._held(written or {})

    def release(self) -> None:
        """Stops the heartbeat and deletes the lease file if it is still this lease's."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout=5)
        self._thread = None
        try:
            with storage.operation("releasing the lease", self.path, self.timeout_s, convert=False):
                current = self.holder(take_over=False)
                if current is not None and current.get("token") == self.record["token"]:
                    self.path.unlink()
        except OSError as e:  # the folder became unreachable: the lease goes stale instead
            log.warning("%s: could not delete the lease file %s (%s)", self.what, self.path, e)

    def _write(self, exclusive: bool) -> None:
        self.record["heartbeat"] = time.time()
        data = json.dumps(self.record)
        try:
            if exclusive and "://" not in os.fspath(self.path):
                try:
                    fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                except FileExistsError:  # created since it was read: its holder decides below
                    return
                with os.fdopen(fd, "w") as f:
                    f.write(data)
            else:
                self.path.write_text(data)
        except OSError as e:
            raise self._unwritable(e) from None

    def _beat(self) -> None:
        """Refreshes the heartbeat every heartbeat_s seconds until released; a failed refresh is warned about once
        (the folder's own writes report the problem)."""
        warned = False
        while not self._stop.wait(self.heartbeat_s):
            try:
                self._write(exclusive=False)
            except FolderNotWritableError as e:
                if not warned:
                    log.warning("%s: lease heartbeat failed: %s", self.what, e)
                    warned = True

    def _held(self, record: dict) -> LeaseHeldError:
        return LeaseHeldError(f"{self.what} is in use by {self.describe(record)} (lease file {self.path}); stop that "
                              f"process first (the lease of a process that is gone is taken over: on the same host "
                              f"at once, from another host {self.stale_after_s:g} s after its last heartbeat)")

    def _unwritable(self, error: OSError) -> FolderNotWritableError:
        return FolderNotWritableError(f"{self.what} is not writable: cannot write {self.path}: "
                                      f"{storage.reason(error)}")


def make_folder(folder: epath.Path, what: str) -> None:
    """Creates `folder` (and its parents) if missing; raises FolderNotWritableError naming `what` when it cannot,
    saying which path is a file where a folder must be (before: "File exists")."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        blocking = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None)
        if blocking is not None:
            subject = what if blocking == folder else f"{what}: {blocking}"
            raise FolderNotWritableError(f"{subject} is a file, not a folder: name a folder (or move the file "
                                         "away)") from None
        raise FolderNotWritableError(f"{what} is not writable: cannot write {folder}: {storage.reason(e)}") from None


def check_writable(folder: str | os.PathLike, what: str) -> None:
    """Raises FolderNotWritableError (naming `what`) unless a file can be created in `folder` (created if
    missing); the probe file is deleted again."""
    probe = epath.Path(folder) / f".write-check-{uuid.uuid4().hex}"
    make_folder(probe.parent, what)
    try:
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise FolderNotWritableError(f"{what} is not writable: cannot write {probe.parent}: "
                                     f"{storage.reason(e)}") from None

