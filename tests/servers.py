"""Servers and processes the tests start or talk to: free loopback ports, polling, a noida-db Elasticsearch-API
server, Elasticsearch index clean-up, two-process JAX runs.

Import as `from tests.servers import ...` (pytest.ini puts the repository root on sys.path)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from elasticsearch import Elasticsearch


def free_port() -> int:
    """A loopback TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(ready, timeout_s: float, what: str) -> None:
    """Polls `ready()` every 50 ms until it is true; fails the test naming `what` after `timeout_s` seconds."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} not ready within {timeout_s} s")
        time.sleep(0.05)


def http_ok(url: str) -> bool:
    """Whether a GET of `url` answers 200 within a second."""
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, OSError):
        return False


def port_open(port: int) -> bool:
    """Whether something listens on loopback `port`."""
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


class NoidaServer:
    """A noida-db Elasticsearch-API server in the foreground as a child process; `stop` and `start` keep its data."""

    def __init__(self, data_dir: str, port: int):
        self.data_dir, self.port = data_dir, port
        self.url = f"http://127.0.0.1:{port}"
        self._process: subprocess.Popen | None = None

    def start(self) -> NoidaServer:
        exe = shutil.which("noida-db")
        if exe is None:
            pytest.skip("noida-db is not installed (pip install noida-db)")
        # Its own process group: `noida-db` is a launcher whose server child must stop with it.
        self._process = subprocess.Popen(
            [exe, "start", "--only", "elasticsearch", "--data-dir", self.data_dir,
             "--elasticsearch-port", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        wait_until(lambda: http_ok(self.url), 15, f"noida-db on port {self.port}")
        return self

    def stop(self) -> None:
        """Stops the launcher and its server (the whole process group started above)."""
        if self._process is not None:
            try:
                os.killpg(self._process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            self._process.wait(10)
            wait_until(lambda: not port_open(self.port), 10, f"noida-db on port {self.port} to stop")
        self._process = None


def delete_es_index(url: str, name: str) -> None:
    """Deletes index `name` (a real cluster keeps test indexes otherwise); ignores a missing one."""
    client = Elasticsearch(url)
    try:
        client.options(ignore_status=404).indices.delete(index=name)
    finally:
        client.close()


def two_process_results(script: str, *args: str, timeout: float) -> list[dict]:
    """Runs `python script PORT PID *args` as processes 0 and 1 of a two-process JAX run on CPU (4 devices each) and
    returns each one's JSON printed after "RESULT " (asserting it exited 0, its output in the message)."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, script, port, str(pid), *args], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for pid in (0, 1)]
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    results = []
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out
        [line] = [line for line in out.splitlines() if line.startswith("RESULT ")]
        results.append(json.loads(line[len("RESULT "):]))
    return results
