"""The JAX platforms of a command on a machine without an accelerator: the CPU only.

With JAX_PLATFORMS unset, JAX tries every backend it knows, the TPU one among them. Where libtpu is installed (the
test extra brings it) but no TPU is attached, that try loads libtpu, which prints 5 lines to stderr
(`Failed to find host bounds for accelerator type`, `WARNING: Logging before InitGoogle()`, `E0000 ...
INVALID_ARGUMENT: Error: unexpected worker hostname ...`) and then fails quietly: a CPU launch opened with them
(issue 70). `use_cpu_without_accelerator` sets JAX_PLATFORMS=cpu there, before JAX is imported, so that JAX never
loads libtpu. It leaves JAX_PLATFORMS the user set, and any machine with a TPU or GPU, as they are. `--mode=compile`
does not call it: it compiles with libtpu's compiler for a topology without its chips.
"""
from __future__ import annotations

import glob
import os
from collections.abc import MutableMapping

GOOGLE_PCI_VENDOR = "0x1ae0"  # a TPU chip's PCI vendor id (as JAX's hardware_utils finds TPUs)
# Device files of an attached accelerator: TPU (v4: /dev/accel*, v5e and later: /dev/vfio/N), NVIDIA GPU (also in
# containers and WSL2), AMD GPU.
ACCELERATOR_FILES = ("dev/accel*", "dev/vfio/[0-9]*", "dev/nvidia0", "dev/nvidiactl", "dev/dxg", "dev/kfd")


def has_accelerator(root: str = "/") -> bool:
    """Whether the machine whose file system is at `root` has a TPU or GPU: one of ACCELERATOR_FILES, or a PCI
    device of Google's vendor id."""
    if any(glob.glob(os.path.join(root, pattern)) for pattern in ACCELERATOR_FILES):
        return True
    for vendor in glob.glob(os.path.join(root, "sys/bus/pci/devices/*/vendor")):
        try:
            with open(vendor, encoding="ascii") as f:
                if f.read().strip() == GOOGLE_PCI_VENDOR:
                    return True
        except OSError:
            continue
    return False


def use_cpu_without_accelerator(environ: MutableMapping[str, str] = os.environ, root: str = "/") -> bool:
    """Sets JAX_PLATFORMS=cpu in `environ` when it is unset (or empty) and the machine has no accelerator
    (`has_accelerator`); returns whether it did. Call it before JAX is imported: JAX reads the variable then."""
    if environ.get("JAX_PLATFORMS") or has_accelerator(root):
        return False
    environ["JAX_PLATFORMS"] = "cpu"
    return True
