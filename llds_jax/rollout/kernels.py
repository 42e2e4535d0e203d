"""The device programs of batched sampling with the KV cache: pure functions of (graphdef, params, decode state,
host arrays) that `llds_jax.rollout.sampler.Sampler` jits, and the layout every one of them returns.

  prefill / shared_prefill   left-padded prompts encoded into an empty cache (shared: each distinct prompt once,
                             its cache rows and logits copied to the rows holding it)
  decode_chunk               up to `decode_chunk` decode steps in a `lax.while_loop`
  end_turn                   every row rolled back to its kept tokens, then an observation appended
  empty / extend_rows        continuous batching: an empty batch, and the extend of some rows only
  grow / select_rows         more cache slots; a batch of some rows (compaction)
  fork_rows                  tree rollouts: a new batch of copies of some rows, each rolled back to an agent-step
                             boundary and re-extended by the token before it (its next-token logits), fresh PRNG keys

Log-probs are those of the sampling distribution over the full vocabulary: log_softmax(logits / temperature) in
float32, what the learner recomputes. Top-k / top-p only restrict which tokens can be drawn; the log-probs are not
renormalized over the kept set. Greedy decoding reports temperature-1 log-probs.

Dimension letters: B rows, U distinct prompts, T new tokens, C decode steps of one chunk, S cache slots, V
vocabulary, D hidden.
"""
from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from llds_jax import parallel
from llds_jax.model import KVCache, init_cache
from llds_jax.rollout import nucleus
from llds_jax.rollout.config import SamplingConfig


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
    when greedy); top-k and top-p only restrict the candidates. With top_k, top-p's nucleus is taken among the k
    sorted candidates; without it, over the whole vocabulary by bisection (`nucleus`: no sort), ties at the nucleus'
    smallest probability all kept.
    """
    # Each row's whole vocabulary on one device: left split over the vocabulary, XLA's CPU compiler partitions the
    # CDF's cumsum into a reduce-window over the whole vocabulary per output (O(V^2) per row). The rows are split
    # over every mesh axis, so that the chips of a tensor-parallel rollout each draw a share of them rather than all
    # of them.
    logits_bv = parallel.constrain(logits_bv.astype(jnp.float32), "sampled_rows", None)
    if cfg.greedy:
        tokens_b = jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
        return _back_to_rows(tokens_b, _logp_of(jax.nn.log_softmax(logits_bv, axis=-1), tokens_b))
    scaled_bv = logits_bv / cfg.temperature
    logp_bv = jax.nn.log_softmax(scaled_bv, axis=-1)
    if cfg.top_k:
        candidates_bk, index_bk = jax.lax.top_k(scaled_bv, min(cfg.top_k, scaled_bv.shape[-1]))  # most likely first
        if cfg.top_p < 1:
            probs_bk = jax.nn.softmax(candidates_bk, axis=-1)
            mass_before_bk = jnp.cumsum(probs_bk, axis=-1) - probs_bk
            candidates_bk = jnp.where(mass_before_bk < cfg.top_p, candidates_bk, -jnp.inf)
        choice_b = _inverse_cdf_draw(key_b, jax.nn.softmax(candidates_bk, axis=-1))
        tokens_b = jnp.take_along_axis(index_bk, choice_b[:, None], axis=1)[:, 0]
    else:
        probs_bv = jax.nn.softmax(scaled_bv, axis=-1)
        if cfg.top_p < 1:
            probs_bv = nucleus.nucleus_probs(probs_bv, cfg.top_p)
        tokens_b = _inverse_cdf_draw(key_b, probs_bv)
    return _back_to_rows(tokens_b, _logp_of(logp_bv, tokens_b))


def _back_to_rows(tokens_b: jax.Array, logp_b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The drawn tokens and their log-probs laid out as the decode state's rows (gathering B numbers), so that the
    sampling's layout does not spread to the rest of the decode step."""
    return parallel.constrain(tokens_b, "batch"), parallel.constrain(logp_b, "batch")


def _inverse_cdf_draw(key_b: jax.Array, weights_bk: jax.Array) -> jax.Array:
    """One categorical draw per row with probabilities proportional to weights_bk (float32 >= 0, a row's sum > 0),
    by inverting the CDF with a single uniform per row: the draw is the index in [0, K) of the first cumulative
    weight >= u x the row's total.

    Gumbel-max (`jax.random.categorical`) needs K random numbers per row, which at a 152k vocabulary costs more
    than a decode step's forward pass; this needs one. Zero weights are never drawn.
    """
    cdf_bk = jnp.cumsum(weights_bk, axis=-1)
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


def state_specs(state: DecodeState) -> DecodeState:
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
    return _constrain(state, state_specs(state))


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


def prefill(graphdef, params, tokens_bt, valid_bt, rng, seq_ids_b, capacity: int) -> DecodeState:
    """Encodes left-padded prompts into an empty cache of `capacity` slots."""
    cache, logits_bv = _encode(nnx.merge(graphdef, params), tokens_bt, valid_bt, capacity)
    return _prefilled(cache, logits_bv, rng, seq_ids_b)


def shared_prefill(graphdef, params, tokens_ut, valid_ut, rng, seq_ids_b, source_b, capacity: int) -> DecodeState:
    """`prefill` of a batch whose row b holds distinct prompt source_b[b] (int32 [B] into the U left-padded
    prompts [U, T]): each distinct prompt is encoded once, then its cache and logits copied to its rows (one layer
    at a time: `_take_rows`)."""
    cache_u, logits_uv = _encode(nnx.merge(graphdef, params), tokens_ut, valid_ut, capacity)
    return _prefilled(_constrain_cache(_take_rows(cache_u, source_b)), _take(logits_uv, source_b), rng, seq_ids_b)


def decode_chunk(graphdef, cfg: SamplingConfig, params, state: DecodeState, stop_b):
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


def end_turn(graphdef, params, state: DecodeState, end_b, next_pos_b, obs_bt, obs_valid_bt) -> DecodeState:
    """Rolls each row back to its kept tokens (end_b, next_pos_b), then appends right-padded observations."""
    model = nnx.merge(graphdef, params)
    cache = state.cache
    slots_s = jnp.arange(cache.capacity, dtype=jnp.int32)
    cache = cache.replace(valid_bs=cache.valid_bs & (slots_s[None, :] < end_b[:, None]), end_b=end_b,
                          next_pos_b=next_pos_b)
    hidden_btd, cache = model.extend(obs_bt, obs_valid_bt, cache)
    return _constrain_state(state.replace(cache=cache, logits_bv=_last_logits(model, hidden_btd, obs_valid_bt)))


def empty(graphdef, params, rng, rows: int, capacity: int) -> DecodeState:
    """A batch of `rows` empty rows of `capacity` slots, every row done (continuous batching fills them with
    `extend_rows`; their keys are placeholders until then)."""
    model = nnx.merge(graphdef, params)
    zeros_b = jnp.zeros((rows,), jnp.int32)
    return _constrain_state(DecodeState(
        cache=_constrain_cache(init_cache(model.cfg, rows, capacity)),
        logits_bv=jnp.zeros((rows, model.cfg.vocab_size), jnp.float32),
        key_b=jax.vmap(lambda i: jax.random.fold_in(rng, i))(jnp.arange(rows, dtype=jnp.uint32)), count_b=zeros_b,
        remaining_b=zeros_b, done_b=jnp.ones((rows,), bool)))


def extend_rows(graphdef, params, state: DecodeState, rows_k, end_k, next_pos_k, tokens_kt, valid_kt, key_data_k,
                 prefill: bool) -> DecodeState:
    """Rolls rows `rows_k` back to (end_k, next_pos_k) and appends right-padded tokens to them; the other rows'
    cache, logits and decode state are untouched.

    prefill (static): the rows start new sequences, their tokens are prompts: the caller gives end 0 and position
    0 (the rows are emptied), attention runs over the prompts alone (as `prefill`), the sampled-token counts are
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


def fork_rows(graphdef, params, state: DecodeState, source_k, end_k, next_pos_k, tokens_k, valid_k,
              key_data_k) -> DecodeState:
    """A new batch of K rows: row k a copy of row source_k[k] of `state` (not donated) rolled back to the cache
    slots before end_k[k] - 1 (next RoPE position next_pos_k[k] - 1), then extended by tokens_k[k] (int32 [K]: the
    token that was at slot end_k[k] - 1), so that it holds that row's cache up to end_k[k] and the logits of the
    token that follows: never a re-encode. Every row samples anew: PRNG key data key_data_k (uint32 [K, ...]),
    sampled-token count 0, done.

    A row with valid_k[k] False (bool [K]) is carried as it is (its end and position are end_k[k], next_pos_k[k]: the
    source row's; nothing is appended; its logits are meaningless): a finished row kept for later forks, or padding.
    """
    model = nnx.merge(graphdef, params)
    rows = _take_rows(state.cache, source_k)
    back_k = (end_k - valid_k).astype(jnp.int32)
    slots_s = jnp.arange(rows.capacity, dtype=jnp.int32)
    rows = rows.replace(valid_bs=rows.valid_bs & (slots_s[None, :] < back_k[:, None]), end_b=back_k,
                        next_pos_b=(next_pos_k - valid_k).astype(jnp.int32))
    hidden_k1d, rows = model.extend(tokens_k[:, None], valid_k[:, None], _constrain_cache(rows))
    zeros_k = jnp.zeros(end_k.shape, jnp.int32)
    return _constrain_state(DecodeState(
        cache=rows, logits_bv=_last_logits(model, hidden_k1d, valid_k[:, None]),
        key_b=jax.random.wrap_key_data(key_data_k, impl=jax.random.key_impl(state.key_b)), count_b=zeros_k,
        remaining_b=zeros_k, done_b=jnp.ones(end_k.shape, bool)))


def grow(state: DecodeState, capacity: int) -> DecodeState:
    """The same state with `capacity` cache slots (new slots empty)."""
    cache = state.cache
    extra = capacity - cache.capacity
    pad = lambda a, axis: jnp.pad(a, [(0, extra if d == axis else 0) for d in range(a.ndim)])
    cache = cache.replace(k_lbskh=pad(cache.k_lbskh, 2), v_lbskh=pad(cache.v_lbskh, 2),
                          valid_bs=pad(cache.valid_bs, 1))
    return _constrain_state(state.replace(cache=cache))


def abstract_value(array: jax.Array) -> jax.ShapeDtypeStruct:
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


def select_rows(state: DecodeState, rows_b) -> DecodeState:
    """The state of rows `rows_b` (a smaller batch), the cache taken as `_take_rows` takes it."""
    take = functools.partial(_take, rows_b=rows_b)
    return _constrain_state(DecodeState(cache=_take_rows(state.cache, rows_b), logits_bv=take(state.logits_bv),
                                        key_b=take(state.key_b), count_b=take(state.count_b),
                                        remaining_b=take(state.remaining_b), done_b=take(state.done_b)))

