"""Runs commands as subprocesses, several at once, each after the ones it waits for, with one log file each.

A job's stdout and stderr go to its log file (appended: a rerun keeps the earlier attempt's lines above). Ctrl-C
sends SIGTERM to the running jobs (a training run then saves its state and exits: llds_jax.train.trainer) and waits
for them before it re-raises.
"""
from __future__ import annotations

import dataclasses
import os
import shlex
import signal
import subprocess
import time
from collections.abc import Callable, Sequence

from llds_jax.config import redacted_argument


@dataclasses.dataclass(frozen=True)
class Job:
    """A command, its log file (None: this process's stdout and stderr) and the names of the jobs that must succeed
    (exit status 0) before it starts."""
    name: str
    command: tuple[str, ...]
    log: str | None
    after: tuple[str, ...] = ()

    def shell(self) -> str:
        """The command as one shell line to print or log, secrets redacted (`config.redacted_argument`)."""
        return shlex.join(redacted_argument(arg) for arg in self.command)


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How a job ended: its exit status (None: not started, a job it waits for failed) and wall seconds."""
    job: Job
    status: int | None
    seconds: float


def _start(job: Job) -> subprocess.Popen:
    if job.log is None:
        return subprocess.Popen(job.command)
    os.makedirs(os.path.dirname(os.path.abspath(job.log)), exist_ok=True)
    with open(job.log, "a") as log:
        log.write(f"+ {job.shell()}\n")
        log.flush()
        return subprocess.Popen(job.command, stdout=log, stderr=subprocess.STDOUT)


def run_jobs(jobs: Sequence[Job], parallel: int, on_start: Callable[[Job], None] = lambda job: None,
             on_end: Callable[[Outcome], None] = lambda outcome: None, poll_s: float = 0.5) -> list[Outcome]:
    """Runs `jobs`, at most `parallel` at once, in list order as their `after` jobs succeed; returns the outcomes
    in the order the jobs ended. A job waiting for one that failed (or was itself skipped) is skipped (status
    None). `after` names must be of earlier jobs in the list."""
    if parallel < 1:
        raise ValueError(f"parallel must be >= 1, got {parallel}")
    names = set()
    for job in jobs:
        missing = [name for name in job.after if name not in names]
        if missing:
            raise ValueError(f"job {job.name!r} waits for {missing}, not earlier jobs of the list")
        names.add(job.name)
    pending, running, status, outcomes = list(jobs), {}, {}, []

    def end(job: Job, code: int | None, seconds: float) -> None:
        status[job.name] = code
        outcomes.append(Outcome(job, code, seconds))
        on_end(outcomes[-1])

    try:
        while pending or running:
            for job in list(pending):
                if any(status.get(name, 0) != 0 for name in job.after if name in status):
                    pending.remove(job)
                    end(job, None, 0.0)
                elif len(running) < parallel and all(name in status for name in job.after):
                    pending.remove(job)
                    on_start(job)
                    running[job.name] = (job, _start(job), time.perf_counter())
            for name, (job, proc, start) in list(running.items()):
                if proc.poll() is not None:
                    del running[name]
                    end(job, proc.returncode, time.perf_counter() - start)
            if running:
                time.sleep(poll_s)
    except BaseException:
        for _, proc, _ in running.values():
            proc.send_signal(signal.SIGTERM)
        for _, proc, _ in running.values():
            proc.wait()
        raise
    return outcomes
