"""Multi-host start-up: `jax.distributed.initialize` when the job spans several processes, and host agreement.

Call `maybe_initialize()` first thing in a process, before anything touches a JAX backend (`jax.devices()`, any
array). It initializes the distributed runtime when

1. `coordinator_address` is given (with `num_processes` and `process_id`): explicit, e.g. several CPU processes on
   one machine or a GPU cluster without a scheduler JAX knows. The CPU backend then uses gloo collectives (it has
   none across processes otherwise); the setting does not affect TPU or GPU backends.
2. the environment names a multi-process job, checked in this order:
   - `JAX_COORDINATOR_ADDRESS` is set (JAX's own variables, read by `jax.distributed.initialize`);
   - `MEGASCALE_COORDINATOR_ADDRESS` is set (a multislice TPU job);
   - `TPU_PROCESS_ADDRESSES` or `TPU_WORKER_HOSTNAMES` lists more than one host (GKE TPU slices and others that
     export them);
   - on a Cloud TPU VM (a `/dev/accel*` or `/dev/vfio/[0-9]*` device exists), the GCE metadata attribute
     `worker-network-endpoints` lists more than one worker (TPU VM pod slices made with
     `gcloud compute tpus tpu-vm create`, which export none of the variables above).
   JAX then finds the coordinator, process count and id itself.

Otherwise the process runs alone and nothing is initialized. `CLOUD_TPU_TASK_ID` is not checked: it gives this
host's index but not the host count.
"""
from __future__ import annotations

import glob
import logging
import os
import urllib.request
from collections.abc import Callable, Mapping

import jax
import numpy as np
from jax.experimental import multihost_utils

from llds_jax.errors import InputError

log = logging.getLogger(__name__)

METADATA_URL = "http://metadata.google.internal/computeMetadata/v1/instance/attributes/worker-network-endpoints"
TPU_DEVICE_GLOBS = ("/dev/accel*", "/dev/vfio/[0-9]*")


def _tpu_vm_worker_count() -> int:
    """Workers of this Cloud TPU VM's slice from the metadata server; 1 when not on a TPU VM or unreachable."""
    if not any(glob.glob(pattern) for pattern in TPU_DEVICE_GLOBS):
        return 1
    request = urllib.request.Request(METADATA_URL, headers={"Metadata-Flavor": "Google"})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            endpoints = response.read().decode()
    except OSError as e:
        log.warning("on a TPU VM but the metadata server did not answer %s (%s); assuming one host", METADATA_URL, e)
        return 1
    return len([worker for worker in endpoints.split(",") if worker.strip()])


def multi_process_reason(env: Mapping[str, str] | None = None,
                         tpu_vm_worker_count: Callable[[], int] | None = None) -> str | None:
    """Why the environment looks like a multi-process job (see the module docstring), or None.

    Args:
      env: environment variables (default `os.environ`).
      tpu_vm_worker_count: workers of this TPU VM slice (default: asks the metadata server when on a TPU VM).
    """
    env = os.environ if env is None else env
    tpu_vm_worker_count = tpu_vm_worker_count or _tpu_vm_worker_count
    for name in ("JAX_COORDINATOR_ADDRESS", "MEGASCALE_COORDINATOR_ADDRESS"):
        if env.get(name):
            return f"{name} is set"
    for name in ("TPU_PROCESS_ADDRESSES", "TPU_WORKER_HOSTNAMES"):
        hosts = [host for host in env.get(name, "").split(",") if host.strip()]
        if len(hosts) > 1:
            return f"{name} lists {len(hosts)} hosts"
    workers = tpu_vm_worker_count()
    if workers > 1:
        return f"the TPU VM metadata lists {workers} workers"
    return None


def maybe_initialize(coordinator_address: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None) -> bool:
    """Initializes `jax.distributed` when needed (module docstring); returns whether it is initialized.

    Idempotent: a second call (with any arguments) does nothing once initialized.

    Args:
      coordinator_address: "host:port" of process 0's coordinator service; needs the other two arguments.
      num_processes: processes in the job.
      process_id: this process, in [0, num_processes).
    """
    if jax.distributed.is_initialized():
        return True
    if coordinator_address is not None:
        if num_processes is None or process_id is None:
            raise InputError("maybe_initialize: coordinator_address needs num_processes and process_id too")
        if not 0 <= process_id < num_processes:
            raise InputError(f"maybe_initialize: process_id {process_id} is not in [0, {num_processes})")
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        log.info("initializing jax.distributed: process %d of %d, coordinator %s", process_id, num_processes,
                 coordinator_address)
        jax.distributed.initialize(coordinator_address, num_processes, process_id)
        return True
    if num_processes is not None or process_id is not None:
        raise InputError("maybe_initialize: num_processes and process_id need coordinator_address")
    reason = multi_process_reason()
    if reason is None:
        return False
    log.info("initializing jax.distributed (auto-detected: %s)", reason)
    jax.distributed.initialize()
    return True


def is_main_process() -> bool:
    """True on process 0, the one that writes logs, metrics and shared files."""
    return jax.process_index() == 0


def any_process(flag: bool) -> bool:
    """True when `flag` is true on any process; every process must call it at the same point (a collective)."""
    if jax.process_count() == 1:
        return bool(flag)
    flags = multihost_utils.process_allgather(np.array([int(bool(flag))], np.int32))
    return bool(np.asarray(flags).any())


def largest(value: int) -> int:
    """The largest `value` of every process; every process must call it at the same point (a collective)."""
    if jax.process_count() == 1:
        return int(value)
    return int(np.max(multihost_utils.process_allgather(np.array([value], np.int64))))


def barrier(name: str) -> None:
    """Waits until every process reaches the barrier `name` (a no-op for one process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)
