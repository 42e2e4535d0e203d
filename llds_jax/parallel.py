"""Device mesh over (data, fsdp, tensor), parameter partition rules by path, activation constraints.

- data: pure data parallelism (parameters replicated).
- fsdp: data parallelism with parameters sharded (ZeRO-3 style) along their hidden dimension.
- tensor: Megatron-style tensor parallelism over heads and MLP width.
The batch dimension of activations is split over (data, fsdp). The vocabulary dimension of the embedding and the
output projection is split over (fsdp, tensor) and never gathered: the lookup and the log-softmax work per shard
(`llds_jax.model.vocab`, `llds_jax.rl.logprobs`).
"""
from __future__ import annotations

import math
import re
from typing import Any, Optional, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

AXES = ("data", "fsdp", "tensor")
BATCH = ("data", "fsdp")
VOCAB = ("fsdp", "tensor")

# (regex on the "/"-joined parameter path, spec). Layer parameters carry a leading layer axis (None).
PARAM_RULES: tuple[tuple[str, P], ...] = (
    (r"^embed$", P(VOCAB, None)),                            # [V, D]
    (r"^lm_head$", P(None, VOCAB)),                          # [D, V]
    (r"^final_norm$", P(None)),                              # [D]
    (r"^layers/(attn_norm|mlp_norm)$", P(None, None)),       # [L, D]
    (r"^layers/(q_proj|k_proj|v_proj)$", P(None, "fsdp", "tensor", None)),  # [L, D, N|K, H]
    (r"^layers/(q_bias|k_bias|v_bias)$", P(None, "tensor", None)),          # [L, N|K, H]
    (r"^layers/o_proj$", P(None, "tensor", None, "fsdp")),   # [L, N, H, D]
    (r"^layers/(gate_proj|up_proj)$", P(None, "fsdp", "tensor")),           # [L, D, F]
    (r"^layers/down_proj$", P(None, "tensor", "fsdp")),      # [L, F, D]
)


def mesh_shape(num_devices: int, data: int = 1, fsdp: int = -1, tensor: int = 1) -> tuple[int, int, int]:
    """Resolves axis sizes; at most one may be -1, meaning "the rest of the devices"."""
    sizes = {"data": data, "fsdp": fsdp, "tensor": tensor}
    for name, size in sizes.items():
        if size == 0 or size < -1:
            raise ValueError(f"mesh.{name} must be a positive size or -1 (the rest), got {size}")
    rest = [name for name, size in sizes.items() if size == -1]
    if len(rest) > 1:
        raise ValueError(f"mesh: only one axis may be -1, got {rest}")
    known = math.prod(size for size in sizes.values() if size != -1)
    if num_devices % known:
        raise ValueError(f"mesh: {num_devices} devices cannot be split into data={data} x fsdp={fsdp} x "
                         f"tensor={tensor} ({num_devices} is not a multiple of {known})")
    if rest:
        sizes[rest[0]] = num_devices // known
    if math.prod(sizes.values()) != num_devices:
        raise ValueError(f"mesh: data={sizes['data']} x fsdp={sizes['fsdp']} x tensor={sizes['tensor']} = "
                         f"{math.prod(sizes.values())} does not equal the {num_devices} devices")
    return sizes["data"], sizes["fsdp"], sizes["tensor"]


def make_mesh(data: int = 1, fsdp: int = -1, tensor: int = 1,
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
    for pattern, spec in PARAM_RULES:
        if re.search(pattern, path):
            return spec
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
        raise ValueError("the mesh cannot divide the model: " + "; ".join(problems))


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


def shard_model(model: nnx.Module, mesh: Mesh) -> nnx.Module:
    """Places a model's parameters on their shards (in place) and returns it."""
    state = nnx.state(model, nnx.Param)
    nnx.update(model, jax.device_put(state, param_shardings(state, mesh)))
    return model


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    """Sharding of a batch-major array: the leading axis over (data, fsdp), the rest replicated."""
    return NamedSharding(mesh, P(BATCH, *([None] * (ndim - 1))))


def constrain(x: jax.Array, *spec: Any) -> jax.Array:
    """`with_sharding_constraint` under the current mesh (jax.set_mesh); a no-op without a mesh.

    Axes whose size does not divide the dimension are dropped from the spec (e.g. batch 1 during decode).
    """
    mesh = current_mesh()
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, P(*(fitted(mesh, dim, axis) for dim, axis in zip(x.shape, spec))))


def current_mesh() -> Optional[jax.sharding.AbstractMesh]:
    """The mesh set by `jax.set_mesh` if it has the (data, fsdp, tensor) axes, else None."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty or not set(AXES) <= set(mesh.axis_names) else mesh


def fitted(mesh: Any, dim: int, axis: Any) -> Any:
    """`axis` (a name, a tuple of names or None) if its mesh size divides `dim`, else None (replicated)."""
    names = () if axis is None else (axis if isinstance(axis, tuple) else (axis,))
    return axis if dim % int(np.prod([mesh.shape[a] for a in names])) == 0 else None
