"""The rollout's copy of the params on several hosts (issue 43): built by a compiled reshard over the chips, never
through host memory, equal bit for bit to the copy each host gathered before (`reshard_host.py`, two processes)."""
import os
import subprocess
import sys

import pytest

from tests.servers import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CASES = [f"same {mesh} tensor_parallel={t} kv_repeat={r}" for mesh in ("id-order", "interleaved")
         for t, r in ((0, 1), (2, 1), (4, 2))]


@pytest.mark.slow
def test_two_hosts_reshard_on_device_to_the_gathered_copy_bit_for_bit():
    port = free_port()
    hosts = [subprocess.Popen([sys.executable, "-m", "tests.rollout.reshard_host", str(pid), str(port)], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for pid in (0, 1)]
    try:
        outputs = [host.communicate(timeout=300)[0] for host in hosts]
    finally:
        for host in hosts:
            host.kill()
    for host, output in zip(hosts, outputs):
        assert host.returncode == 0, output[-3000:]
        assert [line.split(":")[0] for line in output.splitlines() if line.startswith("same ")] == CASES, output
