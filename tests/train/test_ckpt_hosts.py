"""Each host's own checkpoint record (issue 59: a host's carried partial rollouts and data position): two processes
save and restore their own (`ckpt_host.py`); one process restoring their step gets none, and the saved counts."""
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from llds_jax.train.checkpoint import Checkpointer
from tests.servers import free_port
from tests.train.ckpt_host import record

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_two_hosts_each_restore_their_own_record_and_one_process_restores_none(tmp_path, mesh):
    folder, port = str(tmp_path / "checkpoints"), free_port()
    hosts = [subprocess.Popen([sys.executable, "-m", "tests.train.ckpt_host", str(pid), str(port), folder],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for pid in (0, 1)]
    try:
        outputs = [host.communicate(timeout=300)[0] for host in hosts]
    finally:
        for host in hosts:
            host.kill()
    for pid, (host, output) in enumerate(zip(hosts, outputs)):
        assert host.returncode == 0, output[-3000:]
        line = next(line for line in output.splitlines() if line.startswith(f"host {pid}: "))
        assert json.loads(line.split(": ", 1)[1]) == {"host_meta": record(pid), "host_count": 2, "same": True,
                                                      "checked": [record(pid)]}
    target = {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=NamedSharding(mesh, P()))}
    restored = Checkpointer(folder, save_every=1, keep=2).restore_latest(target)
    assert (restored.step, restored.meta, restored.host_meta, restored.host_count) == (1, {"n": 1}, None, 2)
    np.testing.assert_array_equal(np.asarray(restored.params["w"]), np.arange(32, dtype=np.float32).reshape(8, 4))
