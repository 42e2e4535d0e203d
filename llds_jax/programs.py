"""Programs at abstract arguments: what `--mode=compile` (llds_jax/aot/compile_check.py) lowers and compiles.

Each part of a run that executes jitted programs implements `CompilablePrograms`: asked at the shapes of a run (its
own description of them, e.g. the rollout's params, `rl.train_step.TrainShapes`), it names every program
it runs, each with its jitted function and the abstract arguments it runs it at (ShapeDtypeStructs carrying the
shardings a run gives them). `AbstractProgram.lower` traces one without devices (on a deviceless TPU topology's
mesh too); compile_check compiles the result and reads its memory per chip.
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
from typing import Any, Optional, Protocol, TypeVar

import jax
from jax.sharding import Mesh


class Role(enum.Enum):
    """What a program does in a run: how `--mode=compile` (what stays resident beside it) and the step estimate
    (how many times a step calls it, `llds_jax.aot.step_estimate`) read it. The value is its name in their tables."""

    # the training state, built once
    OPTIMIZER_INIT = "optimizer init"
    REFERENCE_COPY = "reference copy"
    # the rollout's copy of the params (`rollout.layout.rollout_params`), made once per rollout
    RESHARD = "rollout reshard"
    # the rollout engine (`rollout.runner`): one ragged step at a token bucket
    ROLLOUT_STEP = "rollout step"
    # the retriever on the chips (`search.device_search`): one call scores a batch of searches against the index
    RETRIEVAL = "retrieval search"
    # the retriever's query encoder (`search.e5`) on a host's first chip: one call embeds a batch of queries
    QUERY_ENCODER = "query encoder"
    # a training step
    REFERENCE_LOGP = "logp (reference)"
    POLICY_LOGP = "logp (policy)"
    LIKELIHOOD_METRICS = "likelihood metrics"
    LLD_LOGP = "logp (float32, LLD)"
    UPDATE = "update"
    LLD_METRICS = "lld metrics"


@dataclasses.dataclass(frozen=True)
class AbstractProgram:
    """One jitted program of a run at abstract arguments.

    Attributes:
      role: what it is (`Role`).
      shapes: the shapes it runs at, in words, e.g. "16 rows x 32 steps, 512 slots".
      fn: the jitted function (`jax.jit(...)`).
      args: its positional arguments: pytrees of ShapeDtypeStructs with shardings (or of arrays).
      kwargs: its keyword arguments, static ones included.
      mesh: the mesh it is traced under (`jax.set_mesh`); None: none.
      detail: said after its role in its name, e.g. "10 per step" for an update.
    """

    role: Role
    shapes: str
    fn: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    mesh: Optional[Mesh] = None
    detail: str = ""

    @property
    def name(self) -> str:
        """Its name in `--mode=compile`'s table, e.g. "decode chunk", "update (10 per step)": a label, never a key."""
        return f"{self.role.value} ({self.detail})" if self.detail else self.role.value

    def lower(self) -> jax.stages.Lowered:
        """The program lowered (not compiled) at its arguments."""
        with jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext():
            return self.fn.lower(*self.args, **self.kwargs)


At = TypeVar("At", contravariant=True)


class CompilablePrograms(Protocol[At]):
    """What runs jitted programs and names them at abstract arguments (implemented by
    `rollout.paged_sampler.PagedSampler` and `rl.train_step.RLTrainStep`)."""

    def abstract_programs(self, at: At) -> list[AbstractProgram]:
        """Every program run at the shapes `at`, in the order a run first runs them."""
