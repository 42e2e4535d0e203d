"""Hugging Face checkpoint folders <-> model parameters.

Import reads safetensors lazily through a tensorstore key-value store (local folders and `gs://` alike) and
builds every parameter with `jax.make_array_from_callback`, so each device's shard is read straight from the
files: the host never holds a full copy of the model, only the rows of one tensor a shard needs.
Export writes config.json (with the source's special token ids), generation_config.json (the source's, else one
built from those ids) and (sharded) safetensors that `transformers` loads.
"""
from __future__ import annotations

import dataclasses
import json
import os
import struct
from typing import Any, Callable, Iterator, Mapping, Optional

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import tensorstore as ts
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from safetensors.numpy import save as safetensors_save

from llds_jax import parallel
from llds_jax.errors import InputError
from llds_jax.model.config import HFConfig, ModelConfig, check_preset, from_hf_config, to_hf_config, token_ids
from llds_jax.model.transformer import Transformer

_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
              "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_MAX_HEADER_BYTES = 100_000_000  # the safetensors format's bound on its JSON header
CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"


def _kvstore_url(path: str) -> str:
    path = os.fspath(path)
    if "://" in path:
        return path.rstrip("/") + "/"
    return "file://" + os.path.abspath(path) + "/"


def _read_optional(kv: ts.KvStore, key: str, byte_range: Optional[slice] = None) -> Optional[bytes]:
    result = kv.read(key, byte_range=byte_range).result()
    return None if result.state == "missing" else bytes(result.value)


def _parse_json(where: str, data: bytes) -> dict[str, Any]:
    """The JSON object in `data` (the file `where`); raises ValueError naming the file when it is not one."""
    try:
        value = json.loads(data)
    except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
        reason = f"{e.msg} at line {e.lineno} column {e.colno}" if isinstance(e, json.JSONDecodeError) else e
        raise InputError(f"{where}: invalid JSON ({reason})") from None
    if not isinstance(value, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(value).__name__}")
    return value


def _read_json(path: str, name: str) -> Optional[dict[str, Any]]:
    """The JSON file `name` of a checkpoint folder (local or gs://), or None when it has none; raises ValueError
    naming the file when it is not a JSON object."""
    data = _read_optional(ts.KvStore.open(_kvstore_url(path)).result(), name)
    return None if data is None else _parse_json(f"{path}/{name}", data)


def read_generation_config(path: str) -> Optional[dict[str, Any]]:
    """The generation_config.json of a checkpoint folder (local or gs://), or None when it has none."""
    return _read_json(path, GENERATION_CONFIG_FILE)


def read_config(path: str) -> HFConfig:
    """The config.json of a checkpoint folder (local or gs://), without reading its weights; `from_hf_config`'s
    errors name the file."""
    config = _read_json(path, CONFIG_FILE)
    if config is None:
        raise FileNotFoundError(f"{path}/{CONFIG_FILE} not found")
    return HFConfig(config, f"{path}/{CONFIG_FILE}")


class CheckpointFolder:
    """Lazy, byte-range reader of a Hugging Face checkpoint folder (local path or gs://bucket/path)."""

    def __init__(self, path: str):
        self.path = os.fspath(path)
        self._kv = ts.KvStore.open(_kvstore_url(self.path)).result()
        self._tensors: dict[str, tuple[str, str, tuple[int, ...], int, int]] = {}
        index = self._read_optional(INDEX_FILE)
        if index is not None:
            weight_map = _parse_json(f"{self.path}/{INDEX_FILE}", index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise InputError(f"{self.path}/{INDEX_FILE}: no \"weight_map\" object")
            files = sorted(set(weight_map.values()))
        elif self._read_optional(SINGLE_FILE, byte_range=slice(0, 0)) is not None:
            files = [SINGLE_FILE]
        else:
            raise FileNotFoundError(f"{self.path}: no {SINGLE_FILE} or {INDEX_FILE} found")
        for name in files:
            self._read_header(name)

    def _read_optional(self, key: str, byte_range: Optional[slice] = None) -> Optional[bytes]:
        return _read_optional(self._kv, key, byte_range)

    def read_bytes(self, key: str, byte_range: Optional[slice] = None) -> bytes:
        data = self._read_optional(key, byte_range)
        if data is None:
            raise FileNotFoundError(f"{self.path}/{key} not found")
        return data

    def _read_header(self, file: str) -> None:
        """Records the tensors of one safetensors file: an 8-byte little-endian header length n, n bytes of JSON
        {name: {dtype, shape, data_offsets}}, then the data. Raises ValueError naming the file when it is not
        such a file or is shorter than its header says."""
        try:
            (n,) = struct.unpack("<Q", self.read_bytes(file, slice(0, 8)))
            if n > _MAX_HEADER_BYTES:
                raise ValueError(f"a header of {n} bytes, more than the format's {_MAX_HEADER_BYTES}")
            header = json.loads(self.read_bytes(file, slice(8, 8 + n)))
            tensors = {}
            for name, info in header.items():
                if name != "__metadata__":
                    start, end = info["data_offsets"]
                    tensors[name] = (info["dtype"], tuple(info["shape"]), int(start), int(end))
            data_end = 8 + n + max((end for *_, end in tensors.values()), default=0)
            self.read_bytes(file, slice(data_end - 1, data_end))  # the last data byte: the file is not cut short
        except (ValueError, KeyError, TypeError, AttributeError, struct.error) as e:
            reason = f"{type(e).__name__}: {' '.join(str(e).split())}"  # one line
            raise InputError(f"{self.path}/{file}: not a valid safetensors file ({reason})") from None
        for name, (dtype, shape, start, end) in tensors.items():
            if dtype not in _ST_DTYPES:
                raise InputError(f"{self.path}/{file}: tensor {name!r} has unsupported dtype {dtype}")
            self._tensors[name] = (file, dtype, shape, 8 + n + start, 8 + n + end)

    def config(self) -> dict[str, Any]:
        return read_config(self.path)

    def names(self) -> set[str]:
        return set(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._tensors[name][2]

    def read_rows(self, name: str, rows: slice) -> np.ndarray:
        """Rows [start, stop) of a tensor's leading dimension, read as one byte range."""
        file, dtype, shape, begin, _ = self._tensors[name]
        np_dtype = np.dtype(_ST_DTYPES[dtype])
        start, stop, _ = rows.indices(shape[0] if shape else 1)
        row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * np_dtype.itemsize
        data = self.read_bytes(file, slice(begin + start * row_bytes, begin + stop * row_bytes))
        return np.frombuffer(data, dtype=np_dtype).reshape((stop - start,) + tuple(shape[1:]))


@dataclasses.dataclass(frozen=True)
class _Mapping:
    """How one HF tensor maps into (a layer of) one of our parameters.

    rows_of: our index (without the layer axis) -> the slice of HF rows the block needs.
    to_ours: (HF rows block, our index) -> our block.
    """

    rows_of: Callable[[tuple[slice, ...]], slice]
    to_ours: Callable[[np.ndarray, tuple[slice, ...]], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]


def _scaled(s: slice, n: int, unit: int) -> slice:
    start, stop, _ = s.indices(n)
    return slice(start * unit, stop * unit)


def _mappings(cfg: ModelConfig) -> dict[str, _Mapping]:
    D, N, K, H = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def heads(n: int) -> _Mapping:  # ours [D, n, H] <- HF [n*H, D]
        return _Mapping(
            rows_of=lambda idx: _scaled(idx[1], n, H),
            to_ours=lambda blk, idx: blk.T.reshape(D, -1, H)[idx[0], :, idx[2]],
            to_hf=lambda w: w.reshape(D, n * H).T)

    def head_bias(n: int) -> _Mapping:  # ours [n, H] <- HF [n*H]
        return _Mapping(rows_of=lambda idx: _scaled(idx[0], n, H),
                        to_ours=lambda blk, idx: blk.reshape(-1, H)[:, idx[1]],
                        to_hf=lambda w: w.reshape(n * H))

    copy = _Mapping(rows_of=lambda idx: idx[0], to_ours=lambda blk, idx: blk[(slice(None),) + tuple(idx[1:])],
                    to_hf=lambda w: w)
    transpose = _Mapping(rows_of=lambda idx: idx[1], to_ours=lambda blk, idx: blk.T[idx[0]],
                         to_hf=lambda w: w.T)
    o_proj = _Mapping(  # ours [N, H, D] <- HF [D, N*H]
        rows_of=lambda idx: idx[2], to_ours=lambda blk, idx: blk.T.reshape(N, H, -1)[idx[0], idx[1]],
        to_hf=lambda w: w.reshape(N * H, D).T)
    out = {
        "attn_norm": copy, "mlp_norm": copy, "q_proj": heads(N), "k_proj": heads(K), "v_proj": heads(K),
        "q_bias": head_bias(N), "k_bias": head_bias(K), "v_bias": head_bias(K), "o_proj": o_proj,
        "gate_proj": transpose, "up_proj": transpose, "down_proj": transpose,
        "embed": copy, "final_norm": copy, "lm_head": transpose,
    }
    return out


_LAYER_NAMES = {
    "attn_norm": "input_layernorm.weight", "mlp_norm": "post_attention_layernorm.weight",
    "q_proj": "self_attn.q_proj.weight", "k_proj": "self_attn.k_proj.weight", "v_proj": "self_attn.v_proj.weight",
    "q_bias": "self_attn.q_proj.bias", "k_bias": "self_attn.k_proj.bias", "v_bias": "self_attn.v_proj.bias",
    "o_proj": "self_attn.o_proj.weight", "gate_proj": "mlp.gate_proj.weight", "up_proj": "mlp.up_proj.weight",
    "down_proj": "mlp.down_proj.weight",
}
_TOP_NAMES = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight", "lm_head": "lm_head.weight"}


def hf_names(path: str, num_layers: int) -> list[str]:
    """The HF tensor names behind one of our parameter paths ('layers/q_proj' -> one per layer)."""
    if path.startswith("layers/"):
        leaf = _LAYER_NAMES[path.split("/", 1)[1]]
        return [f"model.layers.{i}.{leaf}" for i in range(num_layers)]
    return [_TOP_NAMES[path]]


def _expected_hf_shape(our_shape: tuple[int, ...], path: str, cfg: ModelConfig) -> tuple[int, ...]:
    leaf = path.split("/")[-1]
    layer_shape = our_shape[1:] if path.startswith("layers/") else our_shape
    return _mappings(cfg)[leaf].to_hf(np.empty(layer_shape, np.int8)).shape


def _abstract_model(cfg: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
    return nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))


def load_model(path: str, mesh: Optional[Mesh] = None, preset: str = "", **config_overrides: Any) -> Transformer:
    """Loads an HF checkpoint folder into a Transformer whose parameters sit on their shards.

    Args:
      path: local folder or gs://bucket/path holding config.json and model.safetensors (or shards + index).
      mesh: place parameters by the partition rules of `llds_jax.parallel`; None: the default device.
      preset: a named architecture (a run's `model.preset`) the checkpoint's config.json must match, checked
        before any weight is read.
      config_overrides: ModelConfig fields to set (dtype, param_dtype, scan_layers, remat).
    Raises:
      ValueError naming missing, unexpected or mis-shaped tensors.
    """
    folder = CheckpointFolder(path)
    cfg = from_hf_config(folder.config(), **config_overrides)
    if preset:
        check_preset(cfg, preset)
    graphdef, abstract = _abstract_model(cfg)
    flat = {parallel.path_str(p): v.get_value() for p, v in nnx.to_flat_state(abstract)}
    _check_tensors(folder, flat, cfg)
    if mesh is not None:
        parallel.validate({k: v.shape for k, v in flat.items()}, mesh)
    maps = _mappings(cfg)
    param_dtype = np.dtype(jnp.dtype(cfg.param_dtype))

    def build(path_tuple, var):
        path = parallel.path_str(path_tuple)
        abstract_leaf = var.get_value()
        sharding = (NamedSharding(mesh, parallel.spec_for(path)) if mesh is not None
                    else SingleDeviceSharding(jax.devices()[0]))
        mapping, names = maps[path.split("/")[-1]], hf_names(path, cfg.num_layers)
        stacked = path.startswith("layers/")

        def read_block(index: tuple[slice, ...]) -> np.ndarray:
            if not stacked:
                blk = folder.read_rows(names[0], mapping.rows_of(index))
                return mapping.to_ours(blk, index).astype(param_dtype)
            layers = range(*index[0].indices(cfg.num_layers))
            inner = index[1:]
            return np.stack([mapping.to_ours(folder.read_rows(names[i], mapping.rows_of(inner)), inner)
                             for i in layers]).astype(param_dtype)

        value = jax.make_array_from_callback(abstract_leaf.shape, sharding, read_block)
        return var.replace(value)

    return nnx.merge(graphdef, nnx.map_state(build, abstract))


def _check_tensors(folder: CheckpointFolder, flat: dict[str, Any], cfg: ModelConfig) -> None:
    expected: dict[str, tuple[int, ...]] = {}
    for path, leaf in flat.items():
        hf_shape = _expected_hf_shape(leaf.shape, path, cfg)
        for name in hf_names(path, cfg.num_layers):
            expected[name] = hf_shape
    present = folder.names()
    allowed_extra = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    missing = sorted(set(expected) - present)
    unexpected = sorted(n for n in present - set(expected) - allowed_extra if not n.endswith("rotary_emb.inv_freq"))
    bad = [f"{n}: expected {expected[n]}, got {folder.shape(n)}" for n in sorted(set(expected) & present)
           if folder.shape(n) != expected[n]]
    problems = []
    if missing:
        problems.append(f"missing tensors {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    if unexpected:
        problems.append(f"unexpected tensors {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
    if bad:
        problems.append("shape mismatch " + "; ".join(bad[:8]))
    if problems:
        raise InputError(f"{folder.path}: checkpoint does not fit the config: " + " | ".join(problems))


def _spans_processes(x: Any) -> bool:
    """Whether `x` is a jax.Array with shards on devices of other processes."""
    return isinstance(x, jax.Array) and not x.is_fully_addressable


def _host_array(x: Any) -> np.ndarray:
    """The whole array on this host; one that spans several processes is gathered from all of them (a collective:
    every process calls it for the same array)."""
    if _spans_processes(x):
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


def hf_state_dict(model: Transformer, dtype: str = "float32") -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, host array) pairs of a model's parameters, one tensor at a time. With parameters spread over
    several processes every process iterates over all of them, in the same order (see `_host_array`)."""
    cfg = model.cfg
    maps = _mappings(cfg)
    np_dtype = np.dtype(jnp.dtype(dtype))
    for path_tuple, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        path = parallel.path_str(path_tuple)
        arr = _host_array(var.get_value())
        to_hf = maps[path.split("/")[-1]].to_hf
        names = hf_names(path, cfg.num_layers)
        layers = list(arr) if path.startswith("layers/") else [arr]
        for name, layer in zip(names, layers):
            yield name, np.ascontiguousarray(to_hf(layer)).astype(np_dtype)


def save_model(model: Transformer, path: str, dtype: str = "float32", max_shard_bytes: int = 2 << 30,
               generation_config: Optional[Mapping[str, Any]] = None) -> None:
    """Writes config.json, generation_config.json and safetensors (sharded with an index above `max_shard_bytes`
    bytes) to a folder or gs://.

    generation_config.json is `generation_config` (pass the source checkpoint's, `read_generation_config`), else
    one built from the model's special token ids, else (no ids either) not written.
    A model whose parameters span several processes (a pod's global mesh) is saved by every process calling this:
    each gathers every tensor, process 0 writes the files. A process-local model is written by whoever calls.
    """
    spans_processes = any(_spans_processes(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, arr in hf_state_dict(model, dtype):
        if shards[-1] and size + arr.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = arr
        size += arr.nbytes
    if spans_processes and jax.process_index() != 0:
        return
    kv = ts.KvStore.open(_kvstore_url(path)).result()
    config = to_hf_config(model.cfg, torch_dtype=dtype)
    kv.write(CONFIG_FILE, json.dumps(config, indent=2).encode()).result()
    ids = token_ids(model.cfg)
    if generation_config is None and ids:
        generation_config = {"_from_model_config": True, **ids}
    if generation_config is not None:
        kv.write(GENERATION_CONFIG_FILE, json.dumps(dict(generation_config), indent=2).encode()).result()
    if len(shards) == 1:
        kv.write(SINGLE_FILE, safetensors_save(shards[0], metadata={"format": "pt"})).result()
        return
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        kv.write(file, safetensors_save(shard, metadata={"format": "pt"})).result()
        for name, arr in shard.items():
            weight_map[name] = file
            total += arr.nbytes
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    kv.write(INDEX_FILE, json.dumps(index, indent=2).encode()).result()
