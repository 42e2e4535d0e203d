"""Metrics of a run, written by process 0 only: TensorBoard events, a JSONL file and one console line per step.

`MetricsWriter(log_dir)` writes
- `<log_dir>/tensorboard/`: TensorBoard events (tensorboardX): every scalar, and text summaries (sampled
  transcripts, the config) shown as preformatted text;
- `<log_dir>/metrics.jsonl`: one JSON object per `write`: `{"step": int, "time": unix seconds, name: value, ...}`;
  non-finite values are written as null (JSON has no NaN) and left out of TensorBoard (a gap in the curve: e.g.
  `lld/logp_mean_incorrect` of a step with no incorrect trajectory);
- the console: `step 120/1005  reward 0.412  EM 0.398  LLD 3.1%  gnorm 0.82  tok/s 1.23k  ETA 3h12m` (fields
  missing from a step are left out; ETA from the mean wall time per step after the first training step's write,
  so that neither step 0's evaluation nor the first step's compile counts; none until two steps are written).

Both files are complete on disk after `flush` (every `flush_secs`, before the trainer saves a checkpoint, and on
`close`). `log_dir` may be local or `gs://...` (through gcsfs). GCS cannot append, so the JSONL file is rewritten
whole at each flush; TensorBoard events are written to a local staging folder and its files copied up at each
flush (tensorboardX's own GCS writer uploads the whole file several times per close and once more at interpreter
exit, which hangs for minutes when GCS is unreachable by then). On resume, pass `start_step`: JSONL records and
TensorBoard events at or after it (from the steps run after the last checkpoint) are dropped, so the logs match the
resumed run.
"""
from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TextIO

import jax
import numpy as np
from etils import epath
from tensorboardX.event_file_writer import EventsWriter
from tensorboardX.proto.event_pb2 import Event, SessionLog
from tensorboardX import summary

from llds_jax.config.sections import TrainConfig
from llds_jax.runtime import gcs, storage
from llds_jax.errors import InputError
from llds_jax.train.formats import format_duration, format_number, format_percent, format_si

# (label, metric name, format) of the console line; format is "num", "pct" or "si".
CONSOLE_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("reward", "reward/mean", "num"),
    ("EM", "eval/em_mean", "num"),
    ("LLD", "lld/rate", "pct"),
    ("gnorm", "actor/grad_norm", "num"),
    ("tok/s", "perf/tokens_per_s", "si"),
)
RESERVED_KEYS = ("step", "time")
# (words for one, words for several, metric name) of the rollout budget's console line
# (llds_jax.rollout.agent.Rollout's counts).
BUDGET_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("token generated", "tokens generated", "rollout/sampled_tokens"),
    ("prompt token", "prompt tokens", "rollout/prompt_tokens"),
    ("prompt cut to rollout.max_prompt_tokens (its question's start)",
     "prompts cut to rollout.max_prompt_tokens (their questions' start)", "rollout/prompts_cut"),
    ("observation token", "observation tokens", "rollout/observation_tokens"),
    ("search", "searches", "rollout/searches"),
    ("trajectory", "trajectories", "rollout/trajectories"),
    ("forked-prefix token trained again", "forked-prefix tokens trained again", "rollout/forked_prefix_tokens"),
    # partial rollouts (rollout.partial, llds_jax/rollout/partial.py)
    ("conversation resumed", "conversations resumed", "rollout/partial/resumed"),
    ("conversation carried on", "conversations carried on", "rollout/partial/carried"),
    ("conversation dropped as stale", "conversations dropped as stale", "rollout/partial/dropped"),
    ("conversation dropped (sampled in a group of another data.samples_per_prompt)",
     "conversations dropped (sampled in groups of another data.samples_per_prompt)",
     "rollout/partial/dropped_group_size"),
)


_FORMATS: dict[str, Callable[[float], str]] = {"num": format_number, "pct": format_percent, "si": format_si}


def console_line(step: int, scalars: Mapping[str, float], fields: Sequence[tuple[str, str, str]] = CONSOLE_FIELDS,
                 total_steps: int | None = None, eta_seconds: float | None = None) -> str:
    """`step 12/100  reward 0.412  LLD 3.1%  ETA 4m05s` from the fields present in `scalars` (NaN, an undefined
    value such as the LLD rate of a step without correct trajectories, is left out as TensorBoard leaves it out)."""
    parts = [f"step {step}" if total_steps is None else f"step {step}/{total_steps}"]
    for label, name, kind in fields:
        if name in scalars and not math.isnan(scalars[name]):
            parts.append(f"{label} {_FORMATS[kind](scalars[name])}")
    if eta_seconds is not None:
        parts.append(f"ETA {format_duration(eta_seconds)}")
    return "  ".join(parts)

SHOWN_WHEN_NONZERO = ("rollout/prompts_cut", "rollout/partial/dropped_group_size")  # budget fields left out at 0


def budget_line(step: int, scalars: Mapping[str, float]) -> str | None:
    """`step 12 budget: 18,304 tokens generated, 2,048 prompt tokens, ...` from the rollout's counts (None when
    the step has none: e.g. a record without a rollout)."""
    if BUDGET_FIELDS[0][2] not in scalars:
        return None
    counts = [f"{scalars[name]:,.0f} {one if round(scalars[name]) == 1 else several}"
              for one, several, name in BUDGET_FIELDS
              if name in scalars and (scalars[name] or name not in SHOWN_WHEN_NONZERO)]
    return f"step {step} budget: {', '.join(counts)}"


def as_preformatted(text: str) -> str:
    """Markdown code block (4-space indent) so TensorBoard shows tags like `<search>` verbatim."""
    return "\n".join("    " + line for line in text.split("\n"))


def _scalar(name: str, value: Any) -> float:
    array = np.asarray(value)
    if array.size != 1 or not (np.issubdtype(array.dtype, np.number) or array.dtype == np.bool_):
        raise ValueError(f"metric {name!r} must be a number, got {value!r}")
    return float(array.reshape(()))


class _JsonlLog:
    """The JSONL metrics file, held in memory and rewritten whole on flush (works on GCS, which cannot append)."""

    def __init__(self, path: epath.Path, start_step: int):
        self.path = path
        self.lines: list[str] = []
        if path.exists():
            try:
                text = path.read_text()
            except UnicodeDecodeError as e:
                raise InputError(f"{path}: not UTF-8 text (byte {e.start}): not a metrics file of JSON lines; move it "
                                 "aside to resume without the earlier steps' metrics") from None
            for lineno, line in enumerate(text.splitlines(), start=1):
                if not line.strip():
                    continue
                try:
                    step = json.loads(line)["step"]
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise InputError(f"{path}:{lineno}: not a metrics record with a 'step'") from None
                if step < start_step:
                    self.lines.append(line)
        self.dirty = True

    def append(self, record: Mapping[str, Any]) -> None:
        self.lines.append(json.dumps(record, allow_nan=False))
        self.dirty = True

    def flush(self) -> None:
        if not self.dirty:
            return
        text = "".join(line + "\n" for line in self.lines)
        if "://" in str(self.path):
            self.path.write_text(text)  # an object store replaces objects atomically
        else:
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text(text)
            tmp.replace(self.path)
        self.dirty = False


class EventFile:
    """One TensorBoard event file, written synchronously: `flush` returns once every event is in the file
    (tensorboardX's SummaryWriter queues events for a thread and its flush leaves the queue as it is, so a kill right
    after a flush lost them). The file is `<log_dir>/events.out.tfevents.<unix time>.<host><suffix>`; with
    `purge_step`, TensorBoard drops the events of earlier files from that step on (a resumed run's). The file is
    made by the first event: a process that writes none (a rerun of a finished run) leaves no empty file."""

    def __init__(self, log_dir: str, purge_step: int | None, suffix: str):
        self._log_dir, self._purge_step, self._suffix = log_dir, purge_step, suffix
        self._writer: EventsWriter | None = None

    def _write(self, event: Event) -> None:
        if self._writer is None:
            os.makedirs(self._log_dir, exist_ok=True)
            self._writer = EventsWriter(os.path.join(self._log_dir, "events"), self._suffix)
            if self._purge_step is not None:
                self._writer.write_event(Event(step=self._purge_step, wall_time=time.time(),
                                               session_log=SessionLog(status=SessionLog.START)))
        self._writer.write_event(event)

    def add_scalar(self, name: str, value: float, step: int) -> None:
        self._write(Event(step=step, wall_time=time.time(), summary=summary.scalar(name, value)))

    def add_text(self, name: str, value: str, step: int) -> None:
        self._write(Event(step=step, wall_time=time.time(), summary=summary.text(name, value)))

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


class MetricsWriter:
    """Fans `write(step, scalars)` out to TensorBoard, JSONL and the console (see the module docstring).

    Args:
      log_dir: run folder (local or gs://).
      total_steps: for `step i/N` and the ETA on the console (None: neither).
      start_step: first step this process will write (the resumed step + 1); later records already on disk are
        dropped.
      process_index: this host (default `jax.process_index()`); only process 0 writes anything.
      console: stream for the console line (None: no console output).
      console_fields: (label, metric name, "num" | "pct" | "si") of the console line.
      flush_secs: how often files are flushed, in seconds (also on `flush` and `close`).
      clock: seconds, monotonic (for the ETA; injectable for tests).
      timeout_s: seconds a write may take before the process ends (llds_jax.runtime.storage); a failed write raises
        StorageError naming the run folder.
    """

    def __init__(self, log_dir: str, total_steps: int | None = None, start_step: int = 0,
                 process_index: int | None = None, console: TextIO | None = sys.stdout,
                 console_fields: Sequence[tuple[str, str, str]] = CONSOLE_FIELDS, flush_secs: float = 30.0,
                 clock: Callable[[], float] = time.monotonic,
                 timeout_s: float = TrainConfig.storage_timeout_s):
        if process_index is None:
            process_index = jax.process_index()
        for label, name, kind in console_fields:
            if kind not in _FORMATS:
                raise ValueError(f"console field {label!r} ({name}): format must be one of {sorted(_FORMATS)}, "
                                 f"got {kind!r}")
        self.active = process_index == 0
        self.total_steps = total_steps
        self.console = console
        self.console_fields = tuple(console_fields)
        self.flush_secs = flush_secs
        self.clock = clock
        self.log_dir, self.timeout_s = log_dir, timeout_s
        self._first: tuple[int, float] | None = None  # (step, clock) of the first write past step 0, for the ETA
        self._last_flush = clock()
        if not self.active:
            return
        root = epath.Path(log_dir)
        with self._writing():
            root.mkdir(parents=True, exist_ok=True)
            self._tb_dir = root / "tensorboard"
            self._staging = tempfile.TemporaryDirectory(prefix="llds_tensorboard_") if gcs.is_gcs(log_dir) else None
            # The suffix keeps a resumed writer from reusing the file name (unix seconds + host) of the last one.
            self._tb = EventFile(self._staging.name if self._staging else str(self._tb_dir),
                                 purge_step=start_step or None, suffix=f".from-step-{start_step}")
        self._jsonl = _JsonlLog(root / "metrics.jsonl", start_step)  # its errors name the bad line

    def _writing(self):
        """The writes of the metrics as one storage operation on the run folder (llds_jax.runtime.storage)."""
        return storage.operation("writing metrics to", self.log_dir, self.timeout_s)

    def write(self, step: int, scalars: Mapping[str, Any]) -> None:
        """Writes scalar metrics of `step` (numbers, numpy or jax scalars) everywhere."""
        if not self.active:
            return
        values = {}
        for name, value in scalars.items():
            if name in RESERVED_KEYS:
                raise ValueError(f"metric name {name!r} is reserved (JSONL record keys {RESERVED_KEYS})")
            values[name] = _scalar(name, value)
        with self._writing():
            for name, value in values.items():
                if math.isfinite(value):
                    self._tb.add_scalar(name, value, step)
            self._jsonl.append({"step": step, "time": time.time(),
                                **{k: (v if math.isfinite(v) else None) for k, v in values.items()}})
        now = self.clock()
        if self.console is not None:
            print(console_line(step, values, self.console_fields, self.total_steps, self._eta(step, now)),
                  file=self.console, flush=True)
            budget = budget_line(step, values)
            if budget is not None:
                print(budget, file=self.console, flush=True)
        if now - self._last_flush >= self.flush_secs:
            self.flush()

    def _eta(self, step: int, now: float) -> float | None:
        if self._first is None and step > 0:  # the clock starts when the first training step (and its compile) ends
            self._first = (step, now)
        if self._first is None:
            return None
        first_step, first_time = self._first
        if self.total_steps is None or step <= first_step:
            return None
        return (now - first_time) / (step - first_step) * max(self.total_steps - step, 0)

    def write_texts(self, step: int, texts: Mapping[str, str]) -> None:
        """Text summaries (e.g. `{"samples/0": transcript}`), shown verbatim in TensorBoard's text tab."""
        if not self.active:
            return
        with self._writing():
            for name, text in texts.items():
                self._tb.add_text(name, as_preformatted(text), step)

    def flush(self) -> None:
        if not self.active:
            return
        with self._writing():
            self._tb.flush()
            self._upload_events()
            self._jsonl.flush()
        self._last_flush = self.clock()

    def _upload_events(self) -> None:
        """Copies the staged TensorBoard event files to the gs:// run folder (nothing for a local one)."""
        if self._staging is not None:
            gcs.copy_files(self._staging.name, self._tb_dir, os.listdir(self._staging.name))

    def close(self) -> None:
        """Flushes and closes the files."""
        if not self.active:
            return
        self.flush()
        with self._writing():
            self._tb.close()
        if self._staging is not None:
            self._staging.cleanup()
        self.active = False
