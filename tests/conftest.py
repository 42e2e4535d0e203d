"""Shared test setup: 8 fake CPU devices (set before JAX is imported), GCS clients kept from credential searches
(set before gcsfs, fsspec and google.auth are imported), a GCS emulator for the gs:// tests (started when a test first
needs it) and shared fixtures."""
import contextlib
import hashlib
import os
import re
import sys
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# A persistent compilation cache for the suite and the launches it runs as subprocesses: a program one test compiled
# is read back by the next test (or pytest-xdist worker) that builds it, and by the next run of the suite. One per
# checkout and interpreter (another clone, user or virtual environment keeps its own, so no foreign entry is read).
_CHECKOUT = hashlib.sha256(f"{os.path.dirname(os.path.abspath(__file__))}|{sys.prefix}".encode()).hexdigest()[:12]
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(tempfile.gettempdir(), f"llds_jax_test_jax_cache_{_CHECKOUT}"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

from tests import gcs_emulator  # noqa: E402

os.environ.update(gcs_emulator.client_settings())
GCS_BUCKET = "llds-test"

import jax  # noqa: E402
import pytest  # noqa: E402

from llds_jax.model import tokenizer as tokenizer_lib  # noqa: E402
from tests.run_fixtures import (answer_policy, config_writer, launch, policy, repo_root,  # noqa: E402,F401
                                tiny_assets, world)
from tests.servers import NoidaServer, free_port  # noqa: E402

ES_URL_ENV = "LLDS_ES_URL"


@pytest.fixture(scope="session")
def qwen_tokenizer_dir(tmp_path_factory):
    """A folder holding the real Qwen2.5 (base) tokenizer, built offline."""
    return tokenizer_lib.write_qwen25_tokenizer(str(tmp_path_factory.mktemp("qwen25_tok")), "base")


@pytest.fixture(scope="session")
def qwen_tokenizer(qwen_tokenizer_dir):
    """The real Qwen2.5 base tokenizer (eos <|endoftext|>, base chat template)."""
    return tokenizer_lib.load_tokenizer(qwen_tokenizer_dir)


@pytest.fixture(scope="session")
def qwen_instruct_tokenizer(tmp_path_factory):
    """The real Qwen2.5 instruct tokenizer (eos <|im_end|>, instruct chat template)."""
    path = tokenizer_lib.write_qwen25_tokenizer(str(tmp_path_factory.mktemp("qwen25_inst")), "instruct")
    return tokenizer_lib.load_tokenizer(path)


@contextlib.contextmanager
def _backend_compiles():
    events = []
    on_compile = lambda event, duration, **kw: (  # noqa: E731
        events.append(event) if event.endswith("backend_compile_duration") else None)
    on_cache_hit = lambda event, **kw: (  # noqa: E731
        events.append(event) if event == "/jax/compilation_cache/cache_hits" else None)
    jax.monitoring.register_event_duration_secs_listener(on_compile)
    jax.monitoring.register_event_listener(on_cache_hit)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(on_compile)
        jax.monitoring.unregister_event_listener(on_cache_hit)


@pytest.fixture
def backend_compiles():
    """`with backend_compiles() as events:` collects one entry per executable built inside the block (by any
    program, ahead-of-time or at a call): compiled by XLA or read from the suite's persistent compilation cache."""
    return _backend_compiles


@pytest.fixture(scope="session")
def gcs_server():
    """A fake-gcs-server emulator for the session (in-memory), with this process's GCS clients pointed at it."""
    server = gcs_emulator.Emulator()
    server.start()
    os.environ.update(gcs_emulator.endpoint_settings(server.url))
    try:
        yield server
    finally:
        server.stop()
        for key in gcs_emulator.endpoint_settings(server.url):
            os.environ.pop(key)


@pytest.fixture(scope="session")
def gcs_bucket(gcs_server):
    """"gs://llds-test", a bucket of the emulator."""
    return gcs_server.create_bucket(GCS_BUCKET)


@pytest.fixture
def gcs_dir(gcs_bucket, request):
    """A gs:// folder of the emulator's bucket that no other test uses (named after the test)."""
    return f"{gcs_bucket}/{re.sub(r'[^A-Za-z0-9_.-]+', '_', request.node.name)}"


@pytest.fixture(scope="session")
def gcs_env(gcs_server, gcs_bucket):
    """The environment settings that point a subprocess's GCS clients at the emulator (a dict to add to its env)."""
    return gcs_emulator.environment(gcs_server.url)


@pytest.fixture(scope="session")
def unreachable_gcs_env():
    """The same settings for an endpoint where nothing listens."""
    return gcs_emulator.environment(f"http://127.0.0.1:{free_port()}")


@pytest.fixture(scope="session")
def gcs_fs(gcs_bucket):
    """A gcsfs file system on the emulator, to put test inputs into the bucket and read outputs back."""
    import gcsfs

    return gcsfs.GCSFileSystem()


@pytest.fixture(scope="session")
def es_url(tmp_path_factory):
    """URL of the cluster at env LLDS_ES_URL, else of a noida-db server started for the session."""
    if os.environ.get(ES_URL_ENV):
        yield os.environ[ES_URL_ENV]
        return
    server = NoidaServer(str(tmp_path_factory.mktemp("noida")), free_port()).start()
    yield server.url
    server.stop()
