"""An exact inner-product index's vectors on the chips: read from the float32 Flat file a faiss retriever reads,
stored in bfloat16 or int8 (per-row scales), sharded by rows over a mesh's devices, loaded in chunks.

Layout: the N rows are cut into `shards` (the devices) of S = K blocks x R rows each (`IndexLayout`); shard p holds
rows [p * S, (p + 1) * S), the rows past N are zeros (the search masks them). A search scores one block of R rows
at a time, so its temporaries are [Q, R] (Q queries) whatever the index size.

Each stored row x̂ approximates the float32 row x; what the search's exactness proof needs is kept on the host:
`error_max` = max over rows of ||x - x̂||_2 and `norm_max` = max over rows of ||x̂||_2 (float64, from the rows as
they were stored). Loading reads `chunk_rows` rows at a time from the memory-mapped file and writes them into their
device's shard in place, so the host never holds more than a chunk (wiki-18: 21,015,324 x 768 float32 = 64.6 GB on
disk; 32.3 GB in bfloat16 and 16.1 GB in int8 over all chips).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Sequence

import faiss
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from llds_jax.bounds import ConfigError
from llds_jax.errors import InputError
from llds_jax.search.dense_options import DeviceFlatOptions

log = logging.getLogger(__name__)

AXIS = "index_rows"  # the mesh axis the rows are split over
VECTOR_DTYPES = ("bfloat16", "int8")
INT8_MAX = 127.0


@dataclasses.dataclass(frozen=True)
class IndexLayout:
    """How `rows` rows of `dim` floats are laid out over `shards` devices: each holds `blocks` blocks of
    `block_rows` rows (shard_rows = blocks x block_rows >= ceil(rows / shards), the remainder zero padding)."""

    rows: int
    dim: int
    shards: int
    blocks: int
    block_rows: int
    dtype: str

    @property
    def shard_rows(self) -> int:
        return self.blocks * self.block_rows


def layout(rows: int, dim: int, shards: int, dtype: str, block_rows: int) -> IndexLayout:
    """The layout of `rows` x `dim` over `shards` devices in blocks of at most `block_rows` rows (a multiple of 8
    each, evened out so that a shard pads fewer than 8 rows per block)."""
    if dtype not in VECTOR_DTYPES:
        raise ConfigError(f"retriever.vector_dtype must be one of {', '.join(VECTOR_DTYPES)}, got {dtype!r}")
    per_shard = max(1, math.ceil(rows / shards))
    blocks = math.ceil(per_shard / block_rows)
    return IndexLayout(rows, dim, shards, blocks, 8 * math.ceil(per_shard / blocks / 8), dtype)


def quantize(x_nd: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray | None, np.ndarray, np.ndarray]:
    """(stored [n, D] bfloat16 or int8, scales [n] float32 for int8 else None, ||x - x̂||_2 [n], ||x̂||_2 [n]) of
    float32 rows `x_nd`; x̂ is the row the search multiplies: the bfloat16 row, or the int8 codes times the row's
    scale (max |x| / 127). Norms in float64."""
    x = np.asarray(x_nd, np.float32)
    if dtype == "bfloat16":
        stored = x.astype(ml_dtypes.bfloat16)
        scales = None
        approx = stored.astype(np.float64)
    else:
        scales = (np.abs(x).max(axis=1) / INT8_MAX).astype(np.float32)
        safe = np.where(scales > 0, scales, 1.0).astype(np.float32)
        stored = np.clip(np.rint(x / safe[:, None]), -INT8_MAX, INT8_MAX).astype(np.int8)
        approx = stored.astype(np.float64) * scales.astype(np.float64)[:, None]
    error = np.linalg.norm(x.astype(np.float64) - approx, axis=1)
    return stored, scales, error, np.linalg.norm(approx, axis=1)


def flat_vectors(index: faiss.Index, path: str) -> np.ndarray:
    """The float32 vectors [N, D] of a faiss Flat inner-product index `index` read from `path`, as a view of its
    (memory-mapped) storage; ValueError naming retriever.index_path for any other kind of index."""
    flat = faiss.downcast_index(index)
    if not isinstance(flat, faiss.IndexFlat) or flat.metric_type != faiss.METRIC_INNER_PRODUCT:
        raise InputError(f"faiss index {path} (retriever.index_path) is a {type(flat).__name__}: backend "
                         "e5_device reads the vectors of an exact Flat inner-product index (Search-R1's "
                         "e5_Flat.index, or index_builder's default --faiss-index Flat)")
    return faiss.rev_swig_ptr(flat.get_xb(), flat.ntotal * flat.d).reshape(flat.ntotal, flat.d)


@dataclasses.dataclass(frozen=True)
class DeviceIndex:
    """The stored rows on the chips and the bounds of their error.

    vectors: [shards x S, D] bfloat16 or int8, rows split over the mesh axis AXIS. scales: [shards x S] float32
    (int8) or None. error_max: max_r ||x_r - x̂_r||_2; norm_max: max_r ||x̂_r||_2 (float, host)."""

    layout: IndexLayout
    mesh: Mesh
    vectors: jax.Array
    scales: jax.Array | None
    error_max: float
    norm_max: float


def _write_rows(shard_sd, chunk_cd, start):
    return jax.lax.dynamic_update_slice(shard_sd, chunk_cd, (start,) + (0,) * (shard_sd.ndim - 1))


_write = jax.jit(_write_rows, donate_argnums=0)


def load(vectors_nd: np.ndarray, devices: Sequence[jax.Device], *, dtype: str = DeviceFlatOptions.vector_dtype,
         block_rows: int = DeviceFlatOptions.block_rows, chunk_rows: int = 65536, what: str = "index") -> DeviceIndex:
    """The float32 rows `vectors_nd` (a memory-mapped [N, D] array) stored on `devices`, `chunk_rows` rows at a
    time, logging progress (`what` names the index in the lines)."""
    rows, dim = vectors_nd.shape
    lay = layout(rows, dim, len(devices), dtype, block_rows)
    mesh = Mesh(np.asarray(devices), (AXIS,))
    stored_type = jnp.bfloat16 if dtype == "bfloat16" else jnp.int8
    vector_shards, scale_shards = [], []
    error_max = norm_max = 0.0
    start_s, done, reported = time.monotonic(), 0, 0
    for p, device in enumerate(devices):
        shard = jax.device_put(jnp.zeros((lay.shard_rows, dim), stored_type), device)
        scales = jax.device_put(jnp.zeros((lay.shard_rows,), jnp.float32), device) if dtype == "int8" else None
        first, last = min(rows, p * lay.shard_rows), min(rows, (p + 1) * lay.shard_rows)
        for begin in range(first, last, chunk_rows):
            end = min(last, begin + chunk_rows)
            stored, scale, error, norm = quantize(vectors_nd[begin:end], dtype)
            error_max, norm_max = max(error_max, float(error.max())), max(norm_max, float(norm.max()))
            offset = np.int32(begin - first)
            shard = _write(shard, jax.device_put(stored, device), offset)
            if scales is not None:
                scales = _write(scales, jax.device_put(scale, device), offset)
            done += end - begin
            if done - reported >= rows // 20 or done == rows:
                reported = done
                log.info("%s: %s of %s rows on the chips (%.0f%%, %.0f rows/s)", what, f"{done:,}", f"{rows:,}",
                         100 * done / rows, done / max(time.monotonic() - start_s, 1e-9))
        vector_shards.append(shard)
        scale_shards.append(scales)
    vectors = jax.make_array_from_single_device_arrays((lay.shards * lay.shard_rows, dim),
                                                       NamedSharding(mesh, P(AXIS, None)), vector_shards)
    scales = None
    if dtype == "int8":
        scales = jax.make_array_from_single_device_arrays((lay.shards * lay.shard_rows,),
                                                          NamedSharding(mesh, P(AXIS)), scale_shards)
    return DeviceIndex(lay, mesh, vectors, scales, error_max, norm_max)
