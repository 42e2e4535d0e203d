"""The rollout's copy of the policy: the mesh it samples on and how its parameters are laid out there.

Training lays the parameters out for FSDP: each matrix split along its hidden dimension over `fsdp`. A decode
step under that layout all-gathers every layer's weights onto every chip, for a step that multiplies them with a
handful of rows: the weights' bytes cross the chip links on every token (docs/tpu.md).

`rollout.tensor_parallel` = t > 0 lays the rollout's copy out for tensor parallelism instead, on a mesh of the host's
own chips: (data = chips / t, fsdp = 1, tensor = t). Query heads, key/value heads, the MLP width and the vocabulary
are split over the t chips of a group (the partition rules of `llds_jax.parallel` with fsdp of size 1), rows over
the groups. No weight is gathered: each chip multiplies its rows by its own slice of every matrix, and a layer's
output is summed over the group (one all-reduce of [B, T, D] activations per attention and per MLP). The page pool
of the KV cache is split by key/value heads, so each chip writes and reads its own heads' pages. -1: t = every chip
of a host.

Two changes to the architecture make the split exact:
- a model with fewer key/value heads K than t (Qwen2.5-3B: 2 over 4 chips) gets each head repeated t / K times
  in the rollout copy (`kv_repeat`): query head n still reads the keys and values of head n // (N / K), now held
  on its own chip. t must be a multiple of K, or K of t;
- the MLP runs whole (`mlp_chunks` 1): slicing a width that is split over chips would gather it. The slices save
  memory in the training backward, which the rollout does not run.

0 keeps the training layout: the training mesh with one host; with several hosts each host's own chips with rows
over fsdp and `mesh.tensor` kept (each host still samples its own prompts, and gathers weights every step).

The copy is made once per rollout (`rollout_params`): cast to `rollout.params_dtype`, heads repeated, then
resharded by a compiled program over the chips' links, never through host memory. With several hosts the program's
output is one array per weight on `hosts_mesh` (every host's rollout mesh stacked along HOSTS): replicated over the
hosts, split over each host's chips as that host's rollout mesh splits it, so a host's shards of it are its rollout
copy as they are (`_host_part`, no copy). The program is `jax.device_put` to those shardings, which compiles one
reshard per array (the training mesh orders chips along its torus rings, not by host, so the two meshes order the
same chips differently); `reshard_program` is the same program over the whole tree, for `--mode=compile`.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from llds_jax import parallel
from llds_jax.bounds import ConfigError
from llds_jax.model import ModelConfig, Transformer
from llds_jax.programs import AbstractProgram, Role

TRAINING_LAYOUT = 0  # rollout.tensor_parallel: the training mesh's layout
ALL_CHIPS = -1  # rollout.tensor_parallel: tensor parallelism over every chip of a host
_KV_PARAMS = {"k_proj": 2, "v_proj": 2, "k_bias": 1, "v_bias": 1}  # layer parameter -> its key/value-head axis
HOSTS = "hosts"  # `RolloutLayout.hosts_mesh`'s leading axis: one host's rollout mesh per index


@dataclasses.dataclass(frozen=True)
class RolloutLayout:
    """Where and how the rollout samples.

    Attributes:
      mesh: the rollout mesh (the training mesh itself when nothing is resharded).
      model_cfg: the rollout copy's architecture (key/value heads repeated, MLP whole under tensor parallelism).
      kv_repeat: copies of each key/value head in the rollout copy (1: none).
      resharded: the rollout copy lives on `mesh` in a layout of its own (else: the training params' layout).
      own_architecture: `model_cfg` differs from the training model's.
      hosts_mesh: with several hosts, every host's rollout mesh stacked along a leading HOSTS axis (host by
        process index; this host's row is `mesh`): where the reshard program leaves the rollout copy. None on one
        host.
    """

    mesh: Mesh
    model_cfg: ModelConfig
    kv_repeat: int = 1
    resharded: bool = False
    own_architecture: bool = False
    hosts_mesh: Mesh | None = None

    def graphdef(self, training_graphdef: nnx.GraphDef) -> nnx.GraphDef:
        """The graph the sampler merges the rollout params into: the trainer's own unless the architecture
        differs."""
        if not self.own_architecture:
            return training_graphdef
        return nnx.split(nnx.eval_shape(lambda: Transformer(self.model_cfg, rngs=nnx.Rngs(0))))[0]

    @property
    def tensor(self) -> int:
        """Chips per tensor-parallel group (1: none): the shards of the heads."""
        return parallel.axis_size(self.mesh, "heads")


def tensor_size(setting: int, local_chips: int, model_cfg: ModelConfig) -> int:
    """The chips per tensor-parallel group that `rollout.tensor_parallel` = `setting` (> 0, or ALL_CHIPS) gives on
    a host of `local_chips`; raises ConfigError naming the key when the model or the host cannot be split so."""
    t = local_chips if setting == ALL_CHIPS else setting
    if t < 1 or local_chips % t:
        raise ConfigError(f"rollout.tensor_parallel ({setting}) must divide the {local_chips} chip(s) of a host "
                          f"(or be -1: all of them, 0: the training layout)")
    m = model_cfg
    dims = {"query heads (num_attention_heads)": m.num_heads, "MLP width (intermediate_size)": m.intermediate_size,
            "vocabulary (vocab_size)": m.vocab_size}
    for what, size in dims.items():
        if size % t:
            raise ConfigError(f"rollout.tensor_parallel = {t} chips cannot split the model's {size} {what}")
    if m.num_kv_heads % t and t % m.num_kv_heads:
        raise ConfigError(f"rollout.tensor_parallel = {t} chips cannot split the model's {m.num_kv_heads} key/value "
                          f"heads (num_key_value_heads) nor hold an equal number of copies of each")
    return t


def make_layout(setting: int, model_cfg: ModelConfig, train_mesh: Mesh, local_devices: Sequence[jax.Device],
                mesh_tensor: int = 1) -> RolloutLayout:
    """The rollout layout of `rollout.tensor_parallel` = `setting` (module docstring) for this host's
    `local_devices`; `mesh_tensor` is the training mesh's tensor axis (kept by the training layout on several
    hosts)."""
    local = list(local_devices)
    if setting == TRAINING_LAYOUT:
        if len(local) == train_mesh.devices.size:
            return RolloutLayout(train_mesh, model_cfg)
        host_mesh = functools.partial(parallel.make_mesh, 1, -1, mesh_tensor)
        return RolloutLayout(host_mesh(devices=_by_id(local)), model_cfg, resharded=True,
                             hosts_mesh=_hosts_mesh(train_mesh, host_mesh))
    t = tensor_size(setting, len(local), model_cfg)
    kv_repeat = t // model_cfg.num_kv_heads if model_cfg.num_kv_heads < t else 1
    rollout_cfg = model_cfg.replace(num_kv_heads=model_cfg.num_kv_heads * kv_repeat, mlp_chunks=1)
    host_mesh = functools.partial(parallel.make_mesh, len(local) // t, 1, t)
    return RolloutLayout(host_mesh(devices=_by_id(local)), rollout_cfg, kv_repeat, resharded=True,
                         own_architecture=rollout_cfg != model_cfg, hosts_mesh=_hosts_mesh(train_mesh, host_mesh))


def _by_id(devices: Sequence[jax.Device]) -> list[jax.Device]:
    """`devices` in id order: every host builds every host's rollout mesh from the same list."""
    return sorted(devices, key=lambda d: d.id)


def _hosts_mesh(train_mesh: Mesh, host_mesh) -> Mesh | None:
    """Every host's rollout mesh (`host_mesh(devices=...)` of its chips of `train_mesh`) stacked along HOSTS, hosts
    by process index; None when `train_mesh` is one host's."""
    hosts = sorted({d.process_index for d in train_mesh.devices.flat})
    if len(hosts) == 1:
        return None
    meshes = [host_mesh(devices=_by_id([d for d in train_mesh.devices.flat if d.process_index == p])) for p in hosts]
    return Mesh(np.stack([m.devices for m in meshes]), (HOSTS, *meshes[0].axis_names))


@functools.partial(jax.jit, static_argnums=1)
def _cast(params: nnx.State, dtype: jnp.dtype) -> nnx.State:
    return jax.tree.map(lambda x: x.astype(dtype), params)


def cast_params(params: nnx.State, dtype: str) -> nnx.State:
    """`params` with every array in `dtype` (e.g. "bfloat16"), new buffers laid out like them; `params` itself
    when every array already is (nothing is copied)."""
    dtype = jnp.dtype(dtype)
    if all(x.dtype == dtype for x in jax.tree.leaves(params)):
        return params
    return _cast(params, dtype)


def _repeat_kv_heads(params: nnx.State, repeat: int) -> nnx.State:
    """Each key/value head's projection (and bias) repeated `repeat` times in place: [.., K, H] -> [.., K r, H],
    head k at k r .. k r + r - 1."""
    def one(path, var):
        axis = _KV_PARAMS.get(parallel.path_str(path).split("/")[-1])
        return var if axis is None else var.replace(jnp.repeat(var.get_value(), repeat, axis=axis))

    return nnx.map_state(one, params)


_repeat_kv_heads_jit = jax.jit(_repeat_kv_heads, static_argnums=1)


def rollout_params(layout: RolloutLayout, params: nnx.State, dtype: str) -> nnx.State:
    """The training `params` as the rollout samples with them under `layout`, in `dtype` (module docstring). A
    collective with several processes. The training params are not changed."""
    params = cast_params(params, dtype)
    if layout.kv_repeat > 1:
        params = _repeat_kv_heads_jit(params, layout.kv_repeat)
    if not layout.resharded:
        return params
    shardings = parallel.param_shardings(params, layout.mesh)
    if layout.hosts_mesh is None:
        return jax.device_put(params, shardings)
    everywhere = jax.device_put(params, parallel.param_shardings(params, layout.hosts_mesh))
    return jax.tree.map(_host_part, everywhere, shardings)


def _host_part(x: jax.Array, sharding: NamedSharding) -> jax.Array:
    """This host's shards of `x` (on `hosts_mesh`, replicated over HOSTS) as an array of its own rollout mesh
    (`sharding`): the same device buffers, nothing copied."""
    shards = {s.device: s.data for s in x.addressable_shards}
    return jax.make_array_from_single_device_arrays(
        x.shape, sharding, [shards[d] for d in sharding.addressable_devices_indices_map(x.shape)])


def abstract_rollout_params(layout: RolloutLayout, params: nnx.State, dtype: str) -> nnx.State:
    """`rollout_params(layout, params, dtype)` as ShapeDtypeStructs with their shardings (`params` may be abstract,
    with the training shardings): what the rollout programs get, for ahead-of-time compilation."""
    shapes = jax.eval_shape(lambda p: _repeat_kv_heads(p, layout.kv_repeat), params)
    shardings = (parallel.param_shardings(shapes, layout.mesh) if layout.resharded
                 else jax.tree.map(lambda x: x.sharding, params))
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, jnp.dtype(dtype), sharding=s), shapes, shardings)


def reshard_program(layout: RolloutLayout, params: nnx.State, dtype: str) -> AbstractProgram | None:
    """The program that reshards the cast training `params` (abstract, with the training shardings) onto the
    rollout mesh, every host's at once with several hosts (module docstring); None when the rollout keeps the
    training layout. Lowered with the training layout's specs over the target mesh's chip order, as `jax.device_put`
    relabels them before its reshard: the same program up to which chip holds which shard."""
    if not layout.resharded:
        return None
    target = layout.mesh if layout.hosts_mesh is None else layout.hosts_mesh
    shapes = jax.eval_shape(lambda p: _repeat_kv_heads(p, layout.kv_repeat), params)

    def relabelled(x, spec_of):
        train_mesh = spec_of.sharding.mesh
        mesh = Mesh(target.devices.reshape(train_mesh.devices.shape), train_mesh.axis_names)
        return jax.ShapeDtypeStruct(x.shape, jnp.dtype(dtype), sharding=NamedSharding(mesh, spec_of.sharding.spec))

    args = jax.tree.map(relabelled, shapes, params)
    hosts = "" if layout.hosts_mesh is None else f"every host's at once over {target.shape[HOSTS]} hosts, "
    return AbstractProgram(Role.RESHARD, f"{hosts}{dtype}", jax.jit(lambda p: p, out_shardings=parallel.param_shardings(
        shapes, target)), (args,))
