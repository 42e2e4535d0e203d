"""Device mesh over (data, fsdp, tensor), the logical axis names of array dimensions, parameter partition rules by
path, activation constraints.

- data: pure data parallelism (parameters replicated).
- fsdp: data parallelism with parameters sharded (ZeRO-3 style) along their hidden dimension.
- tensor: Megatron-style tensor parallelism over heads and MLP width.

Code outside this module never names a mesh axis: it names array dimensions logically ("batch", "vocab", "heads",
...) and `LOGICAL_AXIS_RULES`, the one table, says which mesh axes split each (MaxText's logical axis rules):
`spec("batch", None, "heads")` is a PartitionSpec, `constrain(x, "batch", None, "mlp")` a sharding constraint,
`axes("vocab")` the axis names of a collective, `axis_size(mesh, "batch")` the shards of a dimension. The training
mesh and the rollout's tensor-parallel mesh (`llds_jax.rollout.layout`) both come from `make_mesh`, so the one table
serves both. The batch dimension of activations is split over (data, fsdp). The vocabulary dimension of the embedding
and the output projection is split over (fsdp, tensor) and never gathered: the lookup and the log-softmax work per
shard (`llds_jax.model.vocab`, `llds_jax.rl.logprobs`).
"""
from __future__ import annotations

import math
import re
from typing import Any, Optional, Sequence, Union

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from llds_jax.bounds import ConfigError
from llds_jax.config.sections import MeshConfig

AXES = ("data", "fsdp", "tensor")  # the physical mesh axes, tensor innermost

MeshAxes = Optional[Union[str, tuple[str, ...]]]  # a PartitionSpec entry: a mesh axis, a tuple of them, or None

# Logical dimension -> the mesh axes that split it (None: never split). Dimensions that no rule splits (time, head
# size, the hidden size of activations and norms) are written None where a spec is built.
LOGICAL_AXIS_RULES: dict[str, MeshAxes] = {
    "batch": ("data", "fsdp"),    # rows of activations, token batches and the KV cache
    # rows of the logits a token is sampled from: each row's whole vocabulary on one chip, every chip a share of rows
    "sampled_rows": ("data", "fsdp", "tensor"),
    # rows of logits whose vocabulary is split (over fsdp and tensor, "vocab"): split over data, the axis left
    "logit_rows": "data",
    "vocab": ("fsdp", "tensor"),  # V of the embedding table, the output projection and the logits
    "embed": "fsdp",              # D of the weight matrices (FSDP); activations keep D whole
    "heads": "tensor",            # N query heads
    "kv_heads": "tensor",         # K key/value heads, of the projections and the KV cache
    "mlp": "tensor",              # F, the MLP's intermediate features
    "layers": None,               # L, the stacked layer axis of the layer parameters and the KV cache
}
BATCH = LOGICAL_AXIS_RULES["batch"]
VOCAB = LOGICAL_AXIS_RULES["vocab"]

# (regex on the "/"-joined parameter path, logical name of each dimension).
PARAM_RULES: tuple[tuple[str, tuple[Optional[str], ...]], ...] = (
    (r"^embed$", ("vocab", None)),                                         # [V, D]
    (r"^lm_head$", (None, "vocab")),                                       # [D, V]
    (r"^final_norm$", (None,)),                                            # [D]
    (r"^layers/(attn_norm|mlp_norm)$", ("layers", None)),                  # [L, D]
    (r"^layers/q_proj$", ("layers", "embed", "heads", None)),              # [L, D, N, H]
    (r"^layers/(k_proj|v_proj)$", ("layers", "embed", "kv_heads", None)),  # [L, D, K, H]
    (r"^layers/q_bias$", ("layers", "heads", None)),                       # [L, N, H]
    (r"^layers/(k_bias|v_bias)$", ("layers", "kv_heads", None)),           # [L, K, H]
    (r"^layers/o_proj$", ("layers", "heads", None, "embed")),              # [L, N, H, D]
    (r"^layers/(gate_proj|up_proj)$", ("layers", "embed", "mlp")),         # [L, D, F]
    (r"^layers/down_proj$", ("layers", "mlp", "embed")),                   # [L, F, D]
)


def _rule(logical: Optional[str]) -> MeshAxes:
    """The mesh axes that split the logical dimension `logical` (None: an unsplit dimension), as a PartitionSpec
    entry; an unknown name is an error listing the known ones."""
    if logical is None:
        return None
    if not isinstance(logical, str) or logical not in LOGICAL_AXIS_RULES:
        raise ValueError(f"{logical!r} is not a logical axis name: one of {sorted(LOGICAL_AXIS_RULES)} or None")
    return LOGICAL_AXIS_RULES[logical]


def spec(*logical: Optional[str]) -> P:
    """The PartitionSpec of an array whose dimensions have these logical names (None: not split)."""
    return P(*(_rule(name) for name in logical))


def axes(logical: str, mesh: Optional[Any] = None) -> tuple[str, ...]:
    """The mesh axes that split `logical`, as a tuple of names (for collectives: `lax.psum(x, axes("vocab"))`);
    with `mesh`, only those it has."""
    entry = _rule(logical)
    names = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
    return names if mesh is None else tuple(a for a in names if a in mesh.axis_names)


def axis_size(mesh: Any, logical: str) -> int:
    """How many shards `mesh` splits the logical dimension `logical` into (1: not split)."""
    return math.prod(mesh.shape[a] for a in axes(logical, mesh))


def mesh_shape(num_devices: int, data: int = MeshConfig.data, fsdp: int = MeshConfig.fsdp,
               tensor: int = MeshConfig.tensor) -> tuple[int, int, int]:
    """Resolves axis sizes; at most one may be -1, meaning "the rest of the devices"."""
    sizes = {"data": data, "fsdp": fsdp, "tensor": tensor}
    for name, size in sizes.items():
        if size == 0 or size < -1:
            raise ConfigError(f"mesh.{name} must be a positive size or -1 (the rest), got {size}")
    rest = [name for name, size in sizes.items() if size == -1]
    if len(rest) > 1:
        raise ConfigError(f"mesh: only one axis may be -1, got {rest}")
    known = math.prod(size for size in sizes.values() if size != -1)
    if num_devices % known:
        raise ConfigError(f"mesh: {num_devices} devices cannot be split into data={data} x fsdp={fsdp} x "
                          f"tensor={tensor} ({num_devices} is not a multiple of {known})")
    if rest:
        sizes[rest[0]] = num_devices // known
    if math.prod(sizes.values()) != num_devices:
        raise ConfigError(f"mesh: data={sizes['data']} x fsdp={sizes['fsdp']} x tensor={sizes['tensor']} = "
                          f"{math.prod(sizes.values())} does not equal the {num_devices} devices")
    return sizes["data"], sizes["fsdp"], sizes["tensor"]


def make_mesh(data: int = MeshConfig.data, fsdp: int = MeshConfig.fsdp, tensor: int = MeshConfig.tensor,
              devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
    """A (data, fsdp, tensor) mesh over `devices` (default: all), tensor innermost (fastest links)."""
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(len(devices), data, fsdp, tensor)
    return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


def path_str(path: Sequence[Any]) -> str:
    """'layers/q_proj' for an nnx state path."""
    return "/".join(str(getattr(k, "key", k)) for k in path)


def spec_for(path: str) -> P:
    """The PartitionSpec its rule names for a parameter path; an unmatched path is an error."""
    for pattern, logical in PARAM_RULES:
        if re.search(pattern, path):
            return spec(*logical)
    raise KeyError(f"no partition rule matches parameter {path!r}")


def validate(shapes: dict[str, tuple[int, ...]], mesh: Mesh) -> None:
    """Checks every parameter dimension divides by the mesh axes its rule shards it over.

    Raises ValueError naming the parameter, the axis and the sizes (e.g. 4 KV heads over tensor=8).
    """
    problems = []
    for path, shape in shapes.items():
        for dim, axis in zip(shape, spec_for(path)):
            if axis is None:
                continue
            size = math.prod(mesh.shape[a] for a in (axis if isinstance(axis, tuple) else (axis,)))
            if dim % size:
                hint = (f" (pad the vocabulary to a multiple of {size}: the Qwen2.5 and Llama-3 checkpoints are)"
                        if axis == VOCAB else "")
                problems.append(f"{path} dimension {dim} is not divisible by mesh axis {axis!r} of size {size}{hint}")
    if problems:
        raise ConfigError("the mesh cannot divide the model: " + "; ".join(problems))


def param_shardings(state: nnx.State, mesh: Mesh) -> nnx.State:
    """NamedShardings for every parameter of an nnx state (same tree), validated against the mesh."""
    flat = {path_str(path): var.get_value().shape for path, var in nnx.to_flat_state(state)}
    validate(flat, mesh)
    return nnx.map_state(lambda path, var: var.replace(NamedSharding(mesh, spec_for(path_str(path)))), state)


def abstract_params(state: nnx.State, mesh: Mesh) -> nnx.State:
    """ShapeDtypeStructs of a (possibly abstract) parameter state laid out on `mesh` by the partition rules: what
    ahead-of-time compilation takes instead of arrays."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state,
                        param_shardings(state, mesh))


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    """Sharding of a batch-major array: the leading ("batch") axis split, the rest replicated."""
    return NamedSharding(mesh, spec("batch", *([None] * (ndim - 1))))


def constrain(x: jax.Array, *logical: Optional[str]) -> jax.Array:
    """`with_sharding_constraint` of `x` to the logical names of its dimensions (`spec`), as `constrain_spec`."""
    return constrain_spec(x, spec(*logical))


def constrain_spec(x: jax.Array, partition: P) -> jax.Array:
    """`with_sharding_constraint` to a PartitionSpec under the current mesh (jax.set_mesh); a no-op without a mesh.

    Axes whose size does not divide the dimension are dropped from the spec (e.g. batch 1 during decode).
    """
    mesh = current_mesh()
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, P(*(_fit(mesh, dim, entry) for dim, entry in zip(x.shape, partition))))


def current_mesh() -> Optional[jax.sharding.AbstractMesh]:
    """The mesh set by `jax.set_mesh` if it has the (data, fsdp, tensor) axes, else None."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty or not set(AXES) <= set(mesh.axis_names) else mesh


def fitted(mesh: Any, dim: int, logical: Optional[str]) -> MeshAxes:
    """The mesh axes of the logical dimension `logical` (a PartitionSpec entry) if their size on `mesh` divides `dim`,
    else None (replicated)."""
    return _fit(mesh, dim, _rule(logical))


def _fit(mesh: Any, dim: int, entry: MeshAxes) -> MeshAxes:
    """`entry` (a name, a tuple of names or None) if its mesh size divides `dim`, else None (replicated)."""
    names = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
    return entry if dim % int(np.prod([mesh.shape[a] for a in names])) == 0 else None
