"""One host of `test_ckpt_hosts.py`: process `pid` of 2 on loopback `port`, 4 CPU devices each.

    python -m tests.train.ckpt_host PID PORT FOLDER

Saves step 1 (an [8, 4] array over both hosts' 8 devices, and this host's own record: a length and characters of
its own) and waits for it, then restores it through a fresh Checkpointer. Prints one line: `host PID: ` and, as
JSON, the restored host record, the host count, whether the array came back equal and the record `check_meta`
was given.
"""
import json
import os
import sys


def record(pid: int) -> dict:
    """Host `pid`'s record: the hosts' records differ in length (each row is padded to the longest) and hold
    characters of more than one byte."""
    return {"host": pid, "text": "é" * (3 + 40 * pid), "position": [pid, 7]}


def main(pid: int, port: int, folder: str) -> None:
    from llds_jax.runtime import distributed

    distributed.maybe_initialize(f"127.0.0.1:{port}", 2, pid)
    import jax
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding, PartitionSpec

    from llds_jax import parallel
    from llds_jax.train.checkpoint import Checkpointer

    sharding = NamedSharding(parallel.make_mesh(1, -1, 1), PartitionSpec("fsdp", None))
    values = np.arange(32, dtype=np.float32).reshape(8, 4)
    params = {"w": jax.make_array_from_callback(values.shape, sharding, lambda index: values[index])}
    saver = Checkpointer(folder, save_every=1, keep=2)
    saver.save(1, params, (), {"n": 1}, host_meta=record(pid))
    saver.close()
    checked = []
    restored = Checkpointer(folder, save_every=1, keep=2).restore_latest(
        jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params), None,
        check_meta=lambda meta, host_meta: checked.append(host_meta))
    same = bool(np.array_equal(multihost_utils.process_allgather(restored.params["w"], tiled=True), values))
    print(f"host {pid}: " + json.dumps({"host_meta": restored.host_meta, "host_count": restored.host_count,
                                        "same": same, "checked": checked}), flush=True)


if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"  # before jax is imported
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
