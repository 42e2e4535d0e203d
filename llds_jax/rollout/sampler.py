"""Batched sampling with the KV cache under jit: prefill, chunked decode, turn rollback and observation extend.

A `Sampler` holds the jitted programs of one model architecture; `Sampler.start(params, prompts, rng)` opens a
`Session`, one batch of conversations living in a KV cache on device. The multi-turn agent drives a session:

  decode_turn(budgets, turn_finished,  samples each sequence's next turn. Decoding runs `decode_chunk` steps per
              on_finished)             device call (a `lax.while_loop`, no host round trip per token); between
                                       calls the host asks `turn_finished` (e.g. "the decoded text holds
                                       </search>") and stops those rows. A row also stops on a stop token (EOS)
                                       or when it has sampled its budget. `on_finished` hears of each row's
                                       final turn as soon as it is known, while the others still decode (the
                                       agent starts their searches there).
  end_turn(keep, observations)         keeps the first keep[i] sampled tokens of each row in the cache (later
                                       slots are marked invalid and rewritten: the roll back), then appends the
                                       observation tokens with `model.extend` (no re-encoding of the
                                       conversation). A row given no observation is finished and leaves the batch.

With `SamplingConfig.shared_prompt_prefill` a session's prefill encodes each distinct prompt once (at the row
bucket of the distinct prompts, letter U) and copies its cache and next-token logits to every row holding it: a
GRPO group's samples share their prompt, so the prefill's forward runs at 1/n of the rows. Each row keeps its own
PRNG stream, so the rows sample as they would from a prefill of every row.

For continuous batching (`llds_jax.rollout.continuous`), `Sampler.start_rows` opens a `RowSession` instead: a
device batch of rows that sequences enter and leave between any two decode chunks, each row on its own turn.
Its `extend` rolls back and extends just some rows (observations), or empties them and encodes new prompts there,
in calls of `kernels.extend_rows` (the rows gathered into a smaller batch, extended, scattered back; the other rows
untouched).

Shapes are bucketed (see `buckets`, and `shape_plan` for which bucket each call takes): rows to a power of two
(a multiple of the mesh's batch shards), prompt length, cache capacity and observation length to powers of two. The
cache grows to the next bucket only when a turn needs it, and when enough rows have finished the batch is compacted
to a smaller bucket, so early turns and small remaining batches attend over fewer slots and rows. With a mesh, rows
are split over (data, fsdp). After `Sampler.freeze_shapes()` (the trainer calls it after its first step,
`rollout.reuse_buckets`) a session takes the smallest bucket the sampler has already run that fits (more rows,
cache slots or observation slots than needed) instead of compiling a program for a new smaller one, and the first
call compiles ahead the grid of the buckets run so far (`Sampler.compile_grid`: every program at every combination
of their row, capacity and observation buckets): a run compiles its rollout programs in the first step, and later
only for a conversation that outgrows every capacity seen. Padding is masked, so the distributions are the same;
the logits may differ at float rounding (other reduction sizes).

The parts: the device programs (`kernels`), the sampler that jits them and lowers them ahead of time (here), a
session of turn-synchronous batches (`session.Session`) and one of continuous batching (`row_session.RowSession`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from llds_jax import parallel
from llds_jax.programs import AbstractProgram, CompilablePrograms, Role
from llds_jax.rollout import kernels
from llds_jax.rollout.config import SamplingConfig
from llds_jax.rollout.kernels import DecodeState
from llds_jax.rollout.row_session import RowSession
from llds_jax.rollout.session import Session
from llds_jax.rollout.shape_plan import (DecodeShape, EmptyShape, EndTurnShape, ExtendRowsShape, ForkShape,
                                          GrowShape, PrefillShape, SelectShape, Shape, ShapePlan)


@dataclasses.dataclass(frozen=True)
class SessionShapes:
    """What `Sampler.abstract_programs` lowers a session's programs at: one set of buckets and the parameters.

    Attributes:
      params: the parameters as a session gets them (arrays, or ShapeDtypeStructs with shardings).
      rows: rows of the session's batch.
      prompt: prompt slots of the prefill (or of a continuous batch's prompt extend).
      prefill_capacity: cache slots of the prefill.
      capacity: cache slots of the decode chunk, the extend, the growth (to) and the compaction.
      observation: observation slots of an extend.
      continuous: a continuous-batching `RowSession`'s programs rather than a `Session`'s.
      distinct: a prefill that encodes each distinct prompt once, at this many rows (0: every row;
        `SamplingConfig.shared_prompt_prefill`).
      fork_source: tree rollouts: rows of the batch a fork copies from, into a batch of `rows` rows (0: no fork).
    """

    params: object
    rows: int
    prompt: int
    prefill_capacity: int
    capacity: int
    observation: int
    continuous: bool = False
    distinct: int = 0
    fork_source: int = 0


class Sampler(CompilablePrograms[SessionShapes]):
    """The jitted prefill / decode / extend programs of one model architecture and sampling config, and the plan of
    their shapes (`plan`, a `ShapePlan`).

    Args:
      graphdef: from `graphdef, params = nnx.split(model)`; parameters are passed to `start` so that one sampler
        serves every training step without recompiling.
      config: a SamplingConfig.
      mesh: optional (data, fsdp, tensor) mesh; rows are split over data x fsdp. Parameters must already be
        placed on it (as `hf_io.load_model(path, mesh=mesh)` places them).
    """

    def __init__(self, graphdef, config: SamplingConfig, mesh: Optional[Mesh] = None):
        self.config = config
        self.mesh = mesh
        self.batch_multiple = 1 if mesh is None else parallel.axis_size(mesh, "batch")
        self.plan = ShapePlan(config, self.batch_multiple)
        self._prefill = jax.jit(functools.partial(kernels.prefill, graphdef), static_argnames="capacity")
        self._shared_prefill = jax.jit(functools.partial(kernels.shared_prefill, graphdef), static_argnames="capacity")
        self._decode = jax.jit(functools.partial(kernels.decode_chunk, graphdef, config), donate_argnums=1)
        self._end_turn = jax.jit(functools.partial(kernels.end_turn, graphdef), donate_argnums=1)
        self._grow = jax.jit(kernels.grow, static_argnums=1)
        self._select = jax.jit(kernels.select_rows)
        self._fork = jax.jit(functools.partial(kernels.fork_rows, graphdef))
        self._empty = jax.jit(functools.partial(kernels.empty, graphdef), static_argnames=("rows", "capacity"))
        self._extend_rows = jax.jit(functools.partial(kernels.extend_rows, graphdef), donate_argnums=1,
                                    static_argnames="prefill")
        self._params_spec = None  # the params as ShapeDtypeStructs, from the first decode chunk

    def freeze_shapes(self, grid: bool = True) -> int:
        """From now on sessions reuse buckets already run where one fits rather than compile smaller ones.

        With `grid`, the first call also compiles the bucket grid of what has run (`compile_grid`), so that later
        sessions find a program for every combination of those buckets. Returns the programs compiled (0 after
        the first call)."""
        if self.plan.frozen:
            return 0
        self.plan.freeze()
        return self.compile_grid() if grid else 0

    def compile_grid(self) -> int:
        """Compiles (ahead of time, without running them) the programs a session can need on the grid of the row
        and capacity buckets run so far (`ShapePlan.grid`; continuous batching: every compacted row bucket between
        the smallest run and its batch): decode and an extend of each observation bucket run so far at every (rows,
        capacity), growth to each larger capacity and compaction to each smaller row bucket. A frozen session then
        compiles only when a conversation outgrows every capacity run (or a batch every row bucket). Returns the
        number of programs compiled (0 before any decode chunk ran)."""
        if self._params_spec is None:
            return 0
        with self.mesh_context():
            return self.plan.compile_grid(functools.partial(self._lower, self._params_spec))

    def abstract_programs(self, at: SessionShapes) -> list[AbstractProgram]:
        """The programs of a session at abstract arguments of one set of buckets (`programs.CompilablePrograms`), for
        ahead-of-time compilation without devices: prefill of `at.prompt`-token prompts into a cache of
        `at.prefill_capacity` slots, then at `at.capacity` slots: a decode chunk, the extend of an
        `at.observation`-slot observation, the growth from capacity / 2 and the compaction to rows / 2 (when
        rows > 1); with `at.fork_source`, the fork of a tree rollout from that many rows into `at.rows`.

        With `at.continuous`, those of a continuous-batching `RowSession` instead: the empty batch and the extend of
        every row by a prompt (at `prefill_capacity` slots) in place of the prefill, the extend of every row by an
        observation in place of the session's extend (the most rows one such call takes: all, or
        `config.max_extend_rows`).
        """
        rows, prompt, prefill_capacity, capacity, observation = (
            at.rows, at.prompt, at.prefill_capacity, at.capacity, at.observation)
        if at.continuous:
            k = min(rows, self.config.max_extend_rows or rows)
            start = [(Role.EMPTY_BATCH, f"{rows} rows, {prefill_capacity} slots", EmptyShape(rows, prefill_capacity)),
                     (Role.PROMPT_EXTEND, f"{k} of {rows} rows x {prompt} tokens, {prefill_capacity} slots",
                      ExtendRowsShape(rows, prefill_capacity, k, prompt, True))]
            extend = (Role.ROW_EXTEND, f"{k} of {rows} rows x {observation} tokens, {capacity} slots",
                      ExtendRowsShape(rows, capacity, k, observation, False))
        else:
            distinct = f" ({at.distinct} distinct prompts)" if at.distinct else ""
            start = [(Role.PREFILL, f"{rows} x {prompt} tokens{distinct}, {prefill_capacity} slots",
                      PrefillShape(rows, prompt, prefill_capacity, at.distinct))]
            extend = (Role.EXTEND, f"{rows} x {observation} tokens, {capacity} slots",
                      EndTurnShape(rows, capacity, observation))
        programs = start + [
            (Role.DECODE_CHUNK, f"{rows} rows x {self.config.decode_chunk} steps, {capacity} slots",
             DecodeShape(rows, capacity)),
            extend,
            (Role.CACHE_GROWTH, f"{rows} rows, {capacity // 2} -> {capacity} slots",
             GrowShape(rows, capacity // 2, capacity)),
        ]
        if at.fork_source:
            programs.append((Role.FORK, f"{at.fork_source} -> {rows} rows, {capacity} slots",
                             ForkShape(at.fork_source, capacity, rows)))
        if rows > 1:
            smaller = self.plan.batch_rows(rows // 2)
            if smaller < rows:
                programs.append((Role.COMPACTION, f"{rows} -> {smaller} rows, {capacity} slots",
                                 SelectShape(rows, capacity, smaller)))
        with self.mesh_context():
            return [AbstractProgram(role, shapes, *self._abstract_call(at.params, shape), mesh=self.mesh)
                    for role, shapes, shape in programs]

    # -- the programs, each run at the shape of its arguments (recorded in `plan`) -----------------------------------

    def prefill(self, params, tokens_bt: np.ndarray, valid_bt: np.ndarray, rng: jax.Array, seq_ids_b: np.ndarray,
                capacity: int, source_b: Optional[np.ndarray] = None) -> DecodeState:
        """Encodes left-padded prompts (int32 tokens and bool valid [B, T], uint32 sequence ids [B] whose PRNG
        streams are fold_in(rng, id)) into an empty cache of `capacity` slots. With `source_b` (int32 [B]) the
        prompts are [U, T] distinct ones, encoded once each, and row b holds prompt source_b[b]."""
        if source_b is None:
            self.plan.record(PrefillShape(*tokens_bt.shape, capacity))
            return self._prefill(params, self.put(tokens_bt), self.put(valid_bt), rng, self.put(seq_ids_b),
                                 capacity=capacity)
        self.plan.record(PrefillShape(len(source_b), tokens_bt.shape[1], capacity, tokens_bt.shape[0]))
        return self._shared_prefill(params, self.put(tokens_bt), self.put(valid_bt), rng, self.put(seq_ids_b),
                                    self.put(source_b), capacity=capacity)

    def decode_chunk(self, params, state: DecodeState, stop_b: np.ndarray
                     ) -> tuple[DecodeState, jax.Array, jax.Array, jax.Array]:
        """Up to `config.decode_chunk` decode steps from `state` (donated); stop_b: bool [B], the rows the host has
        finished. Returns (state, tokens [B, C], log-probs [B, C], emitted [B, C]), see `kernels.decode_chunk`."""
        self.plan.record(DecodeShape(*state.cache.valid_bs.shape))
        if self._params_spec is None:  # for `compile_grid`
            self._params_spec = jax.tree.map(kernels.abstract_value, params)
        return self._decode(params, state, self.put(stop_b))

    def end_turn(self, params, state: DecodeState, end_b: np.ndarray, next_pos_b: np.ndarray, obs_bt: np.ndarray,
                 obs_valid_bt: np.ndarray) -> DecodeState:
        """Rolls each row of `state` (donated) back to its kept tokens (int32 cache end and next position [B]),
        then appends right-padded observations (int32 tokens and bool valid [B, T])."""
        self.plan.record(EndTurnShape(*state.cache.valid_bs.shape, obs_bt.shape[1]))
        put = self.put
        return self._end_turn(params, state, put(end_b), put(next_pos_b), put(obs_bt), put(obs_valid_bt))

    def empty(self, params, rng: jax.Array, rows: int, capacity: int) -> DecodeState:
        """A batch of `rows` empty rows of `capacity` slots, every row done (see `kernels.empty`)."""
        self.plan.record(EmptyShape(rows, capacity))
        return self._empty(params, rng, rows=rows, capacity=capacity)

    def extend_rows(self, params, state: DecodeState, rows_k: np.ndarray, end_k: np.ndarray, next_pos_k: np.ndarray,
                    tokens_kt: np.ndarray, valid_kt: np.ndarray, key_data_k: np.ndarray, prefill: bool
                    ) -> DecodeState:
        """Rolls rows rows_k (int32 [K]; the batch size: padding) of `state` (donated) back to (int32 cache end and
        next position [K]) and appends right-padded tokens (int32 and bool valid [K, T]); with `prefill` the rows
        start new sequences (prompts) with PRNG key data key_data_k (uint32 [K, ...]). See `kernels.extend_rows`."""
        self.plan.record(ExtendRowsShape(*state.cache.valid_bs.shape, *tokens_kt.shape, prefill))
        put = self.put
        return self._extend_rows(params, state, put(rows_k), put(end_k), put(next_pos_k), put(tokens_kt),
                                 put(valid_kt), put(key_data_k), prefill=prefill)

    def fork(self, params, state: DecodeState, source_k: np.ndarray, end_k: np.ndarray, next_pos_k: np.ndarray,
             tokens_k: np.ndarray, valid_k: np.ndarray, key_data_k: np.ndarray) -> DecodeState:
        """A new batch of K rows, row k a copy of row source_k[k] (int32 [K]) of `state` (kept) rolled back to the
        cache end end_k[k] - 1 and re-extended by tokens_k[k]; rows with valid_k False (bool [K]) carried as they
        are. Each samples with PRNG key data key_data_k[k] from count 0. See `kernels.fork_rows`."""
        self.plan.record(ForkShape(*state.cache.valid_bs.shape, len(source_k)))
        put = self.put
        return self._fork(params, state, put(source_k), put(end_k), put(next_pos_k), put(tokens_k), put(valid_k),
                          put(key_data_k))

    def sequence_keys(self, rng: jax.Array, first_sequence: int, n: int) -> jax.Array:
        """The PRNG keys [n] of sequences first_sequence .. first_sequence + n - 1 of `rng`: fold_in(rng, id), the
        keys `prefill` gives them (a session's sequence i has id first_sequence + i, see `start`)."""
        return self.keys_of(rng, np.arange(first_sequence, first_sequence + n, dtype=np.uint32))

    @staticmethod
    def keys_of(rng: jax.Array, ids_n: np.ndarray) -> jax.Array:
        """The PRNG keys [n] of the sequences with global ids ids_n (uint32 [n]): fold_in(rng, id)."""
        if not jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key):
            rng = jax.random.wrap_key_data(rng)
        return jax.vmap(lambda i: jax.random.fold_in(rng, i))(np.asarray(ids_n, np.uint32))

    def start_rows(self, params, prompts: Sequence[Sequence[int]], keys_n: jax.Array, rows: int,
                   first_turn: int) -> "RowSession":
        """Opens a continuous-batching session over `prompts`: at most `rows` sequences at a time, sequence i
        sampling from keys_n[i] (see `sequence_keys`), room for a first turn of `first_turn` tokens."""
        return RowSession(self, params, prompts, keys_n, rows, first_turn)

    def grow(self, state: DecodeState, capacity: int) -> DecodeState:
        """The same state with `capacity` cache slots (new slots empty)."""
        self.plan.record(GrowShape(*state.cache.valid_bs.shape, capacity))
        return self._grow(state, capacity)

    def select_rows(self, state: DecodeState, rows_b: np.ndarray) -> DecodeState:
        """The state of rows `rows_b` (int32 [B'], a smaller batch)."""
        self.plan.record(SelectShape(*state.cache.valid_bs.shape, len(rows_b)))
        return self._select(state, self.put(rows_b))

    # -- ahead-of-time lowering ------------------------------------------------------------------------------------

    def _lower(self, params, shape: Shape) -> jax.stages.Lowered:
        """The program of `shape` lowered at abstract arguments of that shape (`_abstract_call`)."""
        fn, args, kwargs = self._abstract_call(params, shape)
        return fn.lower(*args, **kwargs)

    def _abstract_call(self, params, shape: Shape) -> tuple[Callable, tuple, dict]:
        """The jitted program of `shape` and its abstract (positional, keyword) arguments of that shape, laid out as
        a session passes them."""
        host, r = self._host_spec, shape.rows
        key = jax.eval_shape(lambda: jax.random.key(0))
        if isinstance(shape, PrefillShape) and shape.distinct:
            u, t = shape.distinct, shape.prompt
            return (self._shared_prefill, (params, host(u, t), host(u, t, dtype=bool), key, host(r, dtype=np.uint32),
                                           host(r)), dict(capacity=shape.capacity))
        if isinstance(shape, PrefillShape):
            t = shape.prompt
            return (self._prefill, (params, host(r, t), host(r, t, dtype=bool), key, host(r, dtype=np.uint32)),
                    dict(capacity=shape.capacity))
        if isinstance(shape, EmptyShape):
            return self._empty, (params, key), dict(rows=r, capacity=shape.capacity)
        state = self._abstract_state(params, r, shape.capacity)
        if isinstance(shape, DecodeShape):
            return self._decode, (params, state, host(r, dtype=bool)), {}
        if isinstance(shape, EndTurnShape):
            t = shape.observation
            return self._end_turn, (params, state, host(r), host(r), host(r, t), host(r, t, dtype=bool)), {}
        if isinstance(shape, GrowShape):
            return self._grow, (state, shape.capacity_out), {}
        if isinstance(shape, ExtendRowsShape):
            k, t, key_shape = shape.rows_in, shape.tokens, jax.eval_shape(jax.random.key_data, state.key_b).shape[1:]
            return (self._extend_rows, (params, state, host(k), host(k), host(k), host(k, t), host(k, t, dtype=bool),
                                        host(k, *key_shape, dtype=np.uint32)), dict(prefill=shape.prefill))
        if isinstance(shape, ForkShape):
            k, key_shape = shape.rows_out, jax.eval_shape(jax.random.key_data, state.key_b).shape[1:]
            return (self._fork, (params, state, host(k), host(k), host(k), host(k), host(k, dtype=bool),
                                 host(k, *key_shape, dtype=np.uint32)), {})
        return self._select, (state, host(shape.rows_out)), {}

    def _abstract_state(self, params, rows: int, capacity: int) -> DecodeState:
        """The decode state of `rows` rows and `capacity` slots as ShapeDtypeStructs, laid out as the programs
        return it."""
        host = self._host_spec
        shapes = jax.eval_shape(functools.partial(self._prefill, capacity=capacity), params, host(rows, 1),
                                host(rows, 1, dtype=bool), jax.eval_shape(lambda: jax.random.key(0)),
                                host(rows, dtype=np.uint32))
        if self.mesh is None:
            return shapes
        return jax.tree.map(lambda a, spec: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(
            self.mesh, spec)), shapes, kernels.state_specs(shapes))

    def _host_spec(self, *shape: int, dtype=np.int32) -> jax.ShapeDtypeStruct:
        """The abstract value of `put(np.zeros(shape, dtype))`."""
        sharding = None if self.mesh is None else parallel.batch_sharding(self.mesh, len(shape))
        return jax.ShapeDtypeStruct(shape, np.dtype(dtype), sharding=sharding)

    # -- for sessions ----------------------------------------------------------------------------------------------

    def mesh_context(self):
        """`jax.set_mesh(mesh)`, or a null context without a mesh."""
        return contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh)

    def put(self, array: np.ndarray) -> jax.Array:
        """A host array on device, rows split over the mesh's batch axes."""
        if self.mesh is None:
            return jnp.asarray(array)
        return jax.device_put(array, parallel.batch_sharding(self.mesh, array.ndim))

    def start(self, params, prompts: Sequence[Sequence[int]], rng: jax.Array, first_sequence: int = 0,
              sequence_ids: Optional[Sequence[int]] = None, compact: bool = True) -> "Session":
        """Opens a session over `prompts` (token ids each). The prompts are encoded at the first decode_turn.

        rng: a PRNG key; sequence i samples from the stream fold_in(rng, first_sequence + i), so its tokens do not
        depend on which other sequences share the batch or how the batch is split over devices or sessions.
        first_sequence: the global index of the first prompt (e.g. this host's first row of a global batch, or
          a session's first row of a larger rollout), so that a split batch samples what the whole one would.
        sequence_ids: the global id of each prompt instead (uint32 [n]; a tree rollout's chains, `rollout.tree`).
        compact: False keeps every sequence's rows until the session ends, for `Session.fork`.
        """
        return Session(self, params, prompts, rng, first_sequence, sequence_ids, compact)

