"""Orbax checkpoints of a run: parameters, optimizer state, the run's and each host's JSON records, saved async.

A run folder (local path or `gs://...`) holds one sub-folder per saved step (`<dir>/<step>/`) with up to four
items: `params` and `opt_state` (pytrees of sharded jax arrays, e.g. an `nnx.State` and an optax state), `meta`
(JSON: `{"step": step, "meta": {...}}`: data-iterator state, rng, counters; anything small; orbax writes it from
process 0 alone) and `hosts`, each process's own record (`host_meta`: what differs between hosts, e.g. a host's
carried partial rollouts; JSON of each process, space-padded to the longest, as one uint8 array of a row per
process, the row written and read by its own process).

- Saving is asynchronous: `save` returns once the arrays are copied to host memory (they may be donated or deleted
  right after) and the files are written in the background; `wait_until_finished()` blocks until the last save is
  complete on disk. Orbax writes into a temporary folder and renames it when complete (on GCS: into the final
  folder, committed by a `commit_success.txt` written last), so a crash mid-save never leaves a step that looks
  complete. Opening the folder deletes the unfinished steps an earlier run left, before anything else
  (`_open_manager`).
- The newest `keep` steps are kept, older ones deleted.
- `restore_latest` tries the newest step first. A step whose files cannot be read (a file deleted, truncated or
  corrupted after it was written) is reported with a one-line warning naming the step and the error (`describe`),
  and the previous step is tried (the reads orbax left in flight then fail against its closed event loop: those
  reports are dropped, `drop_orphaned_read_errors`); once one restores, the unreadable newer steps are moved aside
  to `<step>.unreadable-<unix time>` (so the resumed run can save those step numbers again). The oldest step's
  warning says that nothing is left to fall back to: the restore fails (CheckpointUnreadableError), moving nothing.
  Each attempt is agreed between hosts (`distributed.any_process`), so all hosts resume from the same step.
- Every write and read is a bounded storage operation (llds_jax.runtime.storage): a failed write (a disk full or
  read-only, a GCS endpoint gone) raises one StorageError naming the step, the folder and the reason, and the
  reports orbax's background threads log about it are dropped (the error reaches the caller at the next save,
  wait or close; a step folder that cannot be made fails `save` itself, and leaves nothing running); a write or
  read that stops answering ends the process after `timeout_s`. After a failed write, `close` waits for nothing
  more.
- On several hosts every process calls `save`, `restore*` and `wait_until_finished` at the same point (each writes
  and reads its own shards; orbax synchronizes them). A step restored on another number of processes than saved it
  has no host records for them (`Restored.host_meta` None, `Restored.host_count` the saving processes).
- Each save records two checksums of every array it writes (`checksums`, in the `meta` item); `restore` checks
  them, and a step whose data changed after the save (flipped bytes: before issue 58 they were loaded as weights
  without a word) fails with ChecksumMismatchError naming the array: `restore_latest` falls back to the previous
  step as for any unreadable one. Steps saved before the checksums existed are restored unchecked.
- The `meta` item's record itself (the rng, the data position, the counters, the arrays' checksums) carries the
  SHA-256 of its canonical JSON (`record_sha256`); a record that no longer matches it fails with
  ChecksumMismatchError naming the file, and so falls back like damaged arrays (before issue 66 one flipped bit of
  the saved rng resumed on another random stream without a word). A record saved before that checksum existed
  (issue 66) is read unchecked when its keys are those that version wrote, and refused otherwise (a flipped bit in
  a key's name).
- Restored arrays take the shardings of the targets (`jax.Array`s or `jax.ShapeDtypeStruct`s with a `sharding`),
  so they land on the mesh. A target without a sharding, or with other array shapes than saved (another model
  config), is an error of its own, never taken for an unreadable step.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import socket
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from llds_jax.runtime import distributed, gcs, storage
from llds_jax.bounds import ConfigError
from llds_jax.config.sections import TrainConfig

log = logging.getLogger(__name__)


MAX_REASON_CHARS = 300


def describe(error: BaseException) -> str:
    """`Type: message` of a failed read in one line of at most MAX_REASON_CHARS (orbax appends the whole TensorStore
    spec, dozens of lines, to its message), with the first line of its cause."""
    def line(e: BaseException) -> str:
        text = str(e).split(" See full TensorStore details")[0].strip().splitlines()
        return f"{type(e).__name__}: {text[0] if text else ''}"

    text = line(error) + (f" (caused by {line(error.__cause__)})" if error.__cause__ is not None else "")
    return text if len(text) <= MAX_REASON_CHARS else text[:MAX_REASON_CHARS - 3] + "..."


def _is_orphaned_read_error(error: BaseException | None, where: object = None) -> bool:
    """A report of a read that orbax left running after a failed restore: its callback finding orbax's event loop
    closed, or the read's coroutine failing after nobody awaits it any more."""
    if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
        return True
    code = getattr(where, "cr_code", None)
    return code is not None and _in_orbax(code.co_filename)


def _in_orbax(filename: str) -> bool:
    return f"{os.sep}orbax{os.sep}" in filename


# How TensorStore words a failed read: an absl status code, then what it was doing.
_TENSORSTORE_READ_ERROR = re.compile(r"^[A-Z_]+: Error (reading|opening) ")


def _keeps_asyncio_record(record: logging.LogRecord) -> bool:
    """False for asyncio's "... exception was never retrieved" report of such an orphaned read: a task running orbax's
    code, or a TensorStore read future (its error has no Python frames); True for every other record."""
    error = record.exc_info[1] if record.exc_info else None
    if error is None:
        return True
    if _is_orphaned_read_error(error):
        return False
    if "exception was never retrieved" not in record.getMessage().split("\n", 1)[0]:
        return True
    frames = traceback.extract_tb(error.__traceback__)
    if frames:
        return not any(_in_orbax(frame.filename) for frame in frames)
    return not _TENSORSTORE_READ_ERROR.match(str(error))


def _keeps_absl_record(record: logging.LogRecord) -> bool:
    """False for orbax's own report of a failed background save (an error with its traceback, logged from its
    threads): the Checkpointer raises that failure as one StorageError."""
    return not (record.levelno >= logging.ERROR and record.exc_info and _in_orbax(record.pathname))


def drop_orbax_save_reports() -> None:
    """Makes the process drop orbax's reports of failed background saves (see _keeps_absl_record). Idempotent."""
    absl_logger = logging.getLogger("absl")
    if _keeps_absl_record not in absl_logger.filters:
        absl_logger.addFilter(_keeps_absl_record)


def drop_orphaned_read_errors() -> None:
    """Makes the process drop the reports that the reads left in flight by a failed restore print later, from other
    threads, through asyncio's logger or at garbage collection (hundreds of lines for a large model); every other
    uncaught or unraisable exception and asyncio record is reported as before. Idempotent."""
    if getattr(sys.excepthook, "drops_orphaned_reads", False):
        return
    excepthook, unraisablehook = sys.excepthook, sys.unraisablehook

    def on_exception(kind, error, error_traceback):
        if not _is_orphaned_read_error(error):
            excepthook(kind, error, error_traceback)

    def on_unraisable(unraisable):
        if not _is_orphaned_read_error(unraisable.exc_value, unraisable.object):
            unraisablehook(unraisable)

    on_exception.drops_orphaned_reads = True
    sys.excepthook, sys.unraisablehook = on_exception, on_unraisable
    logging.getLogger("asyncio").addFilter(_keeps_asyncio_record)


class Restored(NamedTuple):
    """A restored checkpoint: its step, params, opt_state (None when not asked for), the saved `meta` dict, this
    process's `host_meta` (None: the step has no host records, or `host_count` processes saved it and another number
    restores it) and `host_count` (the processes that saved host records; 0: none)."""

    step: int
    params: Any
    opt_state: Any
    meta: dict[str, Any]
    host_meta: dict[str, Any] | None = None
    host_count: int = 0


class CheckpointUnreadableError(RuntimeError):
    """Every checkpoint step in the run folder failed to restore."""


class CheckpointMismatchError(ValueError):
    """The restore targets do not match what the checkpoint holds (another model or optimizer): not a bad file."""


def abstract_like(tree: Any, name: str = "target") -> Any:
    """`jax.ShapeDtypeStruct`s (with shardings) for a pytree of arrays or ShapeDtypeStructs.

    Raises ValueError naming the leaf (`name` + its path) when a leaf has no sharding.
    """

    def leaf(path, x):
        sharding = getattr(x, "sharding", None)
        if sharding is None:
            raise ValueError(f"checkpoint restore {name}{jax.tree_util.keystr(path)} has no sharding: pass jax "
                             f"arrays or jax.ShapeDtypeStruct(shape, dtype, sharding=...) so it lands on the mesh")
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return jax.tree_util.tree_map_with_path(leaf, tree)


def rng_to_json(key: jax.Array) -> dict[str, Any]:
    """A typed PRNG key as JSON: `{"impl": name, "data": nested list of uint32}`."""
    return {"impl": str(jax.random.key_impl(key)), "data": np.asarray(jax.random.key_data(key)).tolist()}


def rng_from_json(record: Mapping[str, Any]) -> jax.Array:
    """The typed PRNG key `rng_to_json` wrote."""
    return jax.random.wrap_key_data(np.asarray(record["data"], np.uint32), impl=record["impl"])


class ChecksumMismatchError(ValueError):
    """A restored array or the step's record differs from what was saved (its bytes damaged after the save): the
    step is unusable."""


META_FILE = "meta/metadata"  # where orbax's JsonCheckpointHandler writes the `meta` item, in a step's folder
RECORD_SHA256 = "record_sha256"  # the key of the record's own checksum (the function `record_sha256`)
# The keys of a record saved before its checksum existed: since issue 58 (the arrays' checksums), and before it.
UNCHECKED_RECORD_KEYS = ({"step", "meta", "checksums"}, {"step", "meta"})


def record_sha256(record: Mapping[str, Any]) -> str:
    """The SHA-256 (hex) of `record`'s canonical JSON (keys sorted), leaving out the key RECORD_SHA256. The same
    for a record and its JSON read back (`meta` holds JSON types: string keys, lists)."""
    rest = {key: value for key, value in record.items() if key != RECORD_SHA256}
    return hashlib.sha256(json.dumps(rest, sort_keys=True).encode()).hexdigest()


@jax.jit
def _array_checksums(leaves: list[jax.Array]) -> list[jax.Array]:
    """Two uint32 sums per array over its bits (sum x_i * (2i + 1), sum x_i ^ (i * 0x9E3779B1), mod 2**32, x_i
    the i-th 8/16/32-bit word): any one flipped bit changes the first. Exact integer sums, so the same for any
    sharding; computed where the arrays are (a collective over hosts)."""
    sums = []
    for x in leaves:
        if x.dtype == jnp.bool_:
            x = x.astype(jnp.uint8)
        words = jax.lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16}.get(x.dtype.itemsize, jnp.uint32))
        words = words.reshape(-1).astype(jnp.uint32)
        i = jnp.arange(words.size, dtype=jnp.uint32)
        sums.append(jnp.stack([jnp.sum(words * (2 * i + 1)), jnp.sum(words ^ (i * np.uint32(0x9E3779B1)))]))
    return sums


def checksums(tree: Any) -> list[list[int]]:
    """`_array_checksums` of every array of `tree` (leaf order), as JSON-ready ints. Arrays in host memory (the
    state copy a stop within a step saves) are summed on the devices one at a time: a whole second state there
    could pass the accelerator's memory."""
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return []
    if all(_on_device(x) for x in leaves):
        sums = _array_checksums(leaves)
    else:
        sums = [_array_checksums([x if _on_device(x) else
                                  jax.device_put(x, x.sharding.with_memory_kind("device"))])[0] for x in leaves]
    return [[int(v) for v in pair] for pair in jax.device_get(sums)]


def _on_device(x: Any) -> bool:
    return getattr(getattr(x, "sharding", None), "memory_kind", None) in (None, "device")


def _processes_sharding() -> NamedSharding:
    """A [processes, bytes] array's sharding: row p on process p's devices (replicated over them)."""
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = Mesh(np.array(devices).reshape(jax.process_count(), -1), ("processes", "local"))
    return NamedSharding(mesh, PartitionSpec("processes", None))


def json_bytes(name: str, record: Mapping[str, Any]) -> bytes:
    """`record` as JSON (UTF-8); raises TypeError naming `name` and the key whose value is not serializable."""
    try:
        return json.dumps(record).encode()
    except (TypeError, ValueError):
        for key, value in record.items():
            try:
                json.dumps(value)
            except (TypeError, ValueError) as e:
                raise TypeError(f"checkpoint {name}[{key!r}] is not JSON-serializable: {e}") from None
        raise


def host_records(encoded: bytes) -> jax.Array:
    """Every process's record `encoded` (JSON bytes, space-padded to the longest; a collective) as a uint8 array
    [processes, bytes], row p from process p."""
    data = np.frombuffer(encoded, np.uint8)
    row = np.full((1, distributed.largest(data.size)), ord(" "), np.uint8)
    row[0, :data.size] = data
    return jax.make_array_from_process_local_data(_processes_sharding(), row, (jax.process_count(),
                                                                                  row.shape[1]))


def own_record(records: jax.Array) -> dict[str, Any]:
    """This process's record of `host_records`' array (laid out by `_processes_sharding`)."""
    return json.loads(np.asarray(records.addressable_shards[0].data)[0].tobytes().decode())


class Checkpointer:
    """Saves and restores one run's checkpoints (see the module docstring).

    Args:
      directory: run checkpoint folder, local or `gs://bucket/...` (created if missing).
      save_every: `should_save(step)` is true every `save_every` steps (train.checkpoint_every).
      keep: how many of the newest steps to keep (train.keep_checkpoints).
      async_save: write in the background (False: `save` returns when the step is on disk).
      timeout_s: seconds a save, wait, restore or close may take before the process ends (llds_jax.runtime.storage).
    """

    def __init__(self, directory: str, save_every: int, keep: int, async_save: bool = True,
                 timeout_s: float = TrainConfig.storage_timeout_s):
        if save_every <= 0:
            raise ConfigError(f"train.checkpoint_every must be positive, got {save_every}")
        if keep <= 0:
            raise ConfigError(f"train.keep_checkpoints must be positive, got {keep}")
        # Orbax needs absolute paths (a relative one fails when an async save finalizes).
        self.directory = epath.Path(directory if "://" in directory else os.path.abspath(directory))
        self.save_every = save_every
        self.timeout_s = timeout_s
        self.failed = False  # a write failed: close() waits for nothing more
        self._pending: int | None = None  # the step whose background save may still run
        self._pending_since: float | None = None  # time.monotonic() its save began (`wait_until_finished`)
        drop_orbax_save_reports()
        # The step's folders are made in `save` (a few mkdirs), not by a background future whose signal every
        # writer of the step waits for: when that mkdir failed (a disk turned read-only, the folder gone), the
        # writers waited for orbax's 300 s signal timeout, held the interpreter's exit that long and then dropped
        # their coroutines ("coroutine ... was never awaited", six blocks in the test suite's output, issue 58).
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=async_save, cleanup_tmp_directories=True, create=True,
            async_options=ocp.AsyncOptions(create_directories_asynchronously=False))
        handlers = {"params": ocp.StandardCheckpointHandler(), "opt_state": ocp.StandardCheckpointHandler(),
                    "meta": ocp.JsonCheckpointHandler(), "hosts": ocp.StandardCheckpointHandler()}
        with self._operation("opening the checkpoint folder"):
            self._manager = self._open_manager(options, handlers)

    def _open_manager(self, options: ocp.CheckpointManagerOptions, handlers: dict) -> ocp.CheckpointManager:
        """Orbax's manager of the folder, with its clean-up of unfinished steps done.

        Orbax deletes the unfinished steps in a thread while it lists the folder, and waits for that only at the
        first save. On GCS a folder exists only while it holds an object: when every step is unfinished (the
        first save was cut), the deletion could empty the folder between orbax's check that it exists and its
        listing (FileNotFoundError). A placeholder object of this process keeps the folder while it opens, and the
        clean-up is awaited here (through orbax's private `_maybe_await_cleanup_tmp_directory`; constraints.txt
        pins orbax), so that no later listing races it either."""
        placeholder = None
        if gcs.is_gcs(str(self.directory)):
            placeholder = self.directory / f".opening-{socket.gethostname()}-{os.getpid()}"
            placeholder.write_text("a run is opening this checkpoint folder\n")
        try:
            manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
            manager._maybe_await_cleanup_tmp_directory()
        finally:
            if placeholder is not None:
                placeholder.unlink(missing_ok=True)
        return manager

    @contextlib.contextmanager
    def _operation(self, what: str, convert: bool = True, work_began: float | None = None):
        """A storage operation on the folder (llds_jax.runtime.storage) that saves state: on the way out of another
        write's failure a save in flight keeps its timeout, counted from `work_began` (the save's start); a
        failure marks the checkpointer failed."""
        try:
            with storage.operation(what, self.directory, self.timeout_s, convert=convert, saves_state=True,
                                   work_began=work_began):
                yield
        except storage.StorageError:
            self.failed = True
            raise

    def should_save(self, step: int) -> bool:
        """True when `step` is a positive multiple of `save_every`."""
        return step > 0 and step % self.save_every == 0

    def all_steps(self) -> list[int]:
        """Complete steps in the folder, oldest first."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, params: Any, opt_state: Any, meta: Mapping[str, Any],
             host_meta: Mapping[str, Any] | None = None) -> bool:
        """Starts saving `step`; returns False (and saves nothing) when that step already exists.

        Args:
          params, opt_state: pytrees of jax arrays (any sharding).
          meta: JSON-serializable dict, the same on every process (process 0's is written).
          host_meta: this process's own JSON-serializable dict (the `hosts` item), or None for no host records;
            None on every process or on none. Raises TypeError naming the key that is not serializable.
        """
        meta = json.loads(json_bytes("meta", meta))  # as `restore` reads it back (string keys, lists)
        arrays = {"params": params, "opt_state": opt_state}
        if host_meta is not None:
            arrays["hosts"] = {"records": host_records(json_bytes("host_meta", host_meta))}
        record = {"step": step, "meta": meta, "checksums": {name: checksums(tree) for name, tree in arrays.items()}}
        items = {"params": ocp.args.StandardSave(params),
                 "meta": ocp.args.JsonSave({**record, RECORD_SHA256: record_sha256(record)})}  # checked by `restore`
        if host_meta is not None:
            items["hosts"] = ocp.args.StandardSave(arrays["hosts"])
        if jax.tree.leaves(opt_state):  # a stateless optimizer (e.g. optax.sgd) has nothing to save
            items["opt_state"] = ocp.args.StandardSave(opt_state)
        self.wait_until_finished()  # a failure of the previous save is reported as that step's
        since = time.monotonic()
        with self._operation(f"saving checkpoint step {step} to"):
            saved = self._manager.save(step, args=ocp.args.Composite(**items))
        self._pending, self._pending_since = (step, since) if saved else (None, None)
        return saved

    def wait_until_finished(self) -> None:
        """Blocks until the last save is complete on disk (and old steps are deleted); on the way out of a failure,
        at most the storage timeout from the save's start."""
        what = "writing checkpoints to" if self._pending is None else f"saving checkpoint step {self._pending} to"
        with self._operation(what, work_began=self._pending_since):
            self._manager.wait_until_finished()
        self._pending = self._pending_since = None

    def restore(self, step: int, params_target: Any, opt_state_target: Any = None,
                check_meta: Callable[[dict, dict | None], None] | None = None) -> Restored:
        """Restores `step` onto the targets' shardings; `opt_state_target=None` skips the optimizer state;
        `check_meta(meta, host_meta)` raises ValueError (or KeyError, TypeError) when the step's records cannot be
        resumed from (the trainer's: a data position out of range), re-raised as ValueError naming the step's meta
        item. `host_meta` is this process's record (None: see `Restored`).

        The targets are pytrees of `jax.Array`s or `jax.ShapeDtypeStruct`s with shardings, shaped like what was
        saved (e.g. `jax.eval_shape` of the jitted initializer with `out_shardings`, or the live fresh state).
        """
        targets = {"params": abstract_like(params_target, "params")}
        if jax.tree.leaves(opt_state_target):
            targets["opt_state"] = abstract_like(opt_state_target, "opt_state")
        saved = self._manager.item_metadata(step)
        for name, target in targets.items():
            self._check_target(step, name, saved.get(name), target)
        records_shape = self._records_shape(step, saved.get("hosts"))
        host_count = records_shape[0] if records_shape else 0
        if host_count == jax.process_count():
            targets["hosts"] = {"records": jax.ShapeDtypeStruct(records_shape, np.uint8,
                                                                sharding=_processes_sharding())}
        items = {name: ocp.args.StandardRestore(target) for name, target in targets.items()}
        restored = self._manager.restore(step, args=ocp.args.Composite(**items, meta=ocp.args.JsonRestore()))
        record = restored.meta
        if not isinstance(record, dict) or record.get("step") != step or not isinstance(record.get("meta"), dict):
            raise ValueError(f"{self.directory / str(step)}/meta: expected {{'step': {step}, 'meta': {{...}}}}, "
                             f"got {record!r}")
        self._check_record(step, record)
        for name in targets:  # a step saved before issue 58 has no checksums
            self._check_sums(step, name, restored[name], record.get("checksums", {}).get(name))
        host_meta = own_record(restored.hosts["records"]) if "hosts" in targets else None
        try:
            if check_meta is not None:
                check_meta(record["meta"], host_meta)
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{self.directory / str(step)}/meta: {describe(e)}") from None
        opt_state = restored.opt_state if "opt_state" in targets else opt_state_target  # None or leafless
        return Restored(step=step, params=restored.params, opt_state=opt_state, meta=record["meta"],
                        host_meta=host_meta, host_count=host_count)

    def _records_shape(self, step: int, saved: Any) -> tuple[int, int] | None:
        """The shape [processes, bytes] of the step's host records (None: it has none)."""
        if saved is None:
            return None
        shapes = [tuple(leaf.shape) for leaf in jax.tree.leaves(saved)]
        if len(shapes) != 1 or len(shapes[0]) != 2:
            raise ValueError(f"{self.directory / str(step)}/hosts: expected one array [processes, bytes], got "
                             f"shapes {shapes}")
        return shapes[0]

    def _check_record(self, step: int, record: dict) -> None:
        """Raises ChecksumMismatchError naming the step's META_FILE when `record` does not match its RECORD_SHA256
        (before issue 66, one flipped bit of the saved rng resumed on another random stream without a word), or,
        without one, when its keys are not those of a record saved before the checksum existed."""
        where = str(self.directory / str(step) / META_FILE)
        if RECORD_SHA256 not in record:
            if set(record) not in UNCHECKED_RECORD_KEYS:
                raise ChecksumMismatchError(f"{where}: the record has no {RECORD_SHA256} and unknown keys "
                                            f"{sorted(set(record) - UNCHECKED_RECORD_KEYS[0])} (its data changed "
                                            "after the save)")
            return
        if record[RECORD_SHA256] != record_sha256(record):
            raise ChecksumMismatchError(f"{where}: the record (the rng, data position, counters and the arrays' "
                                        "checksums) does not match the checksum saved with it (its data changed "
                                        "after the save)")

    def _check_sums(self, step: int, name: str, tree: Any, saved: list | None) -> None:
        """Raises ChecksumMismatchError naming the first array of `tree` whose checksums are not `saved`'s (before
        issue 58, nine flipped bytes in a weight file restored 7,335 wrong weights without a word)."""
        if saved is None:
            return
        paths = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
        for path, have, want in zip(paths, checksums(tree), saved):
            if have != want:
                raise ChecksumMismatchError(f"{self.directory / str(step)}/{name}: {name}{path} does not match the "
                                            "checksum saved with it (its data changed after the save)")

    def _check_target(self, step: int, name: str, saved: Any, target: Any) -> None:
        """Raises CheckpointMismatchError unless `target` has as many arrays as `saved`, with the same shapes."""
        where = f"{self.directory / str(step)}/{name}"
        if saved is None:  # a damaged step (or one saved without this item): restore_latest tries an older one
            raise FileNotFoundError(f"{where}: no readable metadata for this item")
        saved_leaves = jax.tree.leaves(saved)
        target_leaves = jax.tree_util.tree_flatten_with_path(target)[0]
        if len(saved_leaves) != len(target_leaves):
            raise CheckpointMismatchError(f"{where}: holds {len(saved_leaves)} arrays, the restore target has "
                                          f"{len(target_leaves)}")
        for (path, want), have in zip(target_leaves, saved_leaves):
            if tuple(have.shape) != tuple(want.shape):
                raise CheckpointMismatchError(f"{where}: {name}{jax.tree_util.keystr(path)} was saved with shape "
                                              f"{tuple(have.shape)}, the restore target has {tuple(want.shape)}")

    def restore_latest(self, params_target: Any, opt_state_target: Any = None,
                       check_meta: Callable[[dict, dict | None], None] | None = None) -> Restored | None:
        """Restores the newest readable step (None when the folder has no step); see `restore`. A step whose record
        `check_meta` refuses counts as unreadable (issue 58: a data position out of range failed every rerun).

        Unreadable newer steps are warned about and, once an older step restored, moved aside. Raises
        CheckpointUnreadableError when steps exist but none can be read (starting over would silently discard the
        run; nothing is moved), and CheckpointMismatchError at once when the targets do not fit the newest step.
        """
        drop_orphaned_read_errors()  # before any read: a failed read's orphans may report before it raises
        with self._operation("restoring the newest checkpoint from", convert=False):
            return self._restore_latest(params_target, opt_state_target, check_meta)

    def _restore_latest(self, params_target: Any, opt_state_target: Any,
                        check_meta: Callable[[dict, dict | None], None] | None) -> Restored | None:
        failures = {}
        steps = self.all_steps()
        for step in reversed(steps):
            error = None
            try:
                restored = self.restore(step, params_target, opt_state_target, check_meta)
            except CheckpointMismatchError:
                raise  # the caller's targets are wrong; older steps would not fit either
            except Exception as e:  # noqa: BLE001 - any other failure to read the step means it is unusable
                error = e
            if not distributed.any_process(error is not None):
                if failures:  # resuming from an older step: free the newer step numbers for the next saves
                    for unreadable in failures:
                        self._move_aside(unreadable)
                    self._manager.reload()
                return restored
            reason = describe(error) if error is not None else "it failed on another host"
            then = ("falling back to the previous step" if step != steps[0] else
                    "it is the oldest step: nothing to fall back to, the restore fails and no step is moved aside")
            log.warning("checkpoint step %d in %s is unreadable (%s); %s", step, self.directory, reason, then)
            failures[step] = reason
        if failures:
            raise CheckpointUnreadableError(f"no readable checkpoint in {self.directory}: " +
                                            "; ".join(f"step {step}: {reason}" for step, reason in failures.items()))
        return None

    def _move_aside(self, step: int) -> None:
        """Renames an unreadable step folder (on process 0) so orbax no longer lists it."""
        if distributed.is_main_process():
            source = self.directory / str(step)
            target = self.directory / f"{step}.unreadable-{int(time.time())}"
            source.rename(target)
            log.warning("moved unreadable checkpoint %s to %s", source, target)
        distributed.barrier(f"checkpoint_move_aside_{step}")  # every host sees the rename before listing steps

    def close(self) -> None:
        """Waits for pending saves and releases the manager; after a failed write only releases it."""
        if self.failed:
            return
        self.wait_until_finished()
        with self._operation("closing the checkpoint folder"):
            self._manager.close()
