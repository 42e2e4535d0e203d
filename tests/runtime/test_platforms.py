"""A launch on a machine without an accelerator uses the CPU only, so that an installed libtpu prints nothing
(issue 70 item 4: a CPU launch opened with 5 lines of libtpu's)."""
import os
import subprocess
import sys

import pytest

from llds_jax.runtime import platforms

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LIBTPU_LINES = ("Failed to find host bounds", "Logging before InitGoogle", "unexpected worker hostname", "libtpu")


def machine(root, files: dict[str, str]):
    for path, text in files.items():
        os.makedirs(os.path.dirname(root / path), exist_ok=True)
        (root / path).write_text(text)
    return str(root)


@pytest.mark.parametrize("files, accelerator", [
    ({"sys/bus/pci/devices/0000:00:04.0/vendor": "0x8086\n"}, False),  # an Intel device only
    ({"dev/accel0": ""}, True),  # TPU v4
    ({"dev/vfio/0": "", "dev/vfio/vfio": ""}, True),  # TPU v5e and later
    ({"dev/vfio/vfio": ""}, False),  # the VFIO control file alone: no device bound
    ({"sys/bus/pci/devices/0000:00:05.0/vendor": "0x1ae0\n"}, True),  # a Google PCI device
    ({"dev/nvidia0": ""}, True),
])
def test_an_accelerator_is_found_by_its_device_files(tmp_path, files, accelerator):
    assert platforms.has_accelerator(machine(tmp_path, files)) is accelerator


def test_the_cpu_is_chosen_only_without_an_accelerator_and_a_users_choice(tmp_path):
    bare = machine(tmp_path / "bare", {"sys/bus/pci/devices/0000:00:04.0/vendor": "0x8086\n"})
    tpu = machine(tmp_path / "tpu", {"dev/accel0": ""})
    environ = {}
    assert platforms.use_cpu_without_accelerator(environ, bare) is True and environ == {"JAX_PLATFORMS": "cpu"}
    environ = {}
    assert platforms.use_cpu_without_accelerator(environ, tpu) is False and environ == {}
    environ = {"JAX_PLATFORMS": "tpu,cpu"}
    assert platforms.use_cpu_without_accelerator(environ, bare) is False and environ == {"JAX_PLATFORMS": "tpu,cpu"}


@pytest.mark.skipif(platforms.has_accelerator(), reason="a machine without an accelerator")
def test_a_cpu_launch_tries_no_tpu_and_prints_only_its_error():
    """A launch that ends right after JAX's backends start (a mesh the one CPU device cannot hold): its stderr is its
    error line, and JAX's platforms were the CPU alone (libtpu fails without printing while another process holds
    its lock file, as a TPU compile does: so the platforms are checked as well as the lines)."""
    runner = ("import atexit, runpy, sys\n"
              "atexit.register(lambda: print('platforms:', sys.modules['jax'].config.jax_platforms, file=sys.stderr))\n"
              "sys.argv = ['llds_jax.launch', *sys.argv[1:]]\n"
              "runpy.run_module('llds_jax.launch', run_name='__main__', alter_sys=True)\n")
    env = {key: value for key, value in os.environ.items() if key not in ("JAX_PLATFORMS", "XLA_FLAGS")}  # 1 device
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    proc = subprocess.run([sys.executable, "-c", runner, "--config=configs/demo_cpu.py", "--config.mesh.data=3"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "llds_jax: error: mesh: 1 devices cannot be split into data=3 x fsdp=1 x tensor=1 (1 is not a multiple of 3)",
        "platforms: cpu"]
    assert not any(line in proc.stderr for line in LIBTPU_LINES)
