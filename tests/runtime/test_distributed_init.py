"""distributed: environment detection, argument checks, and a real two-process run on loopback."""
import textwrap

import jax
import pytest

from llds_jax.runtime import distributed
from tests.servers import two_process_results


@pytest.mark.parametrize("env, tpu_vm_workers, reason", [
    ({}, 1, None),
    ({"JAX_COORDINATOR_ADDRESS": "10.0.0.2:1234"}, 1, "JAX_COORDINATOR_ADDRESS is set"),
    ({"MEGASCALE_COORDINATOR_ADDRESS": "10.0.0.2"}, 1, "MEGASCALE_COORDINATOR_ADDRESS is set"),
    ({"TPU_WORKER_HOSTNAMES": "t1k-0,t1k-1,t1k-2,t1k-3"}, 1, "TPU_WORKER_HOSTNAMES lists 4 hosts"),
    ({"TPU_PROCESS_ADDRESSES": "10.0.0.2:8476,10.0.0.3:8476"}, 1, "TPU_PROCESS_ADDRESSES lists 2 hosts"),
    ({"TPU_WORKER_HOSTNAMES": "localhost"}, 1, None),
    ({"CLOUD_TPU_TASK_ID": "0"}, 1, None),
    ({}, 4, "the TPU VM metadata lists 4 workers"),
])
def test_multi_process_detection(env, tpu_vm_workers, reason):
    assert distributed.multi_process_reason(env, lambda: tpu_vm_workers) == reason


def test_single_process_is_left_alone(monkeypatch):
    for name in ("JAX_COORDINATOR_ADDRESS", "MEGASCALE_COORDINATOR_ADDRESS", "TPU_PROCESS_ADDRESSES",
                 "TPU_WORKER_HOSTNAMES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(distributed, "_tpu_vm_worker_count", lambda: 1)
    assert distributed.maybe_initialize() is False
    assert not jax.distributed.is_initialized()
    assert distributed.is_main_process()
    assert distributed.any_process(True) is True and distributed.any_process(False) is False


def test_argument_errors():
    with pytest.raises(ValueError, match="coordinator_address needs num_processes and process_id"):
        distributed.maybe_initialize("127.0.0.1:1", num_processes=2)
    with pytest.raises(ValueError, match="process_id 2 is not in \\[0, 2\\)"):
        distributed.maybe_initialize("127.0.0.1:1", num_processes=2, process_id=2)
    with pytest.raises(ValueError, match="need coordinator_address"):
        distributed.maybe_initialize(num_processes=2, process_id=0)


WORKER = textwrap.dedent("""
    import json, os, signal, sys, time
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from llds_jax.runtime import distributed
    from llds_jax.train.preemption import PreemptionGuard

    port, pid = sys.argv[1], int(sys.argv[2])
    first = distributed.maybe_initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
    again = distributed.maybe_initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
    mesh = jax.make_mesh((8,), ("data",))
    local = np.arange(4, dtype=np.float32) + 4 * pid  # global array 0..7, 4 rows per process
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), local, (8,))
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(x)
    with PreemptionGuard() as guard:
        guard.defer()  # the training loop's mode: the signal is recorded, the check is a collective
        if pid == 1:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.01)
        stop = guard.should_stop()
        local_flag = guard.requested
    print("RESULT " + json.dumps({
        "first": first, "again": again, "devices": jax.device_count(), "local": jax.local_device_count(),
        "processes": jax.process_count(), "main": distributed.is_main_process(), "sum": float(total),
        "any_false": distributed.any_process(False), "any_one": distributed.any_process(pid == 0),
        "stop": stop, "local_flag": local_flag}), flush=True)
""")


@pytest.mark.slow
def test_two_processes_on_loopback(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    results = two_process_results(str(script), timeout=50)
    common = {"first": True, "again": True, "devices": 8, "local": 4, "processes": 2, "sum": 28.0,
              "any_false": False, "any_one": True, "stop": True}
    assert results[0] == {**common, "main": True, "local_flag": False}
    assert results[1] == {**common, "main": False, "local_flag": True}
