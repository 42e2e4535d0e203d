"""Per-token log-probs and entropies without materializing [batch, time, vocab] logits.

The sequence is cut into time chunks; each chunk's logits `hidden @ w_dv / temperature` (float32) live only inside a
`jax.checkpoint`-ed scan body, so the backward pass recomputes them chunk by chunk: peak memory is one chunk's
[B, chunk, V] logits instead of [B, T, V].

With a mesh, the vocabulary is sharded over its `tensor` axis (`w_dv` as P(None, "tensor") inside a `shard_map`) and the
log-softmax comes from per-shard max / sum reductions (`pmax` / `psum` of [B, chunk] statistics): the logits are never
gathered. The batch is split over the mesh's data axes ("data", "fsdp").

Alignment used by the RL code: `logp_bt[:, t] = log p(token t | tokens < t)`, computed from the hidden state at t - 1;
position 0 has no prediction and holds 0.
"""
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from llds_jax import parallel
from llds_jax.rl.config import DEFAULT_TIME_CHUNK

VOCAB_AXIS = "tensor"


def _chunk_logp_entropy(h_bcd, w_dv, targets_bc, temperature, axis_name):
    """log p(target) and entropy for one time chunk; the vocab may be this device's shard of `axis_name`."""
    logits_bcv = jnp.einsum("bcd,dv->bcv", h_bcd, w_dv, preferred_element_type=jnp.float32)
    logits_bcv = logits_bcv.astype(jnp.float32) / temperature
    local_vocab = w_dv.shape[1]
    # The max only stabilizes exp(); its gradient cancels exactly, so it is a constant for autodiff.
    max_bc = lax.stop_gradient(jnp.max(logits_bcv, axis=-1))
    if axis_name is not None:
        max_bc = lax.pmax(max_bc, axis_name)
        vocab_offset = lax.axis_index(axis_name) * local_vocab
    else:
        vocab_offset = 0
    exp_bcv = jnp.exp(logits_bcv - max_bc[..., None])
    sum_exp_bc = jnp.sum(exp_bcv, axis=-1)
    sum_exp_logit_bc = jnp.sum(exp_bcv * logits_bcv, axis=-1)
    local_target_bc = targets_bc - vocab_offset
    in_shard_bc = (local_target_bc >= 0) & (local_target_bc < local_vocab)
    target_logit_bc = jnp.take_along_axis(
        logits_bcv, jnp.clip(local_target_bc, 0, local_vocab - 1)[..., None], axis=-1)[..., 0]
    target_logit_bc = jnp.where(in_shard_bc, target_logit_bc, 0.0)
    if axis_name is not None:
        sum_exp_bc, sum_exp_logit_bc, target_logit_bc = lax.psum(
            (sum_exp_bc, sum_exp_logit_bc, target_logit_bc), axis_name)
    logsumexp_bc = max_bc + jnp.log(sum_exp_bc)
    logp_bc = target_logit_bc - logsumexp_bc
    entropy_bc = logsumexp_bc - sum_exp_logit_bc / sum_exp_bc
    return logp_bc, entropy_bc


def _time_chunked(hidden_btd, w_dv, targets_bt, temperature, time_chunk, axis_name):
    """Scan `_chunk_logp_entropy` over time chunks, rematerializing each chunk's logits in the backward pass."""
    batch, time, dim = hidden_btd.shape
    num_chunks = -(-time // min(time_chunk, time))
    chunk = -(-time // num_chunks)  # equal chunks of at most time_chunk: under num_chunks padded steps in all
    pad = num_chunks * chunk - time
    hidden_btd = jnp.pad(hidden_btd, ((0, 0), (0, pad), (0, 0)))
    targets_bt = jnp.pad(targets_bt, ((0, 0), (0, pad)))
    hidden_nbcd = hidden_btd.reshape(batch, num_chunks, chunk, dim).swapaxes(0, 1)
    targets_nbc = targets_bt.reshape(batch, num_chunks, chunk).swapaxes(0, 1)

    @jax.checkpoint
    def body(h_bcd, t_bc, w):
        return _chunk_logp_entropy(h_bcd, w, t_bc, temperature, axis_name)

    logp_nbc, entropy_nbc = lax.map(lambda xs: body(xs[0], xs[1], w_dv), (hidden_nbcd, targets_nbc))
    logp_bt = logp_nbc.swapaxes(0, 1).reshape(batch, num_chunks * chunk)[:, :time]
    entropy_bt = entropy_nbc.swapaxes(0, 1).reshape(batch, num_chunks * chunk)[:, :time]
    return logp_bt, entropy_bt


def mesh_batch_axes(mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes a batch dimension is split over: those of ("data", "fsdp") the mesh has."""
    return tuple(axis for axis in parallel.BATCH if axis in mesh.axis_names)


def token_logp_entropy(
    hidden_btd: jax.Array,
    w_dv: jax.Array,
    targets_bt: jax.Array,
    *,
    temperature: float = 1.0,
    time_chunk: int = DEFAULT_TIME_CHUNK,
    mesh: Mesh | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Log-prob of each target id and entropy of the full next-token distribution, from hidden states.

    Args:
      hidden_btd: [B, T, D] final-normed hidden states; position t predicts `targets_bt[:, t]`.
      w_dv: [D, V] output projection. With `mesh`, V is split over its "tensor" axis (V must divide evenly).
      targets_bt: [B, T] int target ids in [0, V).
      temperature: logits are divided by it (the rollout temperature).
      time_chunk: time steps per chunk; peak logits memory is B * time_chunk * V float32.
      mesh: optional mesh with axes among ("data", "fsdp", "tensor"): B is split over the data axes, V over "tensor".

    Returns:
      (logp_bt, entropy_bt): [B, T] float32, in nats.
    """
    if hidden_btd.ndim != 3 or w_dv.ndim != 2 or hidden_btd.shape[-1] != w_dv.shape[0]:
        raise ValueError(f"hidden_btd [B,T,D] and w_dv [D,V] do not match: {hidden_btd.shape} vs {w_dv.shape}")
    if targets_bt.shape != hidden_btd.shape[:2]:
        raise ValueError(f"targets_bt must be [B,T]={hidden_btd.shape[:2]}; got {targets_bt.shape}")
    if time_chunk < 1:
        raise ValueError(f"time_chunk must be >= 1; got {time_chunk}")
    run = functools.partial(_time_chunked, temperature=temperature, time_chunk=time_chunk)
    if mesh is None:
        return run(hidden_btd, w_dv, targets_bt, axis_name=None)

    vocab_axis = VOCAB_AXIS if VOCAB_AXIS in mesh.axis_names else None
    vocab_shards = mesh.shape[VOCAB_AXIS] if vocab_axis else 1
    if w_dv.shape[1] % vocab_shards:
        raise ValueError(f"vocab size {w_dv.shape[1]} is not divisible by the mesh's '{VOCAB_AXIS}' axis "
                         f"({vocab_shards})")
    batch_axes = mesh_batch_axes(mesh) or None
    batch_shards = math.prod(mesh.shape[a] for a in batch_axes or ())
    if hidden_btd.shape[0] % batch_shards:
        raise ValueError(f"batch size {hidden_btd.shape[0]} is not divisible by the mesh's data axes "
                         f"{batch_axes} ({batch_shards} shards)")
    in_specs = (P(batch_axes, None, None), P(None, vocab_axis), P(batch_axes, None))
    if all(axis_type == AxisType.Explicit for axis_type in mesh.axis_types):
        # Explicit-sharding meshes need the inputs laid out as the specs say (on Auto meshes shard_map does it).
        hidden_btd, w_dv, targets_bt = (
            jax.reshard(x, NamedSharding(mesh, spec)) for x, spec in zip((hidden_btd, w_dv, targets_bt), in_specs))
    sharded = jax.shard_map(
        functools.partial(run, axis_name=vocab_axis),
        mesh=mesh,
        in_specs=in_specs,
        out_specs=(P(batch_axes, None), P(batch_axes, None)),
    )
    return sharded(hidden_btd, w_dv, targets_bt)


def model_token_logp(
    model,
    tokens_bt: jax.Array,
    mask_bt: jax.Array,
    *,
    temperature: float = 1.0,
    time_chunk: int = DEFAULT_TIME_CHUNK,
    mesh: Mesh | None = None,
    segment_first_bt: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Log-prob and next-token entropy of every token of a sequence under a model, aligned to the tokens.

    Args:
      model: has `hidden(tokens_bt, mask_bt, segment_first_bt) -> [B,T,D]` and `unembedding() -> [D,V]`
        (llds_jax.model.Transformer).
      tokens_bt: [B, T] int token ids.
      mask_bt: [B, T] attention mask, 1 on real tokens, 0 on padding.
      segment_first_bt: for rows packed with several sequences, int32 [B, T] the first token of each token's
        sequence (`Transformer.hidden`); the column of a sequence's first token then holds a prediction from the
        previous sequence, which the caller drops.

    Returns:
      (logp_bt, entropy_bt): [B, T] float32. Column t is for predicting token t from tokens < t (hidden at t - 1):
      `logp_bt[:, t] = log p(tokens_bt[:, t])`, `entropy_bt[:, t]` the entropy of that distribution; column 0 is 0.
    """
    hidden_btd = model.hidden(tokens_bt, mask_bt, segment_first_bt)
    logp_bt, entropy_bt = token_logp_entropy(
        hidden_btd[:, :-1], model.unembedding(), tokens_bt[:, 1:],
        temperature=temperature, time_chunk=time_chunk, mesh=mesh)
    first_b1 = jnp.zeros((tokens_bt.shape[0], 1), jnp.float32)
    return jnp.concatenate([first_b1, logp_bt], axis=1), jnp.concatenate([first_b1, entropy_bt], axis=1)
