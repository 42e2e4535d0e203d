"""Runs of `python -m llds_jax.launch` as subprocesses on fake CPU devices, one process alone or the processes of a
pod (jax.distributed over loopback, one process per host), and what their run folders hold (local or gs://).
Import as `from tests.e2e.runs import ...`."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

import pytest
from etils import epath
from flax import nnx

from llds_jax.model import hf_io
from llds_jax.train.checkpoint import Checkpointer, Restored

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Wall-clock measurements differ between runs; everything else must be bitwise equal after a resume.
TIMING_KEYS = ("perf/", "rollout/decode_s", "rollout/search_s", "rollout/search_calls_s",
               "rollout/host_s", "rollout/rollout_s", "rollout/sampled_tokens_per_s",
               "time")


@dataclasses.dataclass
class Launched:
    """A running launch process; its stdout and stderr go to the file `log`."""

    process: subprocess.Popen
    log: str

    def output(self) -> str:
        """What the process printed so far (stdout and stderr interleaved)."""
        with open(self.log) as f:
            return f.read()


def start(config: str, devices: int, log: str, *args: str, env: Mapping[str, str] | None = None,
          launcher: Sequence[str] = ("-m", "llds_jax.launch")) -> Launched:
    """`python -m llds_jax.launch --config=CONFIG ARGS...` on `devices` fake CPU devices, output to the file `log`;
    `env` adds environment variables, `launcher` replaces `-m llds_jax.launch`."""
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu",
           **(env or {})}
    cmd = [sys.executable, *launcher, f"--config={config}", *args]
    with open(log, "w") as out:
        process = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
    return Launched(process, log)


def host_args(port: int, process_id: int, num_processes: int = 2) -> tuple[str, ...]:
    """The overrides that make a launch process `process_id` of a job whose coordinator is on loopback `port`."""
    return (f"--config.distributed.coordinator_address=127.0.0.1:{port}",
            f"--config.distributed.num_processes={num_processes}", f"--config.distributed.process_id={process_id}")


def start_hosts(config: str, devices: int, log_prefix: str, port: int, *args: str, num_processes: int = 2,
                env: Mapping[str, str] | None = None) -> list[Launched]:
    """The `num_processes` processes of one job, `devices` each; process i writes `{log_prefix}{i}.log`."""
    return [start(config, devices, f"{log_prefix}{pid}.log", *args, *host_args(port, pid, num_processes), env=env)
            for pid in range(num_processes)]


def wait_for_text(launched: list[Launched], text: str, timeout_s: float) -> None:
    """Waits until the first process printed `text`; fails with the outputs when a process ends first or after
    `timeout_s` seconds."""
    deadline = time.monotonic() + timeout_s
    while text not in launched[0].output():
        ended = [one for one in launched if one.process.poll() is not None]
        if ended or time.monotonic() > deadline:
            for one in launched:
                one.process.kill()
            why = f"process exited with {ended[0].process.returncode}" if ended else f"{timeout_s} s passed"
            pytest.fail(f"{why} before {text!r} was printed: " + "\n---\n".join(o.output()[-3000:] for o in launched))
        time.sleep(0.2)


def finish(launched: list[Launched], timeout: float) -> list[str]:
    """Waits for every process (killing all of them after `timeout` seconds); asserts exit status 0; returns their
    outputs."""
    try:
        for one in launched:
            one.process.wait(timeout)
    finally:
        for one in launched:
            one.process.kill()
    outputs = [one.output() for one in launched]
    for one, out in zip(launched, outputs):
        assert one.process.returncode == 0, out[-4000:]
    return outputs


def latest_checkpoint(run_dir: str, model_dir: str) -> tuple[Restored, nnx.State]:
    """The run's latest checkpoint (params only) restored onto one device, and the initial params of `model_dir`."""
    model = hf_io.load_model(model_dir, dtype="float32", param_dtype="float32")
    initial = nnx.state(model, nnx.Param)
    ckpt = Checkpointer(os.path.join(run_dir, "checkpoints"), save_every=1, keep=1 << 30)
    try:
        return ckpt.restore_latest(initial), initial
    finally:
        ckpt.close()


def read_metrics(run_dir: str) -> list[dict]:
    """The records of the run's metrics.jsonl."""
    text = (epath.Path(run_dir) / "metrics.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines()]


def comparable(record: dict) -> dict:
    """A metrics record without its wall-clock measurements (TIMING_KEYS)."""
    return {k: v for k, v in record.items() if not k.startswith(TIMING_KEYS)}


def steps_saved(run_dir: str) -> list[int]:
    """The checkpoint steps in a run folder (local or gs://), listed anew (gcsfs caches listings; other processes
    wrote it); [] before the first save."""
    if run_dir.startswith("gs://"):
        epath.backend.fsspec_backend.fs(run_dir).invalidate_cache()
    folder = epath.Path(run_dir) / "checkpoints"
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if folder.exists() else []
