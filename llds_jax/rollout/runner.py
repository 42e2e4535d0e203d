"""The device side of the rollout engine: one jitted step program per token bucket over the paged KV cache.

A step (`step_program`) makes the page copies the host asked for (copy on write), runs the model over the ragged
batch (`Transformer.ragged_step`: prompt and observation chunks and decoding sequences' pending tokens, every
layer's keys and values written into their pages), samples each sequence's first token from the logits of its last
batch token, then runs up to C - 1 decode iterations in a `lax.while_loop` (every sampling sequence's last token
written and attended over its pages, the next token sampled) until each sequence has its `samples_s` tokens or
has sampled a stop id. Its shapes: T (the bucket) for the ragged batch and S (the engine's sequence slots) for the
decode iterations, so the rollout compiles one program per token bucket, whatever mix of prompts, observations
and decoding a step holds.

A decode iteration runs only the rows still sampling (issue 67): they go first, dealt to B ragged batches
(`decode_rows`), and the attention kernel runs each batch's first num_seqs rows (its grid skips the rest); B is
the shards of the rollout mesh's "batch" axes (`decode_batches`): where a host's chips form several
tensor-parallel groups, each group decodes its own share of the rows (`Transformer.batched_ragged_step`). The
kernel's tile is the config's (`rollout.KernelTiles`): one for the ragged forward of the buckets above the slots',
another for the slots' bucket and the decode iterations.

A decoding sequence's batch token may be the last one its row sampled in the call before, never brought to the host
(`StepBatch.source_s`): the step takes the call before's samples as device arrays, so the engine dispatches a call
while the one before runs (`DeviceRunner.dispatch`, `fetch`).

Sequence s samples its i-th token of the call with fold_in(key_s, count_s + i) (`sampling.sample_tokens`: the
sampling distribution's log-probs over the full vocabulary, top-p / top-k only restricting the draw), whichever
row and batch it runs in.

Dimension letters (docs/architecture.md, "Dimension letters"): T ragged batch tokens, S sequence slots, C samples
per call, M pages per sequence, L layers, P pool pages, Z tokens per page, V vocabulary, B a decode iteration's
ragged batches (a decode iteration's S rows in batch order are written s too); the pool's `kv_pages_lpzkh` keeps the
model's name (its K' = 2K: keys and values interleaved, `llds_jax.model.paged_kv`).
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from llds_jax import parallel
from llds_jax.model import paged_kv
from llds_jax.model.config import ModelConfig
from llds_jax.programs import AbstractProgram, Role
from llds_jax.rollout import sampling
from llds_jax.rollout.config import KernelTiles, SamplingConfig, Tile
from llds_jax.rollout.step_calls import EngineConfig, StepBatch, StepResult


def copy_pages(kv_pages_lpzkh: jax.Array, page_copies: jax.Array) -> jax.Array:
    """Copies every layer's page page_copies[i, 0] to page page_copies[i, 1], in order ([0, 0]: a no-op)."""
    def one(pages, copy):
        return jax.lax.dynamic_update_index_in_dim(
            pages, jax.lax.dynamic_index_in_dim(pages, copy[0], axis=1, keepdims=False), copy[1], axis=1), None
    return jax.lax.scan(one, kv_pages_lpzkh, page_copies)[0]


def step_program(graphdef, cfg: SamplingConfig, decode_chunk: int, forward_tile: Tile, decode_tile: Tile,
                 batches: int, params, kv_pages_lpzkh, tokens_t, cu_q_lens_s1, kv_lens_s, page_table_sm, num_seqs,
                 samples_s, key_data_s, count_s, page_copies, previous_tokens_sc, previous_taken_s, source_s):
    """One engine step (module docstring): the ragged forward at the kernel's `forward_tile`, each decode iteration
    as `batches` ragged batches of the sampling rows (`decode_rows`) at its `decode_tile`. A row r with source_s[r]
    = j >= 0 takes as its batch token the last of row j's samples in the call before (`previous_tokens_sc` int32
    [S, C], `previous_taken_s` int32 [S]: that call's outputs); where that token is a stop id, the row samples
    nothing. Returns (pool, tokens int32 [S, C], log-probs float32 [S, C], samples taken int32 [S])."""
    model = nnx.merge(graphdef, params)
    s = samples_s.shape[0]
    stop_ids = jnp.asarray(cfg.stop_ids or (-1,), jnp.int32)
    keys_s = jax.random.wrap_key_data(key_data_s)
    source_s1 = jnp.maximum(source_s, 0)[:, None]
    last_s = jnp.take_along_axis(previous_tokens_sc[source_s1[:, 0]],
                                 jnp.maximum(previous_taken_s[source_s1] - 1, 0), axis=1)[:, 0]
    tokens_t = tokens_t.at[jnp.where(source_s >= 0, cu_q_lens_s1[:s], tokens_t.shape[0])].set(last_s, mode="drop")
    # A row whose turn ended on a stop id in the call before samples nothing (the engine drops its row).
    samples_s = jnp.where((source_s >= 0) & jnp.isin(last_s, stop_ids), 0, samples_s)
    pages = copy_pages(kv_pages_lpzkh, page_copies)
    logits_sv, pages = model.ragged_step(tokens_t, pages, kv_lens_s, page_table_sm, cu_q_lens_s1, num_seqs,
                                         **forward_tile.kwargs())

    def draw(logits_sv, i, slots_s):  # the i-th samples of the slots `slots_s`, from their logits
        keys = jax.vmap(jax.random.fold_in)(keys_s[slots_s], (count_s[slots_s] + i).astype(jnp.uint32))
        return sampling.sample_tokens(logits_sv, keys, cfg)

    every_row = jnp.arange(s, dtype=jnp.int32)
    token_s, logp_s = draw(logits_sv, 0, every_row)
    tokens_sc = jnp.zeros((s, decode_chunk), jnp.int32).at[:, 0].set(token_s)
    logps_sc = jnp.zeros((s, decode_chunk), jnp.float32).at[:, 0].set(logp_s)
    taken_s = (samples_s > 0).astype(jnp.int32)
    active_s = (samples_s > 1) & ~jnp.isin(token_s, stop_ids)
    one_each_bs1 = jnp.broadcast_to(jnp.arange(s // batches + 1, dtype=jnp.int32), (batches, s // batches + 1))

    def cond(carry):
        i, _, _, _, _, _, active_s = carry
        return (i < decode_chunk) & jnp.any(active_s)

    def body(carry):
        i, pages, kv_len_s, tokens_sc, logps_sc, taken_s, active_s = carry
        kv_len_s = jnp.where(active_s, kv_len_s + 1, kv_len_s)
        # A batch's rows past its sampling ones are padding; a batch with none runs one row that is not sampling,
        # which writes to the padding page and attends to it (its sample is dropped).
        slots_bs, row_s, num_seqs_b1 = decode_rows(active_s, batches)
        logits_bsv, pages = model.batched_ragged_step(
            tokens_sc[:, i - 1][slots_bs], pages, jnp.where(active_s, kv_len_s, 1)[slots_bs],
            jnp.where(active_s[:, None], page_table_sm, 0)[slots_bs], one_each_bs1, num_seqs_b1,
            **decode_tile.kwargs())
        batch_token_s, batch_logp_s = draw(logits_bsv.reshape(s, -1), i, slots_bs.reshape(-1))
        token_s, logp_s = batch_token_s[row_s], batch_logp_s[row_s]  # the slots back in order
        tokens_sc = tokens_sc.at[:, i].set(jnp.where(active_s, token_s, 0))
        logps_sc = logps_sc.at[:, i].set(jnp.where(active_s, logp_s, 0.0))
        taken_s = taken_s + active_s
        active_s = active_s & (i + 1 < samples_s) & ~jnp.isin(token_s, stop_ids)
        return i + 1, pages, kv_len_s, tokens_sc, logps_sc, taken_s, active_s

    carry = (jnp.int32(1), pages, kv_lens_s, tokens_sc, logps_sc, taken_s, active_s)
    _, pages, _, tokens_sc, logps_sc, taken_s, _ = jax.lax.while_loop(cond, body, carry)
    return pages, tokens_sc, logps_sc, taken_s


def decode_rows(active_s: jax.Array, batches: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Where a decode iteration runs each of the S slots: the sampling ones first (in slot order), then the others,
    dealt to the B = `batches` ragged batches in turn (the p-th of that order to batch p mod B), so that each batch
    holds its sampling rows first and the batches differ by at most one of them. The kernel runs a batch's first
    num_seqs rows only (`paged_attention`: its grid skips the q blocks past them). No sort (a step program sorts
    nothing).

    Returns (the slot at each batch row, int32 [B, S / B]; each slot's row among the batches' rows one after the
    other, int32 [S]; each batch's sampling rows, at least 1, int32 [B, 1]).
    """
    s = active_s.shape[0]
    sampling_s = active_s.astype(jnp.int32)
    sampling_rows = jnp.sum(sampling_s)
    place_s = jnp.where(active_s, jnp.cumsum(sampling_s), sampling_rows + jnp.cumsum(1 - sampling_s)) - 1
    row_s = place_s % batches * (s // batches) + place_s // batches
    slot_s = jnp.zeros(s, jnp.int32).at[row_s].set(jnp.arange(s, dtype=jnp.int32))
    num_seqs_b = (sampling_rows - jnp.arange(batches, dtype=jnp.int32) + batches - 1) // batches
    return slot_s.reshape(batches, s // batches), row_s, jnp.maximum(num_seqs_b, 1)[:, None]


def decode_batches(mesh: Optional[Mesh], slots: int) -> int:
    """The ragged batches of a decode iteration: the shards of the mesh's "batch" axes (a rollout's tensor-parallel
    groups split over data: each decodes its own sampling rows) where they divide the `slots`, else 1."""
    batches = 1 if mesh is None else parallel.axis_size(mesh, "batch")
    return batches if slots % batches == 0 else 1


class PagePool:
    """The page pool's device array, allocated at the first step that needs it and shared by the runners of one
    run (training and evaluation rollouts never run at once; every rollout writes a page before reading it).

    Args:
      shape: the pool [L, P, Z, 2K, H] with its dtype and sharding (`pool_shape`).
    """

    def __init__(self, shape: jax.ShapeDtypeStruct):
        self.shape = shape
        self.array: Optional[jax.Array] = None

    def take(self) -> jax.Array:
        """The pool (allocated now if it is not): hand it to a step, which donates it, then `put` the result."""
        if self.array is None:
            shape = self.shape
            self.array = jax.jit(lambda: jnp.zeros(shape.shape, shape.dtype), out_shardings=shape.sharding)()
        array, self.array = self.array, None
        return array

    def put(self, array: jax.Array) -> None:
        self.array = array

    def bytes_per_device(self) -> int:
        """Bytes of the pool on each device (its shard)."""
        dims = self.shape.shape if self.shape.sharding is None else self.shape.sharding.shard_shape(self.shape.shape)
        return int(np.prod(dims)) * jnp.dtype(self.shape.dtype).itemsize


class DeviceRunner:
    """The engine's device side (`step_calls.OverlappingRunner`, and `step_calls.StepRunner` one call at a time): the page
    pool and the step program, compiled once per token bucket (ahead of the first call at that bucket, or of every
    bucket by `compile_all`).

    Args:
      graphdef: from `graphdef, params = nnx.split(model)`.
      model_cfg: the model's config (the pool's layers, heads and dtype).
      sampling: how tokens are drawn (stop ids, temperature, top-p, top-k, greedy).
      engine: the engine's static shapes (pages, page size, slots, decode chunk).
      mesh: the rollout's mesh (a host's chips); the pool is split over its key/value heads
        (`paged_kv.pages_spec`), the batch's host arrays replicated; a decode iteration runs one ragged batch per
        shard of its "batch" axes (`decode_batches`). None: the default device.
      pool: the pool to share with another runner of the run (`PagePool` of `pool_shape(...)`); None: its own.
      tiles: the attention kernel's tiles per token bucket and in decode iterations (default: the kernel's).
    """

    def __init__(self, graphdef, model_cfg: ModelConfig, sampling: SamplingConfig, engine: EngineConfig,
                 mesh: Optional[Mesh] = None, pool: Optional[PagePool] = None, tiles: KernelTiles = KernelTiles()):
        self.engine, self.model_cfg, self.mesh, self.tiles = engine, model_cfg, mesh, tiles
        self.batches = decode_batches(mesh, engine.max_seqs)
        self._step = functools.partial(step_program, graphdef, sampling, engine.decode_chunk)
        self.pool = pool or PagePool(pool_shape(model_cfg, engine, mesh))
        if self.pool.shape.shape[1] < engine.num_pages:
            raise ValueError(f"DeviceRunner: the shared pool has {self.pool.shape.shape[1]} pages, the engine "
                             f"{engine.num_pages}")
        self._compiled: dict[int, Any] = {}  # token bucket -> its compiled step program
        self.compiles = 0
        self._nothing_before: Optional[tuple[jax.Array, jax.Array]] = None  # `previous` of a first call
        self._watcher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="step-ready")

    def run(self, params: Any, batch: StepBatch) -> StepResult:
        """One call at a time (`step_calls.StepRunner`): dispatch, then fetch."""
        return self.fetch(self.dispatch(params, batch, None))

    def dispatch(self, params: Any, batch: StepBatch, previous: Optional[DispatchedStep]) -> DispatchedStep:
        """Starts the step program on the batch (`step_calls.OverlappingRunner`): nothing waits for the device; a
        watcher thread notes when its results are there. `previous`: the call dispatched before (None: none)."""
        if previous is None:
            if self._nothing_before is None:
                s, c = self.engine.max_seqs, self.engine.decode_chunk
                self._nothing_before = jax.device_put((np.zeros((s, c), np.int32), np.zeros(s, np.int32)),
                                                      self._replicated)
            before = self._nothing_before
        elif self.mesh is None:
            before = previous.tokens_sc, previous.taken_s
        else:  # as the program takes them (its outputs' sharding is the compiler's)
            before = jax.device_put((previous.tokens_sc, previous.taken_s), self._replicated)
        args = (self.pool.take(), batch.tokens_t, batch.cu_q_lens_s, batch.kv_lens_s, batch.page_table_sm,
                np.asarray([batch.num_seqs], np.int32), batch.samples_s, batch.key_data_s, batch.count_s,
                batch.page_copies, *before, batch.source_s)
        program = self._program(params, len(batch.tokens_t))
        pages, tokens_sc, logps_sc, taken_s = program(params, *args)
        self.pool.put(pages)
        return DispatchedStep(tokens_sc, logps_sc, taken_s, self._watcher.submit(_ready_at, (tokens_sc, logps_sc,
                                                                                            taken_s)))

    def fetch(self, handle: DispatchedStep) -> StepResult:
        """The call's samples on the host (waits for them)."""
        tokens_sc, logps_sc, taken_s = jax.device_get((handle.tokens_sc, handle.logps_sc, handle.taken_s))
        return StepResult(np.asarray(tokens_sc), np.asarray(logps_sc), np.asarray(taken_s), handle.ready.result())

    def compile_all(self, params: Any) -> int:
        """Compiles the step program at every token bucket not compiled yet; returns how many it compiled."""
        before = self.compiles
        for bucket in self.engine.token_budgets:
            self._program(params, bucket)
        return self.compiles - before

    def abstract_programs(self, params: Any) -> list[AbstractProgram]:
        """The step program at every token bucket, at abstract arguments (`programs.CompilablePrograms`), for
        `--mode=compile`; `params` as the rollout gets them (ShapeDtypeStructs with shardings)."""
        e = self.engine
        return [AbstractProgram(Role.ROLLOUT_STEP, f"{e.max_seqs} sequences x {e.decode_chunk} samples, "
                                f"{e.num_pages} pages of {e.page_size} slots", self.step(bucket),
                                (params, *self.abstract_args(bucket)), mesh=self.mesh, detail=f"{bucket} tokens")
                for bucket in e.token_budgets]

    def step(self, bucket: int):
        """The jitted step program of token bucket `bucket` (its ragged forward's tile, the decode tile and
        batches), the pool donated."""
        forward = self.tiles.forward(bucket, self.engine.max_seqs)
        return jax.jit(functools.partial(self._step, forward, self.tiles.decode, self.batches), donate_argnums=1)

    def _program(self, params: Any, bucket: int):
        if bucket not in self._compiled:
            with jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext():
                self._compiled[bucket] = self.step(bucket).lower(params, *self.abstract_args(bucket)).compile()
            self.compiles += 1
        return self._compiled[bucket]

    @property
    def _replicated(self) -> Optional[NamedSharding]:
        return None if self.mesh is None else NamedSharding(self.mesh, P())

    def abstract_args(self, bucket: int) -> tuple[jax.ShapeDtypeStruct, ...]:
        """The step program's arguments after the params, at token bucket `bucket`: the pool, the batch, then the
        call before's samples and taken counts and each row's source among them (replicated under a mesh)."""
        e = self.engine
        s, i32 = e.max_seqs, np.int32

        def shape(dims, dtype=i32):
            return jax.ShapeDtypeStruct(dims, dtype, sharding=self._replicated)

        return (self.pool.shape, shape((bucket,)), shape((s + 1,)), shape((s,)), shape((s, e.pages_per_seq)),
                shape((1,)), shape((s,)), shape((s, 2), np.uint32), shape((s,)), shape((e.max_copies, 2)),
                shape((s, e.decode_chunk)), shape((s,)), shape((s,)))


@dataclasses.dataclass(frozen=True)
class DispatchedStep:
    """A step program's call in flight: its outputs (device arrays) and when they were there (`ready`: a future of
    the `time.perf_counter` seconds)."""

    tokens_sc: jax.Array
    logps_sc: jax.Array
    taken_s: jax.Array
    ready: concurrent.futures.Future


def _ready_at(arrays) -> float:
    """Waits for the arrays; returns when they were there (`time.perf_counter` seconds)."""
    jax.block_until_ready(arrays)
    return time.perf_counter()


def pool_shape(model_cfg: ModelConfig, engine: EngineConfig, mesh: Optional[Mesh] = None
               ) -> jax.ShapeDtypeStruct:
    """The page pool [L, P, Z, 2K, H] of `engine` in the model's compute dtype, split over the key/value heads of
    `mesh` (`paged_kv.pages_spec`)."""
    shape = (model_cfg.num_layers, engine.num_pages, engine.page_size, 2 * model_cfg.num_kv_heads,
             model_cfg.head_dim)
    sharding = None if mesh is None else NamedSharding(mesh, paged_kv.pages_spec(mesh, model_cfg.num_kv_heads))
    return jax.ShapeDtypeStruct(shape, jnp.dtype(model_cfg.dtype), sharding=sharding)
