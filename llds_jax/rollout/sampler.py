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
in calls of `_extend_rows` (the rows gathered into a smaller batch, extended, scattered back; the other rows
untouched).

Log-probs are those of the sampling distribution over the full vocabulary: log_softmax(logits / temperature) in
float32, what the learner recomputes. Top-k / top-p only restrict which tokens can be drawn; the log-probs are not
renormalized over the kept set. Greedy decoding reports temperature-1 log-probs.

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

`Session.timing` accumulates seconds: `prefill_s` (prompt prefill and observation extends, each waited for once
per turn), `decode_s` (decode chunk calls and the wait for their tokens) and `host_s` (the host callbacks between
chunks). No wait is added inside the decode loop: it fetches each chunk's tokens anyway. `Session.decode_counts`
counts the sampled tokens and the decode steps x batch rows (their ratio: the decode occupancy).

Dimension letters: B rows, U distinct prompts, T new tokens, C decode steps of one chunk, S cache slots, V
vocabulary, D hidden.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from llds_jax import parallel
from llds_jax.model import KVCache, init_cache
from llds_jax.programs import AbstractProgram
from llds_jax.rollout import buckets
from llds_jax.rollout.config import SamplingConfig
from llds_jax.rollout.interfaces import SampledTurn
from llds_jax.rollout.shape_plan import (DecodeShape, EmptyShape, EndTurnShape, ExtendRowsShape, GrowShape,
                                          PrefillShape, SelectShape, Shape, ShapePlan)


@flax.struct.dataclass
class DecodeState:
    """Device state of a session between calls.

    Attributes:
      cache: the KV cache.
      logits_bv: float32 logits of each row's next token.
      key_b: per-row PRNG keys; the key of a row's n-th sampled token is fold_in(key, n).
      count_b: int32 tokens sampled so far by each row (all turns, kept or not).
      remaining_b: int32 tokens each row may still sample in this turn.
      done_b: bool, the row samples no more in this turn.
    """

    cache: KVCache
    logits_bv: jax.Array
    key_b: jax.Array
    count_b: jax.Array
    remaining_b: jax.Array
    done_b: jax.Array


def sample_tokens(logits_bv: jax.Array, key_b: jax.Array, cfg: SamplingConfig) -> tuple[jax.Array, jax.Array]:
    """Draws one token per row. Returns (tokens int32 [B], log-probs float32 [B]).

    The log-prob is log_softmax(logits / temperature) over the full vocabulary at the drawn token (temperature 1
    when greedy); top-k and top-p only restrict the candidates.
    """
    # Each row's whole vocabulary on one device: left split over the vocabulary, XLA's CPU compiler partitions the
    # CDF's cumsum into a reduce-window over the whole vocabulary per output (O(V^2) per row). The rows are split
    # over every mesh axis, so that the chips of a tensor-parallel rollout each sort and draw a share of them
    # rather than all of them.
    logits_bv = parallel.constrain(logits_bv.astype(jnp.float32), "sampled_rows", None)
    if cfg.greedy:
        tokens_b = jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
        return _back_to_rows(tokens_b, _logp_of(jax.nn.log_softmax(logits_bv, axis=-1), tokens_b))
    scaled_bv = logits_bv / cfg.temperature
    logp_bv = jax.nn.log_softmax(scaled_bv, axis=-1)
    candidates_bk, index_bk = scaled_bv, None
    if cfg.top_k or cfg.top_p < 1:
        k = min(cfg.top_k or scaled_bv.shape[-1], scaled_bv.shape[-1])
        candidates_bk, index_bk = jax.lax.top_k(scaled_bv, k)  # sorted, most likely first
    if cfg.top_p < 1:
        probs_bk = jax.nn.softmax(candidates_bk, axis=-1)
        mass_before_bk = jnp.cumsum(probs_bk, axis=-1) - probs_bk
        candidates_bk = jnp.where(mass_before_bk < cfg.top_p, candidates_bk, -jnp.inf)
    choice_b = _inverse_cdf_draw(key_b, candidates_bk)
    tokens_b = choice_b if index_bk is None else jnp.take_along_axis(index_bk, choice_b[:, None], axis=1)[:, 0]
    return _back_to_rows(tokens_b, _logp_of(logp_bv, tokens_b))


def _back_to_rows(tokens_b: jax.Array, logp_b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The drawn tokens and their log-probs laid out as the decode state's rows (gathering B numbers), so that the
    sampling's layout does not spread to the rest of the decode step."""
    return parallel.constrain(tokens_b, "batch"), parallel.constrain(logp_b, "batch")


def _inverse_cdf_draw(key_b: jax.Array, logits_bk: jax.Array) -> jax.Array:
    """One categorical draw per row from softmax(logits_bk), by inverting the CDF with a single uniform per row.

    Gumbel-max (`jax.random.categorical`) needs K random numbers per row, which at a 152k vocabulary costs more
    than a decode step's forward pass; this needs one. -inf logits are never drawn.
    """
    cdf_bk = jnp.cumsum(jax.nn.softmax(logits_bk, axis=-1), axis=-1)
    u_b = 1.0 - jax.vmap(lambda key: jax.random.uniform(key, dtype=jnp.float32))(key_b)  # in (0, 1]
    below_bk = cdf_bk < (u_b * cdf_bk[:, -1])[:, None]
    return jnp.sum(below_bk, axis=-1, dtype=jnp.int32)


def _logp_of(logp_bv: jax.Array, tokens_b: jax.Array) -> jax.Array:
    return jnp.take_along_axis(logp_bv, tokens_b[:, None], axis=1)[:, 0]


_KV_SPEC = parallel.spec("layers", "batch", None, "kv_heads", None)  # [L, B, S, K, H]


def _rows_spec(ndim: int) -> P:
    return parallel.spec("batch", *([None] * (ndim - 1)))


def _cache_specs(cache: KVCache) -> KVCache:
    """The layout of each cache field: rows split as "batch", key/value heads as "kv_heads" (`parallel`)."""
    return KVCache(k_lbskh=_KV_SPEC, v_lbskh=_KV_SPEC, valid_bs=_rows_spec(2), end_b=_rows_spec(1),
                   next_pos_b=_rows_spec(1))


def _state_specs(state: DecodeState) -> DecodeState:
    """The layout of each decode-state field: every field split by rows (the cache as `_cache_specs`)."""
    rows = lambda a: _rows_spec(a.ndim)  # noqa: E731
    return DecodeState(cache=_cache_specs(state.cache), logits_bv=rows(state.logits_bv), key_b=rows(state.key_b),
                       count_b=rows(state.count_b), remaining_b=rows(state.remaining_b), done_b=rows(state.done_b))


def _constrain(tree, specs):
    return jax.tree.map(lambda a, spec: parallel.constrain_spec(a, spec), tree, specs,
                        is_leaf=lambda x: isinstance(x, P))


def _constrain_cache(cache: KVCache) -> KVCache:
    """The cache laid out as `_cache_specs` says (no-op without a mesh)."""
    return _constrain(cache, _cache_specs(cache))


def _constrain_state(state: DecodeState) -> DecodeState:
    """Every field of a decode state split by rows, so that each program returns the layout it was compiled for
    and feeding one program's output to the next never recompiles (no-op without a mesh)."""
    return _constrain(state, _state_specs(state))


def _last_logits(model, hidden_btd: jax.Array, valid_bt: jax.Array) -> jax.Array:
    """Float32 logits [B, V] at each row's last valid position (position 0 for a row with none)."""
    t = valid_bt.shape[1]
    last_b = jnp.max(jnp.where(valid_bt, jnp.arange(t, dtype=jnp.int32)[None, :], 0), axis=1)
    hidden_b1d = jnp.take_along_axis(hidden_btd, last_b[:, None, None], axis=1)
    return parallel.constrain(model.logits(hidden_b1d)[:, 0], "batch", None)


def _encode(model, tokens_bt, valid_bt, capacity: int) -> tuple[KVCache, jax.Array]:
    """Left-padded prompts [B, T] encoded into an empty cache of `capacity` slots: (cache, float32 logits [B, V]
    of each row's next token)."""
    cache = _constrain_cache(init_cache(model.cfg, tokens_bt.shape[0], capacity))
    hidden_btd, cache = model.extend(tokens_bt, valid_bt, cache, prefill=True)
    return cache, _last_logits(model, hidden_btd, valid_bt)


def _prefilled(cache: KVCache, logits_bv: jax.Array, rng, seq_ids_b) -> DecodeState:
    """The decode state of prompts encoded into `cache`, before the first turn; row b samples from the stream
    fold_in(rng, seq_ids_b[b])."""
    zeros_b = jnp.zeros(seq_ids_b.shape, jnp.int32)
    return _constrain_state(DecodeState(
        cache=cache, logits_bv=logits_bv, key_b=jax.vmap(lambda i: jax.random.fold_in(rng, i))(seq_ids_b),
        count_b=zeros_b, remaining_b=zeros_b, done_b=jnp.ones(seq_ids_b.shape, bool)))


def _prefill(graphdef, params, tokens_bt, valid_bt, rng, seq_ids_b, capacity: int) -> DecodeState:
    """Encodes left-padded prompts into an empty cache of `capacity` slots."""
    cache, logits_bv = _encode(nnx.merge(graphdef, params), tokens_bt, valid_bt, capacity)
    return _prefilled(cache, logits_bv, rng, seq_ids_b)


def _shared_prefill(graphdef, params, tokens_ut, valid_ut, rng, seq_ids_b, source_b, capacity: int) -> DecodeState:
    """`_prefill` of a batch whose row b holds distinct prompt source_b[b] (int32 [B] into the U left-padded
    prompts [U, T]): each distinct prompt is encoded once, then its cache and logits copied to its rows (one layer
    at a time: `_take_rows`)."""
    cache_u, logits_uv = _encode(nnx.merge(graphdef, params), tokens_ut, valid_ut, capacity)
    return _prefilled(_constrain_cache(_take_rows(cache_u, source_b)), _take(logits_uv, source_b), rng, seq_ids_b)


def _decode_chunk(graphdef, cfg: SamplingConfig, params, state: DecodeState, stop_b):
    """Up to `cfg.decode_chunk` decode steps; stops early once every row is done.

    Each step samples a token for every row not done, writes it into the cache (rows that are done write an
    invalid slot and do not advance) and computes the next logits. `stop_b` marks rows the host has finished.
    Returns (state, tokens [B, C], log-probs [B, C], emitted [B, C]: the row sampled at that step).
    """
    model = nnx.merge(graphdef, params)
    batch, steps = state.done_b.shape[0], cfg.decode_chunk
    stop_ids = jnp.asarray(cfg.stop_ids or (-1,), jnp.int32)

    def cond(carry):
        i, st = carry[0], carry[1]
        return (i < steps) & ~jnp.all(st.done_b)

    def body(carry):
        i, st, tokens_bc, logp_bc, emitted_bc = carry
        active_b = ~st.done_b
        keys_b = jax.vmap(jax.random.fold_in)(st.key_b, st.count_b)
        token_b, logp_b = sample_tokens(st.logits_bv, keys_b, cfg)
        hidden_btd, cache = model.extend(token_b[:, None], active_b[:, None], st.cache)
        remaining_b = st.remaining_b - active_b
        hit_stop_b = jnp.any(token_b[:, None] == stop_ids[None, :], axis=1)
        st = DecodeState(cache=_constrain_cache(cache), logits_bv=model.logits(hidden_btd)[:, 0], key_b=st.key_b,
                         count_b=st.count_b + active_b, remaining_b=remaining_b,
                         done_b=st.done_b | (active_b & (hit_stop_b | (remaining_b <= 0))))
        tokens_bc = tokens_bc.at[:, i].set(jnp.where(active_b, token_b, 0))
        logp_bc = logp_bc.at[:, i].set(jnp.where(active_b, logp_b, 0.0))
        emitted_bc = emitted_bc.at[:, i].set(active_b)
        return i + 1, st, tokens_bc, logp_bc, emitted_bc

    state = state.replace(done_b=state.done_b | stop_b)
    init = (jnp.int32(0), state, jnp.zeros((batch, steps), jnp.int32), jnp.zeros((batch, steps), jnp.float32),
            jnp.zeros((batch, steps), bool))
    _, state, tokens_bc, logp_bc, emitted_bc = jax.lax.while_loop(cond, body, init)
    return _constrain_state(state), tokens_bc, logp_bc, emitted_bc


def _end_turn(graphdef, params, state: DecodeState, end_b, next_pos_b, obs_bt, obs_valid_bt) -> DecodeState:
    """Rolls each row back to its kept tokens (end_b, next_pos_b), then appends right-padded observations."""
    model = nnx.merge(graphdef, params)
    cache = state.cache
    slots_s = jnp.arange(cache.capacity, dtype=jnp.int32)
    cache = cache.replace(valid_bs=cache.valid_bs & (slots_s[None, :] < end_b[:, None]), end_b=end_b,
                          next_pos_b=next_pos_b)
    hidden_btd, cache = model.extend(obs_bt, obs_valid_bt, cache)
    return _constrain_state(state.replace(cache=cache, logits_bv=_last_logits(model, hidden_btd, obs_valid_bt)))


def _empty(graphdef, params, rng, rows: int, capacity: int) -> DecodeState:
    """A batch of `rows` empty rows of `capacity` slots, every row done (continuous batching fills them with
    `_extend_rows`; their keys are placeholders until then)."""
    model = nnx.merge(graphdef, params)
    zeros_b = jnp.zeros((rows,), jnp.int32)
    return _constrain_state(DecodeState(
        cache=_constrain_cache(init_cache(model.cfg, rows, capacity)),
        logits_bv=jnp.zeros((rows, model.cfg.vocab_size), jnp.float32),
        key_b=jax.vmap(lambda i: jax.random.fold_in(rng, i))(jnp.arange(rows, dtype=jnp.uint32)), count_b=zeros_b,
        remaining_b=zeros_b, done_b=jnp.ones((rows,), bool)))


def _extend_rows(graphdef, params, state: DecodeState, rows_k, end_k, next_pos_k, tokens_kt, valid_kt, key_data_k,
                 prefill: bool) -> DecodeState:
    """Rolls rows `rows_k` back to (end_k, next_pos_k) and appends right-padded tokens to them; the other rows'
    cache, logits and decode state are untouched.

    prefill (static): the rows start new sequences, their tokens are prompts: the caller gives end 0 and position
    0 (the rows are emptied), attention runs over the prompts alone (as `_prefill`), the sampled-token counts are
    set to 0 and the PRNG keys to `key_data_k` (uint32 [K, ...], `jax.random.key_data`; ignored otherwise).
    Padding entries of rows_k hold the batch size (dropped); they need one valid token.
    """
    model = nnx.merge(graphdef, params)
    cache = state.cache
    take = lambda a, axis=0: jnp.take(a, rows_k, axis=axis, mode="clip")  # noqa: E731
    put = lambda a, new, axis=0: a.at[(slice(None),) * axis + (rows_k,)].set(new, mode="drop")  # noqa: E731
    slots_s = jnp.arange(cache.capacity, dtype=jnp.int32)
    rows = KVCache(k_lbskh=take(cache.k_lbskh, 1), v_lbskh=take(cache.v_lbskh, 1),
                   valid_bs=take(cache.valid_bs) & (slots_s[None, :] < end_k[:, None]), end_b=end_k,
                   next_pos_b=next_pos_k)
    hidden_ktd, rows = model.extend(tokens_kt, valid_kt, rows, prefill=prefill)
    cache = KVCache(k_lbskh=put(cache.k_lbskh, rows.k_lbskh, 1), v_lbskh=put(cache.v_lbskh, rows.v_lbskh, 1),
                    valid_bs=put(cache.valid_bs, rows.valid_bs), end_b=put(cache.end_b, rows.end_b),
                    next_pos_b=put(cache.next_pos_b, rows.next_pos_b))
    state = state.replace(cache=cache, logits_bv=put(state.logits_bv, _last_logits(model, hidden_ktd, valid_kt)))
    if prefill:
        key_data_b = put(jax.random.key_data(state.key_b), key_data_k)
        state = state.replace(key_b=jax.random.wrap_key_data(key_data_b, impl=jax.random.key_impl(state.key_b)),
                              count_b=put(state.count_b, jnp.zeros_like(end_k)))
    return _constrain_state(state)


def _grow(state: DecodeState, capacity: int) -> DecodeState:
    """The same state with `capacity` cache slots (new slots empty)."""
    cache = state.cache
    extra = capacity - cache.capacity
    pad = lambda a, axis: jnp.pad(a, [(0, extra if d == axis else 0) for d in range(a.ndim)])
    cache = cache.replace(k_lbskh=pad(cache.k_lbskh, 2), v_lbskh=pad(cache.v_lbskh, 2),
                          valid_bs=pad(cache.valid_bs, 1))
    return _constrain_state(state.replace(cache=cache))


def _spec(array: jax.Array) -> jax.ShapeDtypeStruct:
    """The abstract value a jitted call sees for `array` (its sharding only when committed to one)."""
    return jax.ShapeDtypeStruct(array.shape, array.dtype, sharding=array.sharding if array.committed else None)


def _take_rows(cache: KVCache, rows_b) -> KVCache:
    """The cache of rows `rows_b` (int32 [B'], any rows, repeated or not). Keys and values are taken one layer at a
    time (a loop over L), so the program holds one layer's rows beside its output rather than a copy of the whole
    cache."""
    take = functools.partial(_take, rows_b=rows_b)
    take_layers = lambda a_l: jax.lax.map(take, a_l)  # noqa: E731
    return KVCache(k_lbskh=take_layers(cache.k_lbskh), v_lbskh=take_layers(cache.v_lbskh),
                   valid_bs=take(cache.valid_bs), end_b=take(cache.end_b), next_pos_b=take(cache.next_pos_b))


def _take(a: jax.Array, rows_b) -> jax.Array:
    """Rows `rows_b` of `a` (its first axis)."""
    return jnp.take(a, rows_b, axis=0)


def _select_rows(state: DecodeState, rows_b) -> DecodeState:
    """The state of rows `rows_b` (a smaller batch), the cache taken as `_take_rows` takes it."""
    take = functools.partial(_take, rows_b=rows_b)
    return _constrain_state(DecodeState(cache=_take_rows(state.cache, rows_b), logits_bv=take(state.logits_bv),
                                        key_b=take(state.key_b), count_b=take(state.count_b),
                                        remaining_b=take(state.remaining_b), done_b=take(state.done_b)))


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
    """

    params: object
    rows: int
    prompt: int
    prefill_capacity: int
    capacity: int
    observation: int
    continuous: bool = False
    distinct: int = 0


def _left_padded(prompts: Sequence[Sequence[int]], rows: int, slots: int) -> tuple[np.ndarray, np.ndarray]:
    """Prompts left-padded into int32 tokens and bool valid [rows, slots]; rows past the prompts hold one token, so
    that attention never sees an empty row."""
    tokens_bt = np.zeros((rows, slots), np.int32)
    valid_bt = np.zeros((rows, slots), bool)
    valid_bt[len(prompts):, -1] = True
    for i, prompt in enumerate(prompts):
        tokens_bt[i, slots - len(prompt):] = prompt
        valid_bt[i, slots - len(prompt):] = True
    return tokens_bt, valid_bt


class Sampler:
    """The jitted prefill / decode / extend programs of one model architecture and sampling config, and the plan of
    their shapes (`plan`, a `ShapePlan`).

    Args:
      graphdef: from `graphdef, params = nnx.split(model)`; parameters are passed to `start` so that one sampler
        serves every training step without recompiling.
      config: a SamplingConfig.
      mesh: optional (data, fsdp, tensor) mesh; rows are split over data x fsdp. Parameters must already be
        placed on it (`parallel.shard_model`).
    """

    def __init__(self, graphdef, config: SamplingConfig, mesh: Optional[Mesh] = None):
        self.config = config
        self.mesh = mesh
        self.batch_multiple = 1 if mesh is None else parallel.axis_size(mesh, "batch")
        self.plan = ShapePlan(config, self.batch_multiple)
        self._prefill = jax.jit(functools.partial(_prefill, graphdef), static_argnames="capacity")
        self._shared_prefill = jax.jit(functools.partial(_shared_prefill, graphdef), static_argnames="capacity")
        self._decode = jax.jit(functools.partial(_decode_chunk, graphdef, config), donate_argnums=1)
        self._end_turn = jax.jit(functools.partial(_end_turn, graphdef), donate_argnums=1)
        self._grow = jax.jit(_grow, static_argnums=1)
        self._select = jax.jit(_select_rows)
        self._empty = jax.jit(functools.partial(_empty, graphdef), static_argnames=("rows", "capacity"))
        self._extend_rows = jax.jit(functools.partial(_extend_rows, graphdef), donate_argnums=1,
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
        rows > 1).

        With `at.continuous`, those of a continuous-batching `RowSession` instead: the empty batch and the extend of
        every row by a prompt (at `prefill_capacity` slots) in place of the prefill, the extend of every row by an
        observation in place of the session's extend (the most rows one such call takes: all, or
        `config.max_extend_rows`).
        """
        rows, prompt, prefill_capacity, capacity, observation = (
            at.rows, at.prompt, at.prefill_capacity, at.capacity, at.observation)
        if at.continuous:
            k = min(rows, self.config.max_extend_rows or rows)
            start = [("empty batch", f"{rows} rows, {prefill_capacity} slots", EmptyShape(rows, prefill_capacity)),
                     ("prompt extend", f"{k} of {rows} rows x {prompt} tokens, {prefill_capacity} slots",
                      ExtendRowsShape(rows, prefill_capacity, k, prompt, True))]
            extend = ("row extend", f"{k} of {rows} rows x {observation} tokens, {capacity} slots",
                      ExtendRowsShape(rows, capacity, k, observation, False))
        else:
            distinct = f" ({at.distinct} distinct prompts)" if at.distinct else ""
            start = [("prefill", f"{rows} x {prompt} tokens{distinct}, {prefill_capacity} slots",
                      PrefillShape(rows, prompt, prefill_capacity, at.distinct))]
            extend = ("extend", f"{rows} x {observation} tokens, {capacity} slots",
                      EndTurnShape(rows, capacity, observation))
        programs = start + [
            ("decode chunk", f"{rows} rows x {self.config.decode_chunk} steps, {capacity} slots",
             DecodeShape(rows, capacity)),
            extend,
            ("cache growth", f"{rows} rows, {capacity // 2} -> {capacity} slots",
             GrowShape(rows, capacity // 2, capacity)),
        ]
        if rows > 1:
            smaller = self.plan.batch_rows(rows // 2)
            if smaller < rows:
                programs.append(("compaction", f"{rows} -> {smaller} rows, {capacity} slots",
                                 SelectShape(rows, capacity, smaller)))
        with self.mesh_context():
            return [AbstractProgram(name, shapes, *self._abstract_call(at.params, shape), mesh=self.mesh)
                    for name, shapes, shape in programs]

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
        finished. Returns (state, tokens [B, C], log-probs [B, C], emitted [B, C]), see `_decode_chunk`."""
        self.plan.record(DecodeShape(*state.cache.valid_bs.shape))
        if self._params_spec is None:  # for `compile_grid`
            self._params_spec = jax.tree.map(_spec, params)
        return self._decode(params, state, self.put(stop_b))

    def end_turn(self, params, state: DecodeState, end_b: np.ndarray, next_pos_b: np.ndarray, obs_bt: np.ndarray,
                 obs_valid_bt: np.ndarray) -> DecodeState:
        """Rolls each row of `state` (donated) back to its kept tokens (int32 cache end and next position [B]),
        then appends right-padded observations (int32 tokens and bool valid [B, T])."""
        self.plan.record(EndTurnShape(*state.cache.valid_bs.shape, obs_bt.shape[1]))
        put = self.put
        return self._end_turn(params, state, put(end_b), put(next_pos_b), put(obs_bt), put(obs_valid_bt))

    def empty(self, params, rng: jax.Array, rows: int, capacity: int) -> DecodeState:
        """A batch of `rows` empty rows of `capacity` slots, every row done (see `_empty`)."""
        self.plan.record(EmptyShape(rows, capacity))
        return self._empty(params, rng, rows=rows, capacity=capacity)

    def extend_rows(self, params, state: DecodeState, rows_k: np.ndarray, end_k: np.ndarray, next_pos_k: np.ndarray,
                    tokens_kt: np.ndarray, valid_kt: np.ndarray, key_data_k: np.ndarray, prefill: bool
                    ) -> DecodeState:
        """Rolls rows rows_k (int32 [K]; the batch size: padding) of `state` (donated) back to (int32 cache end and
        next position [K]) and appends right-padded tokens (int32 and bool valid [K, T]); with `prefill` the rows
        start new sequences (prompts) with PRNG key data key_data_k (uint32 [K, ...]). See `_extend_rows`."""
        self.plan.record(ExtendRowsShape(*state.cache.valid_bs.shape, *tokens_kt.shape, prefill))
        put = self.put
        return self._extend_rows(params, state, put(rows_k), put(end_k), put(next_pos_k), put(tokens_kt),
                                 put(valid_kt), put(key_data_k), prefill=prefill)

    def sequence_keys(self, rng: jax.Array, first_sequence: int, n: int) -> jax.Array:
        """The PRNG keys [n] of sequences first_sequence .. first_sequence + n - 1 of `rng`: fold_in(rng, id), the
        keys `prefill` gives them (a session's sequence i has id first_sequence + i, see `start`)."""
        if not jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key):
            rng = jax.random.wrap_key_data(rng)
        ids_n = np.arange(first_sequence, first_sequence + n, dtype=np.uint32)
        return jax.vmap(lambda i: jax.random.fold_in(rng, i))(ids_n)

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
            self.mesh, spec)), shapes, _state_specs(shapes))

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

    def start(self, params, prompts: Sequence[Sequence[int]], rng: jax.Array,
              first_sequence: int = 0) -> "Session":
        """Opens a session over `prompts` (token ids each). The prompts are encoded at the first decode_turn.

        rng: a PRNG key; sequence i samples from the stream fold_in(rng, first_sequence + i), so its tokens do not
        depend on which other sequences share the batch or how the batch is split over devices or sessions.
        first_sequence: the global index of the first prompt (e.g. this host's first row of a global batch, or
          a session's first row of a larger rollout), so that a split batch samples what the whole one would.
        """
        return Session(self, params, prompts, rng, first_sequence)


class _DeviceBatch:
    """What both kinds of session share: the decode state of a batch of rows on device, its growth, the decode
    chunk calls with their timing, and the count of decode-row occupancy.

    Attributes:
      timing: seconds, see the module docstring.
      decode_counts: "sampled_tokens" (tokens the rows sampled) and "row_steps" (decode steps run x batch rows);
        their ratio is the decode occupancy, the share of decode rows doing real work.
    """

    def __init__(self, sampler: Sampler, params, prompts: Sequence[Sequence[int]]):
        if not prompts:
            raise ValueError("Session: no prompts")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("Session: every prompt needs at least one token")
        self._sampler = sampler
        self._cfg = sampler.config
        self._params = params
        self._prompts = [list(map(int, p)) for p in prompts]
        self._state: Optional[DecodeState] = None
        self.timing = {"prefill_s": 0.0, "decode_s": 0.0, "host_s": 0.0}
        self.decode_counts = {"sampled_tokens": 0, "row_steps": 0}

    @property
    def num_sequences(self) -> int:
        return len(self._prompts)

    @property
    def capacity(self) -> int:
        """Cache slots per row, 0 before the first turn."""
        return 0 if self._state is None else self._state.cache.capacity

    def _rows(self) -> int:
        return 0 if self._state is None else self._state.done_b.shape[0]

    def _ensure_capacity(self, needed: int) -> None:
        """Grows the cache, to the capacity the plan gives, when a row needs more than its `capacity` slots."""
        grown = self._sampler.plan.grown_capacity(self._rows(), self.capacity, needed)
        if grown > self.capacity:
            self._state = self._sampler.grow(self._state, grown)

    def _decode_chunk(self, stop_b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """One decode chunk call (stop_b: bool [B], rows the host finished); returns its tokens, log-probs and
        emitted flags [B, C] and the rows done after it [B], on the host. Counts decode_s and decode_counts."""
        start = time.perf_counter()
        self._state, tokens_bc, logp_bc, emitted_bc = self._sampler.decode_chunk(self._params, self._state, stop_b)
        tokens_bc, logp_bc, emitted_bc, done_b = jax.device_get((tokens_bc, logp_bc, emitted_bc, self._state.done_b))
        self.timing["decode_s"] += time.perf_counter() - start
        # Every step that ran emitted a token on some row (the loop stops once all rows are done).
        self.decode_counts["sampled_tokens"] += int(emitted_bc.sum())
        self.decode_counts["row_steps"] += int(emitted_bc.any(axis=0).sum()) * emitted_bc.shape[0]
        return tokens_bc, logp_bc, emitted_bc, done_b


class Session(_DeviceBatch):
    """One batch of conversations in the KV cache. Sequences are indexed 0..n-1 in `prompts` order; sequence i
    samples with the global id first_sequence + i (see `Sampler.start`)."""

    def __init__(self, sampler: Sampler, params, prompts: Sequence[Sequence[int]], rng: jax.Array,
                 first_sequence: int = 0):
        super().__init__(sampler, params, prompts)
        if first_sequence < 0:
            raise ValueError(f"Session: first_sequence must be >= 0, got {first_sequence}")
        if not jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key):
            rng = jax.random.wrap_key_data(rng)
        self._rng = rng
        self._first_sequence = first_sequence
        n = len(prompts)
        self._alive = np.ones(n, bool)
        # Host mirrors, per sequence: the cache slot the sequence writes to next and its next RoPE position.
        self._end = np.zeros(n, np.int64)
        self._pos = np.array([len(p) for p in self._prompts], np.int64)
        self._turn_start_end = np.zeros(n, np.int64)
        self._turn_start_pos = np.zeros(n, np.int64)
        self._slot_of = np.full(n, -1, np.int64)  # the batch row holding each sequence (-1: none)
        self._seq_of: np.ndarray = np.zeros(0, np.int64)  # the sequence in each batch row (-1: padding)

    @property
    def batch_rows(self) -> int:
        """Rows of the device batch (a bucket), 0 before the first turn."""
        return len(self._seq_of)

    def decode_turn(self, budgets: Sequence[int],
                    turn_finished: Callable[[list[list[int]]], list[bool]],
                    on_finished: Optional[Callable[[list[int], list[SampledTurn]], None]] = None
                    ) -> list[SampledTurn]:
        """Samples one turn for every sequence with budget > 0 (at most budgets[i] tokens each).

        A row stops at a stop token, at its budget, or once `turn_finished` (called between decode chunks with
        the token lists of the rows still sampling) says its turn is over; tokens of the chunk in which that
        happens come back too (the caller cuts them). Finished sequences must get budget 0.
        `on_finished(sequences, turns)`, when given, is called after each decode chunk in which some sequences'
        turns ended, with those sequences (ascending) and their final SampledTurns, while the other rows go on
        decoding; every sequence with budget > 0 is reported exactly once.
        Returns one SampledTurn per sequence (empty for budget 0).
        """
        budgets_n = np.asarray(budgets, np.int64)
        if budgets_n.shape != (self.num_sequences,) or (budgets_n < 0).any():
            raise ValueError(f"decode_turn: need {self.num_sequences} budgets >= 0, got {list(budgets)}")
        if (budgets_n[~self._alive] > 0).any():
            raise ValueError("decode_turn: a finished sequence was given a budget > 0")
        turns = [SampledTurn([], [], False) for _ in range(self.num_sequences)]
        with self._sampler.mesh_context():
            if budgets_n.any():
                self._start(int(budgets_n.max()))
                self._compact()
                # + 1: a row that is done still writes one (invalid) slot per decode step at its end.
                self._ensure_capacity(int(np.max(self._end + budgets_n + 1)))
            self._turn_start_end, self._turn_start_pos = self._end.copy(), self._pos.copy()
            if budgets_n.any():
                self._run_turn(budgets_n, turn_finished, on_finished, turns)
        return turns

    def end_turn(self, keep: Sequence[int], observations: Sequence[Optional[Sequence[int]]]) -> None:
        """Keeps the first keep[i] tokens of sequence i's last turn and appends observations[i] after them.

        Sampled tokens after the kept ones are rolled back (their cache slots become invalid and are
        rewritten). observations[i] None finishes sequence i (it leaves the batch); otherwise it must hold at
        least one token, whose logits give the next turn's first token.
        """
        n = self.num_sequences
        keep_n = np.asarray(keep, np.int64)
        sampled_n = self._end - self._turn_start_end
        if keep_n.shape != (n,) or len(observations) != n:
            raise ValueError(f"end_turn: need {n} keep counts and {n} observations")
        if (keep_n < 0).any() or (keep_n > sampled_n).any():
            raise ValueError(f"end_turn: keep must be in [0, sampled tokens]; keep={keep_n.tolist()}, sampled="
                             f"{sampled_n.tolist()}")
        for i, obs in enumerate(observations):
            if obs is None:
                self._alive[i] = False
            elif not self._alive[i]:
                raise ValueError(f"end_turn: sequence {i} is finished and cannot take an observation")
            elif not len(obs):
                raise ValueError(f"end_turn: sequence {i} continues with an empty observation (give None to "
                                 "finish it)")
        self._end, self._pos = self._turn_start_end + keep_n, self._turn_start_pos + keep_n
        obs_len = np.array([len(o) if o is not None else 0 for o in observations], np.int64)
        if not obs_len.any():
            return
        with self._sampler.mesh_context():
            self._start(0)
            rows, end = self.batch_rows, int(self._end[obs_len > 0].max())
            t = self._sampler.plan.end_turn(rows, self.capacity, int(obs_len.max()), end).observation
            self._ensure_capacity(end + t)
            obs_bt = np.zeros((rows, t), np.int32)
            valid_bt = np.zeros((rows, t), bool)
            end_b = np.zeros(rows, np.int32)
            pos_b = np.zeros(rows, np.int32)
            for row, seq in enumerate(self._seq_of):
                if seq < 0:
                    continue
                end_b[row], pos_b[row] = self._end[seq], self._pos[seq]
                if obs_len[seq]:
                    obs_bt[row, :obs_len[seq]] = observations[seq]
                    valid_bt[row, :obs_len[seq]] = True
            start = time.perf_counter()
            self._state = self._sampler.end_turn(self._params, self._state, end_b, pos_b, obs_bt, valid_bt)
            self._state.logits_bv.block_until_ready()  # once per turn: times the extend apart from decoding
            self.timing["prefill_s"] += time.perf_counter() - start
        self._end += obs_len
        self._pos += obs_len

    # -- internals -------------------------------------------------------------------------------------------

    def _start(self, max_budget: int) -> None:
        """Encodes the prompts (once), into a cache with room for a first turn of `max_budget` tokens."""
        if self._state is not None:
            return
        n = self.num_sequences
        distinct: dict[tuple[int, ...], int] = {}  # prompt -> its index among the distinct ones
        source = ([distinct.setdefault(tuple(prompt), len(distinct)) for prompt in self._prompts]
                  if self._cfg.shared_prompt_prefill else [])
        shape = self._sampler.plan.prefill(n, max(len(x) for x in self._prompts), max_budget, len(distinct))
        rows, p = shape.rows, shape.prompt
        seq_ids_b = np.arange(self._first_sequence, self._first_sequence + rows, dtype=np.uint32)
        if shape.distinct:  # padding rows take the first prompt
            tokens_bt, valid_bt = _left_padded(list(distinct), shape.distinct, p)
            source_b = np.zeros(rows, np.int32)
            source_b[:n] = source
        else:
            tokens_bt, valid_bt = _left_padded(self._prompts, rows, p)
            source_b = None
        start = time.perf_counter()
        self._state = self._sampler.prefill(self._params, tokens_bt, valid_bt, self._rng, seq_ids_b, shape.capacity,
                                            source_b)
        self._state.logits_bv.block_until_ready()  # once per session: times the prefill apart from decoding
        self.timing["prefill_s"] += time.perf_counter() - start
        self._seq_of = np.concatenate([np.arange(n), np.full(rows - n, -1)])
        self._slot_of = np.arange(n)
        self._end[:] = p

    def _compact(self) -> None:
        """Moves the unfinished sequences into a smaller batch bucket when the plan has one for them."""
        live = np.flatnonzero(self._alive)
        compaction = self._sampler.plan.compaction(self.batch_rows, self.capacity, len(live))
        if compaction is None:
            return
        rows = compaction.rows_out
        take = np.concatenate([self._slot_of[live], np.full(rows - len(live), self._slot_of[live[0]])])
        self._state = self._sampler.select_rows(self._state, take.astype(np.int32))
        self._seq_of = np.concatenate([live, np.full(rows - len(live), -1)])
        self._slot_of[:] = -1
        self._slot_of[live] = np.arange(len(live))

    def _row_array(self, per_sequence: np.ndarray, dtype) -> np.ndarray:
        out = np.zeros(len(self._seq_of), dtype)
        real = self._seq_of >= 0
        out[real] = per_sequence[self._seq_of[real]]
        return out

    def _run_turn(self, budgets_n: np.ndarray, turn_finished, on_finished, turns: list[SampledTurn]) -> None:
        put = self._sampler.put
        stop_set = set(self._cfg.stop_ids)
        remaining_b = self._row_array(budgets_n, np.int32)
        self._state = self._state.replace(remaining_b=put(remaining_b), done_b=put(remaining_b <= 0))
        rows = len(self._seq_of)
        running_b = remaining_b > 0  # host view: rows still sampling this turn
        stop_b = np.zeros(rows, bool)
        while running_b.any():
            tokens_bc, logp_bc, emitted_bc, done_b = self._decode_chunk(stop_b)
            host_start = time.perf_counter()
            for row in np.flatnonzero(emitted_bc.any(axis=1)):
                turn = turns[self._seq_of[row]]
                emitted = emitted_bc[row]
                turn.token_ids.extend(tokens_bc[row, emitted].tolist())
                turn.logps.extend(logp_bc[row, emitted].tolist())
            ended_b = running_b & done_b
            running_b &= ~done_b
            check = np.flatnonzero(running_b)
            stop_b = np.zeros(rows, bool)
            if check.size:
                finished = turn_finished([turns[self._seq_of[row]].token_ids for row in check])
                stop_b[check[np.asarray(finished, bool)]] = True
                running_b &= ~stop_b
            ended = np.sort(self._seq_of[ended_b | stop_b])
            for seq in ended:
                turns[seq] = _with_hit_stop(turns[seq], stop_set)
            if on_finished is not None and ended.size:
                on_finished(ended.tolist(), [turns[seq] for seq in ended])
            self.timing["host_s"] += time.perf_counter() - host_start
        for seq, turn in enumerate(turns):
            n_tok = len(turn.token_ids)
            self._end[seq] += n_tok
            self._pos[seq] += n_tok
            turns[seq] = _with_hit_stop(turn, stop_set)


class RowSession(_DeviceBatch):
    """Continuous batching: a device batch of `rows` rows that sequences enter and leave between any two decode
    chunks, each row on its own turn. Sequences are indexed 0..n-1 in `prompts` order; sequence i samples its n-th
    token with fold_in(key_i, n), key_i = keys_n[i] (see `Sampler.sequence_keys`), whichever row it
    takes: the tokens a sequence samples do not depend on when or where it runs.

    The caller drives it between chunks: `extend` (observations after rolled-back turns, and new sequences'
    prompts, one device call over just those rows), `finish` (a sequence leaves its row), `begin_turn` (a sequence
    samples its next turn), `decode_chunk` (one chunk of every row on its turn; rows that are not are done in it)
    and `compact` (once no sequence waits for a row: the live rows into a smaller row bucket, a power of two or
    1.5x one: `ShapePlan.compacted_rows`).

    Args:
      sampler: the Sampler.
      params: the policy parameters.
      prompts: token ids of each sequence.
      keys_n: PRNG keys [n], each sequence's stream.
      rows: sequences at a time (the batch is bucketed as the plan says).
      first_turn: the longest first turn, for the first cache capacity.
    """

    def __init__(self, sampler: Sampler, params, prompts: Sequence[Sequence[int]], keys_n: jax.Array, rows: int,
                 first_turn: int):
        super().__init__(sampler, params, prompts)
        if keys_n.shape != (self.num_sequences,):
            raise ValueError(f"RowSession: need {self.num_sequences} keys, got shape {keys_n.shape}")
        self._rng = keys_n[0]  # the empty batch's placeholder keys
        self._key_data_n = np.asarray(jax.random.key_data(keys_n))
        self._first_turn = first_turn
        self._slot_of = np.full(self.num_sequences, -1, np.int64)  # the row of each sequence (-1: none)
        self._batch = min(rows, self.num_sequences)
        # Host mirrors, per row: the sequence (-1: free), the next cache slot and RoPE position, where the current
        # turn started, the tokens it may still sample and whether it samples this turn; the turn's tokens.
        self._seq_of = self._end = self._pos = self._turn_end = self._turn_pos = self._remaining = np.zeros(0, np.int64)
        self._decoding = np.zeros(0, bool)
        self._turn: list[SampledTurn] = []  # set for every row by `_start`

    @property
    def batch_rows(self) -> int:
        """Rows of the device batch (a bucket), 0 before the first extend."""
        return len(self._seq_of)

    @property
    def free_rows(self) -> int:
        """Rows that can take a sequence now (all `rows` before the first extend)."""
        return int((self._seq_of < 0).sum()) if self._state is not None else self._batch

    @property
    def decoding(self) -> int:
        """Rows on their turn."""
        return int(self._decoding.sum())

    def finish(self, seq: int) -> None:
        """Sequence `seq` is over: its row is free."""
        row = self._row(seq)
        self._seq_of[row], self._slot_of[seq], self._decoding[row] = -1, -1, False

    def extend(self, observations: dict[int, tuple[int, Sequence[int]]], admit: Sequence[int]) -> None:
        """Sequence s of `observations` (s -> (keep, observation ids)) keeps the first `keep` tokens of its last
        turn and gets the observation after them (one device call; frozen, a few when they are more rows than
        any such call ran); each sequence of `admit` takes a free row and its prompt is encoded there (likewise,
        a prefill of those rows: prompts and observations have buckets of their own). The other rows are
        untouched."""
        if len(admit) > self.free_rows:
            raise ValueError(f"RowSession.extend: {len(admit)} sequences for {self.free_rows} free rows")
        with self._sampler.mesh_context():
            if self._state is None:
                self._start()
            free = list(np.flatnonzero(self._seq_of < 0))
            if observations:
                rows_k = np.array([self._row(seq) for seq in sorted(observations)])
                keep_k = np.array([observations[seq][0] for seq in sorted(observations)])
                tokens_k = [list(observations[seq][1]) for seq in sorted(observations)]
                sampled_k = np.array([len(self._turn[row].token_ids) for row in rows_k])
                if (keep_k < 0).any() or (keep_k > sampled_k).any() or not all(tokens_k):
                    raise ValueError(f"RowSession.extend: keep {keep_k.tolist()} of {sampled_k.tolist()} sampled "
                                     f"tokens, observations of {[len(t) for t in tokens_k]}")
                self._extend(rows_k, self._turn_end[rows_k] + keep_k, self._turn_pos[rows_k] + keep_k, tokens_k,
                             prefill=False)
            if admit:
                rows_k = np.array(free[:len(admit)])
                self._seq_of[rows_k], self._slot_of[list(admit)] = admit, rows_k
                zeros_k = np.zeros(len(admit), np.int64)
                self._extend(rows_k, zeros_k, zeros_k, [self._prompts[seq] for seq in admit], prefill=True)

    def begin_turn(self, seq: int, budget: int) -> None:
        """Sequence `seq` samples its next turn, at most `budget` (> 0) tokens, from the next decode chunk on."""
        if budget < 1:
            raise ValueError(f"RowSession.begin_turn: budget must be >= 1, got {budget}")
        row = self._row(seq)
        self._turn_end[row], self._turn_pos[row] = self._end[row], self._pos[row]
        self._remaining[row], self._decoding[row] = budget, True
        self._turn[row] = SampledTurn([], [], False)

    def decode_chunk(self, turn_finished: Callable[[list[list[int]]], list[bool]]
                     ) -> list[tuple[int, SampledTurn]]:
        """One decode chunk of the rows on their turn. A row's turn ends at a stop token, at its budget, or once
        `turn_finished` (token lists of the rows still sampling) says so. Returns (sequence, its SampledTurn) of
        each sequence whose turn ended, ascending."""
        with self._sampler.mesh_context():
            put = self._sampler.put
            self._ensure_capacity(int(np.max(self._end + self._remaining * self._decoding)) + 1)
            self._state = self._state.replace(remaining_b=put(self._remaining.astype(np.int32)),
                                              done_b=put(~self._decoding))
            tokens_bc, logp_bc, emitted_bc, done_b = self._decode_chunk(np.zeros(self.batch_rows, bool))
        host_start = time.perf_counter()
        for row in np.flatnonzero(emitted_bc.any(axis=1)):
            emitted = emitted_bc[row]
            self._turn[row].token_ids.extend(tokens_bc[row, emitted].tolist())
            self._turn[row].logps.extend(logp_bc[row, emitted].tolist())
            n = int(emitted.sum())
            self._end[row] += n
            self._pos[row] += n
            self._remaining[row] -= n
        ended_b = self._decoding & done_b
        check = np.flatnonzero(self._decoding & ~done_b)
        if check.size:
            finished = turn_finished([self._turn[row].token_ids for row in check])
            ended_b[check[np.asarray(finished, bool)]] = True
        self._decoding &= ~ended_b
        stop_set = set(self._cfg.stop_ids)
        ended = sorted((int(self._seq_of[row]), _with_hit_stop(self._turn[row], stop_set))
                       for row in np.flatnonzero(ended_b))
        self.timing["host_s"] += time.perf_counter() - host_start
        return ended

    def compact(self) -> None:
        """Moves the live sequences into a smaller batch bucket (`ShapePlan.compacted_rows`: a power of two or 1.5x
        one) when the plan has one for them (call it once no sequence waits for a row)."""
        live = np.flatnonzero(self._seq_of >= 0)
        if self._state is None or not live.size:
            return
        compaction = self._sampler.plan.compaction(self.batch_rows, self.capacity, len(live), continuous=True)
        if compaction is None:
            return
        take = np.concatenate([live, np.full(compaction.rows_out - len(live), live[0])])
        with self._sampler.mesh_context():
            self._state = self._sampler.select_rows(self._state, take.astype(np.int32))
        self._seq_of = np.concatenate([self._seq_of[live], np.full(len(take) - len(live), -1)])
        self._slot_of[self._seq_of[:len(live)]] = np.arange(len(live))
        for name in ("_end", "_pos", "_turn_end", "_turn_pos", "_remaining", "_decoding"):
            setattr(self, name, getattr(self, name)[take])
        self._decoding[len(live):] = False
        self._turn = [self._turn[row] for row in take]

    # -- internals -------------------------------------------------------------------------------------------

    def _row(self, seq: int) -> int:
        row = int(self._slot_of[seq])
        if row < 0:
            raise ValueError(f"RowSession: sequence {seq} holds no row")
        return row

    def _start(self) -> None:
        """The empty batch, with room for the longest prompt and a first turn."""
        longest = max(map(len, self._prompts))
        prompt = buckets.pow2_bucket(longest, self._cfg.min_observation_bucket)
        shape = self._sampler.plan.empty(self._batch, prompt + self._first_turn + 1)
        self._state = self._sampler.empty(self._params, self._rng, shape.rows, shape.capacity)
        zeros = lambda dtype=np.int64: np.zeros(shape.rows, dtype)  # noqa: E731
        self._seq_of = np.full(shape.rows, -1, np.int64)
        self._end, self._pos, self._turn_end, self._turn_pos, self._remaining = (zeros() for _ in range(5))
        self._decoding = zeros(bool)
        self._turn = [SampledTurn([], [], False) for _ in range(shape.rows)]

    def _extend(self, rows_k: np.ndarray, end_k: np.ndarray, pos_k: np.ndarray, tokens_k: list[list[int]],
                prefill: bool) -> None:
        """The extend of rows rows_k, rolled back to (end_k, pos_k), by tokens_k; with `prefill` the rows start
        their sequences (see `_extend_rows`). In several calls when they are more than the plan's limit
        (`rollout.max_extend_rows`; frozen, the largest call run)."""
        limit = self._sampler.plan.extend_rows_limit(self.batch_rows, prefill)
        if limit is not None and len(rows_k) > limit:
            for first in range(0, len(rows_k), limit):
                part = slice(first, first + limit)
                self._extend(rows_k[part], end_k[part], pos_k[part], tokens_k[part], prefill)
            return
        lengths_k = np.array([len(t) for t in tokens_k])
        shape = self._sampler.plan.extend_rows(self.batch_rows, self.capacity, len(rows_k), int(lengths_k.max()),
                                               int(end_k.max()), prefill)
        self._ensure_capacity(int(end_k.max()) + shape.tokens)
        k, t = shape.rows_in, shape.tokens
        pad = lambda a, fill, dtype: np.concatenate([a, np.full(k - len(a), fill)]).astype(dtype)  # noqa: E731
        tokens_kt = np.zeros((k, t), np.int32)
        valid_kt = np.zeros((k, t), bool)
        valid_kt[len(rows_k):, 0] = True  # padding rows hold one token so that attention never sees an empty row
        for i, tokens in enumerate(tokens_k):
            tokens_kt[i, :len(tokens)] = tokens
            valid_kt[i, :len(tokens)] = True
        seqs = self._seq_of[rows_k]
        key_data_k = np.zeros((k,) + self._key_data_n.shape[1:], np.uint32)
        key_data_k[:len(rows_k)] = self._key_data_n[seqs]
        start = time.perf_counter()
        self._state = self._sampler.extend_rows(
            self._params, self._state, pad(rows_k, self.batch_rows, np.int32), pad(end_k, 0, np.int32),
            pad(pos_k, 0, np.int32), tokens_kt, valid_kt, key_data_k, prefill)
        self._state.logits_bv.block_until_ready()  # times the extend apart from decoding
        self.timing["prefill_s"] += time.perf_counter() - start
        self._end[rows_k] = end_k + lengths_k
        self._pos[rows_k] = pos_k + lengths_k
        self._decoding[rows_k] = False


def _with_hit_stop(turn: SampledTurn, stop_ids: set[int]) -> SampledTurn:
    """The turn with `hit_stop` set when its last token is a stop id."""
    if turn.token_ids and turn.token_ids[-1] in stop_ids and not turn.hit_stop:
        return dataclasses.replace(turn, hit_stop=True)
    return turn
