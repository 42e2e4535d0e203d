"""The TPU slices a run may name (`mesh.topology`, `--topology`): each generation's chip configuration, HBM per chip,
documented slice shapes and accelerator-type alias, and the resolution of a topology name.

A leaf (plain Python): the run config is checked against it before anything loads (`llds_jax.checks`), and
`--mode=compile` (`llds_jax.aot.compile_check`) builds its abstract devices from it.
"""
from __future__ import annotations

import dataclasses
import math

from llds_jax.errors import InputError


@dataclasses.dataclass(frozen=True)
class Generation:
    """One TPU generation as `get_topology_desc` takes it.

    Attributes:
      chip_config: its `chip_config_name` ("megacore": one device per chip of two TensorCores).
      hbm_gib: nominal HBM per chip.
      shapes: slice shapes ("2x2x4") of the generation's documented slices.
      alias: prefix of its accelerator-type names ("v4-" in v4-32).
      cores_per_chip: TensorCores an accelerator-type name counts per chip (v4-32 is 16 chips).
      host_programs_alone: a program over one host's chips of a multi-host slice is compiled for a one-host
        topology of the generation (`aot.compile_check.host_chips`): libtpu 0.0.42.1 does not lower a collective
        over a subset of a multi-host v6e topology's chips ("Unexpected device_id 4 [0:2] in replica group").
    """

    chip_config: str
    hbm_gib: float
    shapes: tuple[str, ...]
    alias: str
    cores_per_chip: int
    host_programs_alone: bool = False


_CUBES = ("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8", "8x8x16", "8x16x16")
_SQUARES = ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16")
GENERATIONS: dict[str, Generation] = {
    "v4": Generation("megacore", 32, _CUBES, "v4-", 2),
    "v5p": Generation("megacore", 95, _CUBES, "v5p-", 2),
    "v5e": Generation("default", 16, _SQUARES, "v5litepod-", 1),
    "v6e": Generation("default", 32, _SQUARES, "v6e-", 1, host_programs_alone=True),
}


class TopologyError(InputError):
    """An unknown topology name; the message lists the valid ones."""


def shape_chips(shape: str) -> int:
    """Chips of a slice shape ("2x2x4": 16)."""
    return math.prod(int(n) for n in shape.split("x"))


def valid_topologies() -> list[str]:
    """Every topology name `resolve` takes, as GENERATION:SHAPE."""
    return [f"{gen}:{shape}" for gen, g in GENERATIONS.items() for shape in g.shapes]


def resolve(name: str) -> tuple[str, str]:
    """(generation, slice shape) of a topology name: "v4:2x2x4" or its accelerator type "v4-32".

    Raises TopologyError listing the valid names."""
    name = name.strip()
    for gen, g in GENERATIONS.items():
        if name.startswith(f"{gen}:") and name[len(gen) + 1:] in g.shapes:
            return gen, name[len(gen) + 1:]
        if name.startswith(g.alias) and name[len(g.alias):].isdigit():
            chips = int(name[len(g.alias):]) // g.cores_per_chip
            shape = next((s for s in g.shapes if shape_chips(s) == chips), None)
            if shape is not None and chips * g.cores_per_chip == int(name[len(g.alias):]):
                return gen, shape
    aliases = ", ".join(f"{g.alias}N" for g in GENERATIONS.values())
    raise TopologyError(f"unknown TPU topology {name!r}; valid: {', '.join(valid_topologies())} (or the "
                        f"accelerator types {aliases} of those slices)")


def chips(name: str) -> int:
    """Chips (devices) of a topology name."""
    return shape_chips(resolve(name)[1])
