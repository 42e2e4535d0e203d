"""The kernel cost model (`llds_jax.aot.kernel_cost`) against the kernel itself: JAX's ragged paged attention run in
Pallas's TPU interpret mode on the CPU (its grid, index maps, loops and page copies executed as on a chip, the pool
and the buffers simulated), every grid step and every page copy it starts recorded, for a few shapes: a ragged
forward whose sequences span q blocks and kv blocks, a decode iteration of two heads blocks, and a call through the
project's own `paged_attention` at its default tile.

Two gaps of the interpreter (JAX 0.10.2) are bridged for the run, neither touching what is counted: a load through a
reshaped ref (the kernel reshapes its kv buffer before its strided loads) is read before the reshape and reshaped
after, and a masked store of a multi-dimensional block (the interpreter checks the mask's bounds on the first
dimension only) is a load, a merge and a store. The outputs are checked against the kernel's own reference
implementation, so the bridged run computes attention, not only copies.
"""
import collections
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
from jax._src.pallas.mosaic.interpret import utils as interpret_utils
from jax._src.state.types import ReshapeTransform
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as rpa

from llds_jax.aot import kernel_cost
from llds_jax.model import paged_attention

# What the interpreted kernel did: its grid points in order, each page copy it started ((page, bytes)), each wait.
SEEN = {"grid": [], "copies": [], "waits": []}
_ORIGINAL = {"dma_start": ipc.dma_start, "dma_wait": ipc.dma_wait, "get": ipc.get, "swap": ipc.swap}


def _range_of(transforms):
    return interpret_utils.to_range(jax.tree.map(int, transforms))


def _dma_start(token, device_id, core, src_space, src_id, src_transforms, *args, **kwargs):
    """A page copy from the pool: its page (the first index) and its bytes (Z x the heads block's rows x H x 4)."""
    rng = _range_of(src_transforms)
    size = math.prod((r.stop - r.start) // (r.step or 1) for r in rng if isinstance(r, slice))
    SEEN["copies"].append((rng[0], size * 4))
    return _ORIGINAL["dma_start"](token, device_id, core, src_space, src_id, src_transforms, *args, **kwargs)


def _dma_wait(token, device_id, core, sem_id, size, **kwargs):
    SEEN["waits"].append(int(size))
    return _ORIGINAL["dma_wait"](token, device_id, core, sem_id, size, **kwargs)


def _get(token, device_id, core, space, buffer_id, transforms, *args, **kwargs):
    """A load through a reshaped ref: the range before the reshape, reshaped, then the indexers after it."""
    cut = next((i for i, t in enumerate(transforms) if isinstance(t, ReshapeTransform)), None)
    if cut is None:
        return _ORIGINAL["get"](token, device_id, core, space, buffer_id, transforms, *args, **kwargs)
    token, value = _ORIGINAL["get"](token, device_id, core, space, buffer_id, transforms[:cut], *args, **kwargs)
    value = np.asarray(value).reshape(transforms[cut].shape)
    for t in transforms[cut + 1:]:
        value = value[_range_of((t,))]
    return token, value


def _swap(token, device_id, core, space, buffer_id, transforms, val, mask, **kwargs):
    """A masked store as a load, a merge and an unmasked store; returns what a masked swap returns."""
    if mask is None:
        return _ORIGINAL["swap"](token, device_id, core, space, buffer_id, transforms, val, mask, **kwargs)
    token, old = _ORIGINAL["get"](token, device_id, core, space, buffer_id, transforms,
                                  source_info=kwargs.get("source_info"))
    mask = np.asarray(mask)
    token, _ = _ORIGINAL["swap"](token, device_id, core, space, buffer_id, transforms, np.where(mask, val, old),
                                 None, **kwargs)
    return token, np.where(mask, old, val)


def _grid_point(token, point, core):
    SEEN["grid"].append(tuple(int(i) for i in point))
    return token


# The wrapped functions keep the interpreter's unwrapped ones, which its copies call directly.
for _name, _fn in (("get", _get), ("swap", _swap)):
    _fn.__wrapped__ = _ORIGINAL[_name].__wrapped__
INTERPRET = pltpu.InterpretParams(grid_point_recorder=_grid_point)


@pytest.fixture(autouse=True)
def _instrumented_interpreter(monkeypatch):
    for name, fn in (("dma_start", _dma_start), ("dma_wait", _dma_wait), ("get", _get), ("swap", _swap)):
        monkeypatch.setattr(ipc, name, fn)
    for seen in SEEN.values():
        seen.clear()


@dataclasses.dataclass(frozen=True)
class Batch:
    """A ragged batch in float32 whose sequences own distinct pages (sequence s: pages 1 + s M .. (s + 1) M; page 0
    unused, as the engine's padding page)."""

    shape: kernel_cost.KernelShape
    tokens: int
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]

    def arrays(self, seed=0):
        s, m, z = len(self.q_lens), self.shape.pages_per_seq, self.shape.page_size
        rng = np.random.default_rng(seed)
        q = rng.standard_normal((self.tokens, self.shape.num_heads, self.shape.head_dim))
        pool = rng.standard_normal((1 + s * m, z, 2 * self.shape.num_kv_heads, self.shape.head_dim))
        cu = np.concatenate([[0], np.cumsum(self.q_lens)])
        table = 1 + np.arange(s * m).reshape(s, m)
        return (jnp.asarray(q, jnp.float32), jnp.asarray(pool, jnp.float32), jnp.asarray(self.kv_lens, jnp.int32),
                jnp.asarray(table, jnp.int32), jnp.asarray(cu, jnp.int32), jnp.asarray([s], jnp.int32))

    def owner(self, page: int) -> int:
        return (page - 1) // self.shape.pages_per_seq


def run_kernel(batch: Batch, call):
    """Runs `call(*batch.arrays())` (the kernel, directly or through `paged_attention`) in TPU interpret mode;
    checks its output against the kernel's reference at the batch's tokens."""
    args = batch.arrays()
    with pltpu.force_tpu_interpret_mode(INTERPRET):
        out = np.asarray(call(*args))
    jax.effects_barrier()
    real = sum(batch.q_lens)
    want = np.asarray(rpa.ref_ragged_paged_attention(*args, sm_scale=batch.shape.head_dim ** -0.5))
    np.testing.assert_allclose(out[:real], want, rtol=1e-4, atol=1e-4)


def kernel_at_tile(batch: Batch):
    shape = batch.shape
    return lambda *args: rpa.ragged_paged_attention(
        *args, sm_scale=shape.head_dim ** -0.5, num_kv_pages_per_block=shape.block_pages,
        num_queries_per_block=shape.block_queries(batch.tokens))


def expected_copies(batch: Batch, model: kernel_cost.KernelCall) -> dict[int, collections.Counter]:
    """Per sequence, the pages the model says the kernel copies: each of its pages once per visit of a q block
    (in every heads block), its first page again for every page of a kv block past its end."""
    shape, hb, bkv = batch.shape, batch.shape.heads_blocks, batch.shape.block_pages
    q_visits = kernel_cost.q_blocks_visiting(np.asarray(batch.q_lens), shape.block_queries(batch.tokens))
    out = {}
    for s, (kv_len, qv, visits) in enumerate(zip(batch.kv_lens, q_visits, model.visits_s)):
        pages = -(-kv_len // shape.page_size)
        first = 1 + s * shape.pages_per_seq
        counts = collections.Counter({first + j: hb * int(qv) for j in range(pages)})
        counts[first] += hb * (visits * bkv - int(qv) * pages)
        out[s] = counts
    return out


def assert_model_matches_the_kernel(batch: Batch):
    model = kernel_cost.kernel_call(batch.shape, batch.tokens, batch.q_lens, batch.kv_lens)
    assert len(SEEN["grid"]) == model.grid_steps
    assert len(SEEN["copies"]) == model.page_copies
    assert sum(size for _, size in SEEN["copies"]) == model.pool_bytes
    assert len(SEEN["waits"]) == len(SEEN["copies"])  # every copy started is waited for: none wasted
    copied = collections.defaultdict(collections.Counter)
    for page, _ in SEEN["copies"]:
        copied[batch.owner(page)][page] += 1
    assert dict(copied) == {s: c for s, c in expected_copies(batch, model).items() if c}
    return model


def test_a_ragged_forward_copies_whole_kv_blocks_once_per_q_block_of_each_sequence():
    """16 tokens in q blocks of 4, kv blocks of 2 pages of 8 slots. Sequence 0 (5 tokens, 20 slots) spans q blocks
    0 and 1: 2 kv blocks each time, its 4th page past its end (3 pages) copied as its first; sequence 3 (3 tokens
    at 7-9) spans blocks 1 and 2; the last q block (12-15) holds no token and copies nothing. 20 page copies of
    8 x 4 x 128 float32, of which 17 pages the sequences hold."""
    shape = kernel_cost.KernelShape(num_heads=4, num_kv_heads=2, head_dim=128, page_size=8, pages_per_seq=8,
                                    dtype="float32", kv_pages_per_block=2, queries_per_block=4)
    batch = Batch(shape, 16, (5, 1, 1, 3), (20, 9, 1, 30))
    run_kernel(batch, kernel_at_tile(batch))
    model = assert_model_matches_the_kernel(batch)
    assert SEEN["grid"] == [(0, 0), (0, 1), (0, 2), (0, 3)]
    assert (model.visits_s, model.page_copies, model.useful_page_copies) == ((4, 1, 1, 4), 20, 17)
    assert model.pool_bytes == 20 * 8 * 4 * 128 * 4
    assert model.flops == 10 * 4 * 4 * 4 * 2 * 8 * 128  # 10 visits of a 4-token q block against 16 keys, 4 heads


def test_a_decode_iteration_copies_a_whole_kv_block_for_every_slot_in_every_heads_block():
    """8 slots of one token each (the rows that stopped sampling at kv_len 1), 8 key/value heads in float32: two
    heads blocks of 4 query heads (the kernel's `get_min_heads_per_blk`), each copying every slot's kv blocks of
    4 pages: 11 kv blocks per heads block, 88 page copies, 48 of them pages the slots hold."""
    shape = kernel_cost.KernelShape(num_heads=8, num_kv_heads=8, head_dim=128, page_size=8, pages_per_seq=8,
                                    dtype="float32", kv_pages_per_block=4, queries_per_block=4)
    batch = Batch(shape, 8, (1,) * 8, (33, 1, 1, 7, 64, 1, 12, 40))
    assert shape.heads_blocks == 2
    run_kernel(batch, kernel_at_tile(batch))
    model = assert_model_matches_the_kernel(batch)
    assert SEEN["grid"] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert (model.visits_s, model.page_copies, model.useful_page_copies) == ((2, 1, 1, 1, 2, 1, 1, 2), 88, 48)


def test_the_projects_call_at_its_default_tile_clipped_to_the_batch():
    """`paged_attention` passes the tile 32 x 32 clipped to the page table (4 pages) and the tokens (64): q blocks
    of 32 tokens, kv blocks of 4 pages of 16 slots. Sequence 0 (40 tokens) spans both q blocks."""
    shape = kernel_cost.KernelShape(num_heads=4, num_kv_heads=2, head_dim=128, page_size=16, pages_per_seq=4,
                                    dtype="float32", kv_pages_per_block=paged_attention.KERNEL_KV_PAGES_PER_BLOCK,
                                    queries_per_block=paged_attention.KERNEL_QUERIES_PER_BLOCK)
    batch = Batch(shape, 64, (40, 1, 3), (50, 17, 3))
    run_kernel(batch, lambda *args: paged_attention.paged_attention(*args, implementation="kernel"))
    model = assert_model_matches_the_kernel(batch)
    assert (shape.block_pages, shape.block_queries(64), model.grid_steps) == (4, 32, 2)
    assert (model.visits_s, model.page_copies) == ((2, 1, 1), 16)


def test_a_call_the_model_does_not_take_is_refused():
    shape = kernel_cost.KernelShape(4, 2, 128, 8, 8, "float32", 2, 4)
    with pytest.raises(ValueError, match="q_len >= 1"):
        kernel_cost.kernel_call(shape, 16, (5, 0), (20, 9))
    with pytest.raises(ValueError, match="tokens in an operand of 16"):
        kernel_cost.kernel_call(shape, 16, (10, 10), (20, 20))


def test_a_qwen7b_v4_decode_iteration_moves_whole_blocks_for_every_slot():
    """qwen7b_v4 on one chip of its 4 (7 query heads, 1 key/value head of 128, bfloat16, pages of 64 slots, 64 per
    sequence) at the kernel's default tile: a decode iteration of its 128 slots, each under 2,048 slots long, copies
    one kv block of 32 pages (2,048 slots) per slot and layer, 3.76 GB over 28 layers where the sequences at 900
    slots hold 15 pages each (1.76 GB), and computes a 32-token q block against 2,048 keys per slot: 842 GFLOP."""
    shape = kernel_cost.KernelShape(7, 1, 128, 64, 64, "bfloat16", paged_attention.KERNEL_KV_PAGES_PER_BLOCK,
                                    paged_attention.KERNEL_QUERIES_PER_BLOCK)
    call = kernel_cost.kernel_call(shape, 128, [1] * 128, [900] * 128)
    assert (shape.heads_blocks, call.grid_steps, call.page_copies, call.useful_page_copies) == (1, 4, 4096, 1920)
    assert 28 * call.pool_bytes == 28 * 128 * 32 * 64 * 2 * 128 * 2 == pytest.approx(3.758e9, rel=1e-3)
    assert 28 * call.flops == 28 * 128 * 4 * 32 * 7 * 2048 * 128 == pytest.approx(841.8e9, rel=1e-3)
