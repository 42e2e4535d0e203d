"""Fast answers (issue 70 item 5): `--help` of every entry point, and a bad value of a run config, are answered
before the heavy libraries (JAX, flax, torch, faiss, transformers, Elasticsearch's client, pyarrow) are imported.
What each command imported is read at its exit (an atexit hook), not timed: bench rows in docs/benchmarks.md hold
the times."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HEAVY = ("jax", "flax", "optax", "orbax", "torch", "faiss", "transformers", "elasticsearch", "pyarrow")
# Runs the module as `python -m MODULE ARGS...` does, and prints, as its last line, the heavy modules imported by
# the time the command exits.
RUNNER = ("import atexit, runpy, sys\n"
          f"HEAVY = {HEAVY!r}\n"
          "atexit.register(lambda: print('imported:', sorted(m for m in HEAVY if m in sys.modules), file=sys.stderr))\n"
          "module, sys.argv = sys.argv[1], sys.argv[1:]\n"
          "runpy.run_module(module, run_name='__main__', alter_sys=True)\n")


def answer(module: str, *args: str) -> tuple[int, str, str, str]:
    """(exit status, stdout, stderr without the last line, the runner's last line) of `python -m module args`."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    proc = subprocess.run([sys.executable, "-c", RUNNER, module, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    *stderr, imported = proc.stderr.rstrip("\n").split("\n")
    return proc.returncode, proc.stdout, "\n".join(stderr), imported


@pytest.mark.parametrize("module, usage", [
    ("llds_jax.launch", "python -m llds_jax.launch --config=configs/demo_cpu.py"),
    ("index_builder", "usage: python -m index_builder [-h]"),
    ("llds_jax.apps.demo_study", "usage: python -m llds_jax.apps.demo_study [-h]"),
    ("llds_jax.search.server", "usage: python -m llds_jax.search.server [-h]"),
])
def test_help_imports_no_heavy_library(module, usage):
    status, stdout, stderr, imported = answer(module, "--help")
    assert (status, stderr) == (0, "")
    assert usage in stdout
    assert imported == "imported: []"


@pytest.mark.parametrize("override, message", [
    ("--config.objective.llds.lam=-1", "llds_jax: error: objective.llds.lam must be >= 0, got -1.0"),
    ("--config.model.dtype=bf16",
     "llds_jax: error: model.dtype must be one of 'float32', 'bfloat16', 'float16', got 'bf16'"),
    ("--config.train.totl_steps=3",
     "llds_jax: error: unknown config key train.totl_steps (did you mean train.total_steps?)"),
])
def test_a_bad_value_is_reported_before_the_heavy_imports(override, message):
    status, stdout, stderr, imported = answer("llds_jax.launch", "--config=configs/demo_cpu.py", override)
    assert (status, stdout, stderr) == (2, "", message)
    assert imported == "imported: []"
