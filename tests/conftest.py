"""Shared test setup: 8 fake CPU devices (set before JAX is imported), gs:// clients pointed at a GCS emulator (set
before gcsfs, fsspec and google.auth are imported; the emulator itself starts when a test first needs it) and
shared fixtures."""
import contextlib
import importlib.util
import os
import re

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _load_sibling(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(os.path.dirname(__file__), name + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gcs_emulator = _load_sibling("gcs_emulator")
GCS_PORT = gcs_emulator.free_port()
os.environ.update(gcs_emulator.environment(f"http://127.0.0.1:{GCS_PORT}"))
GCS_BUCKET = "llds-test"

import jax  # noqa: E402
import pytest  # noqa: E402

from llds_jax import tokenizer as tokenizer_lib  # noqa: E402


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
    listener = lambda event, duration, **kw: (  # noqa: E731
        events.append(duration) if event.endswith("backend_compile_duration") else None)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


@pytest.fixture
def backend_compiles():
    """`with backend_compiles() as events:` collects one entry per XLA compilation inside the block (by any
    program, ahead-of-time or at a call)."""
    return _backend_compiles


@pytest.fixture(scope="session")
def gcs_bucket():
    """"gs://llds-test": a bucket of the fake-gcs-server emulator (started for the session on the port that the
    environment set above names; in-memory, gone when the session ends)."""
    server = gcs_emulator.Emulator(GCS_PORT)
    server.start()
    try:
        yield server.create_bucket(GCS_BUCKET)
    finally:
        server.stop()


@pytest.fixture
def gcs_dir(gcs_bucket, request):
    """A gs:// folder of the emulator's bucket that no other test uses (named after the test)."""
    return f"{gcs_bucket}/{re.sub(r'[^A-Za-z0-9_.-]+', '_', request.node.name)}"


@pytest.fixture(scope="session")
def gcs_env(gcs_bucket):
    """The environment settings that point a subprocess's GCS clients at the running emulator (a dict to add to
    its env)."""
    return gcs_emulator.environment(f"http://127.0.0.1:{GCS_PORT}")


@pytest.fixture(scope="session")
def unreachable_gcs_env():
    """The same settings for an endpoint where nothing listens."""
    return gcs_emulator.environment(f"http://127.0.0.1:{gcs_emulator.free_port()}")


@pytest.fixture(scope="session")
def gcs_fs(gcs_bucket):
    """A gcsfs file system on the emulator, to put test inputs into the bucket and read outputs back."""
    import gcsfs

    return gcsfs.GCSFileSystem()
