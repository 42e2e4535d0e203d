"""What `--mode=compile` compiles and reads back (llds_jax/aot/compile_check.py): the programs (`Program`), their
compiled rows of memory per chip (`Row`), the names of the long-lived arrays that stay resident beside them, and
byte counts in words (`format_bytes`).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

from llds_jax.programs import Role

# Long-lived arrays of a run: the policy parameters, the optimizer state (with the step counters), the frozen
# reference parameters. Their bytes per chip are read off the programs that make them (XLA's own layout, padding
# included): "reference copy" reads the params and writes the reference, "optimizer init" writes the state.
PARAMS, OPT_STATE, REFERENCE = "params", "optimizer state", "reference"
# With the retriever on the chips (`retriever.backend = "e5_device"`): its index shard stays in HBM for the whole run
# (INDEX: the first search program's arguments, the shard and one batch of queries), and its search runs while a
# rollout session holds its KV cache and rollout params (SESSION: the largest rollout program's arguments). An e5
# query encoder on the chips keeps its parameters on each host's first chip for the whole run (ENCODER: the first,
# smallest encoder program's arguments, the parameters and one batch of token ids and masks) and runs, like the
# search, beside a rollout session.
INDEX, SESSION, ENCODER = "retrieval index", "rollout session", "query encoder"
PAGE_POOL = "page pool"  # the paged engine's KV cache: allocated once, resident beside every other program


@dataclasses.dataclass(frozen=True)
class Program:
    """One program to compile: its name, the shapes it runs at, the program lowered (`jax.stages.Lowered`), the
    long-lived arrays (PARAMS, OPT_STATE, REFERENCE) that stay in HBM while it runs without being its arguments,
    whether it is a rollout program (run on the rollout copy of the params), and what the step estimate needs."""

    name: str
    shapes: str
    lowered: Any
    resident: tuple[str, ...]
    role: Optional[Role] = None  # what it does (`llds_jax.programs.Role`); None: a program of no run
    rollout: bool = False
    pool_bytes: float = 0.0  # the paged engine's page pool per chip (an argument of its rollout programs)
    calls: float = 0.0  # calls per training step of an HLO-costed program (`llds_jax.aot.step_estimate`)


@dataclasses.dataclass(frozen=True)
class Row:
    """One compiled program's memory per chip (bytes; `total` without the resident arrays until
    `with_resident`) and compile time; `error` when it did not compile. `gathers`: (element type, dims) of every
    all-gather's output (`all_gather_shapes`); `collectives`: (kind, dims) of every result and operand of the
    collectives that move arrays (`collective_shapes`)."""

    name: str
    shapes: str
    arguments: float = 0.0
    outputs: float = 0.0
    temporaries: float = 0.0
    resident: float = 0.0
    total: float = 0.0
    compile_s: float = 0.0
    error: str = ""
    gathers: tuple[tuple[str, tuple[int, ...]], ...] = ()
    collectives: tuple[tuple[str, tuple[int, ...]], ...] = ()
    cost: Any = None  # llds_jax.aot.roofline.HloCost of one call

    @property
    def gather(self) -> str:
        """The largest all-gather's output, e.g. "bf16[16,4096,3584]" ("" when the program has none)."""
        if not self.gathers:
            return ""
        dtype, dims = max(self.gathers, key=lambda g: math.prod(g[1]))
        return f"{dtype}[{','.join(map(str, dims))}]"

    def with_resident(self, resident: float) -> "Row":
        return dataclasses.replace(self, resident=resident, total=self.total + resident)


UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def format_bytes(n: float) -> str:
    """1.5 * 2**30 -> '1.50G', 3 * 2**20 -> '3.00M', 512 -> '0.50K' (binary units)."""
    for unit in "TGM":
        if n >= UNITS[unit]:
            return f"{n / UNITS[unit]:.2f}{unit}"
    return f"{n / UNITS['K']:.2f}K"
