"""Per-token log-probs and entropies without materializing [batch, time, vocab] logits.

The sequence is cut into time chunks; each chunk's logits `hidden @ w_dv / temperature` (float32) live only inside a
`jax.checkpoint`-ed scan body, so the backward pass recomputes them chunk by chunk: peak memory is one chunk's
[B, chunk, V] logits instead of [B, T, V].

With a mesh, the vocabulary stays sharded as the parameters are (`w_dv` as `parallel.spec(None, "vocab")`, over fsdp and
tensor, inside a `shard_map`): neither the output projection nor the logits are ever gathered. The batch is split over
the mesh's "batch" axes (data, fsdp); each chunk's hidden states are gathered over the axis that splits both (fsdp: the
rows of the group, one chunk at a time), each device computes its vocabulary shard's logits for all of them, and the
log-softmax comes from per-shard max / sum reductions (`pmax` / `psum` of [B, chunk] statistics) over the vocabulary
axes, after which each device keeps its own rows.

Dimension letters (docs/architecture.md, "Dimension letters"): B rows, T tokens, I time chunks of C tokens, D hidden,
V vocabulary (a device's shard of it inside the `shard_map`).

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
from llds_jax.config.sections import DEFAULT_TIME_CHUNK

def _chunk_logp_entropy(h_bcd, w_dv, targets_bc, temperature, vocab_axes, row_axis):
    """log p(target) and entropy for one time chunk of the local rows [b, c].

    Without a mesh (`vocab_axes` None) `w_dv` is the whole vocabulary. Inside the shard_map it is this device's shard
    of `vocab_axes`; with `row_axis`, the chunk of every row of that axis's group is gathered first (`targets_bc`
    already holds the group's rows) and the local rows are cut out of the reduced statistics.
    """
    local_rows = h_bcd.shape[0]
    if row_axis is not None:
        h_bcd = lax.all_gather(h_bcd, row_axis, axis=0, tiled=True)
    logits_bcv = jnp.einsum("bcd,dv->bcv", h_bcd, w_dv, preferred_element_type=jnp.float32)
    logits_bcv = logits_bcv.astype(jnp.float32) / temperature
    local_vocab = w_dv.shape[1]
    # The max only stabilizes exp(); its gradient cancels exactly, so it is a constant for autodiff.
    max_bc = lax.stop_gradient(jnp.max(logits_bcv, axis=-1))
    if vocab_axes is not None:
        max_bc = lax.pmax(max_bc, vocab_axes)
        vocab_offset = lax.axis_index(vocab_axes) * local_vocab
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
    if vocab_axes is not None:
        # Gathered (exact) and summed in shard order, not psum-ed: a psum adds in the order of the collective's
        # implementation (another on one process than across hosts), which would make the log-probs, and the
        # LLDS gates that compare them, depend on the layout in the last bits. The psum that follows adds one
        # shard's sums to zeros (exact); it marks them as the same on every shard.
        shard_stats = lax.all_gather(  # [shards, 3, B, C]
            jnp.stack([sum_exp_bc, sum_exp_logit_bc, target_logit_bc]), vocab_axes)
        first_shard = lax.axis_index(vocab_axes) == 0
        sum_exp_bc, sum_exp_logit_bc, target_logit_bc = lax.psum(
            jnp.where(first_shard, jnp.sum(shard_stats, axis=0), 0.0), vocab_axes)
    logsumexp_bc = max_bc + jnp.log(sum_exp_bc)
    logp_bc = target_logit_bc - logsumexp_bc
    entropy_bc = logsumexp_bc - sum_exp_logit_bc / sum_exp_bc
    if row_axis is not None:
        first_row = lax.axis_index(row_axis) * local_rows
        logp_bc, entropy_bc = (lax.dynamic_slice_in_dim(x, first_row, local_rows) for x in (logp_bc, entropy_bc))
    return logp_bc, entropy_bc


def _time_chunked(hidden_btd, w_dv, targets_bt, temperature, time_chunk, vocab_axes=None, row_axis=None):
    """Scan `_chunk_logp_entropy` over time chunks, rematerializing each chunk's logits in the backward pass."""
    batch, time, dim = hidden_btd.shape
    if row_axis is not None:
        targets_bt = lax.all_gather(targets_bt, row_axis, axis=0, tiled=True)
    num_chunks = -(-time // min(time_chunk, time))
    chunk = -(-time // num_chunks)  # equal chunks of at most time_chunk: under num_chunks padded steps in all
    pad = num_chunks * chunk - time
    hidden_btd = jnp.pad(hidden_btd, ((0, 0), (0, pad), (0, 0)))
    targets_bt = jnp.pad(targets_bt, ((0, 0), (0, pad)))
    hidden_ibcd = hidden_btd.reshape(batch, num_chunks, chunk, dim).swapaxes(0, 1)
    targets_ibc = targets_bt.reshape(targets_bt.shape[0], num_chunks, chunk).swapaxes(0, 1)

    @jax.checkpoint
    def body(h_bcd, t_bc, w):
        return _chunk_logp_entropy(h_bcd, w, t_bc, temperature, vocab_axes, row_axis)

    logp_ibc, entropy_ibc = lax.map(lambda xs: body(xs[0], xs[1], w_dv), (hidden_ibcd, targets_ibc))
    logp_bt = logp_ibc.swapaxes(0, 1).reshape(batch, num_chunks * chunk)[:, :time]
    entropy_bt = entropy_ibc.swapaxes(0, 1).reshape(batch, num_chunks * chunk)[:, :time]
    return logp_bt, entropy_bt


def mesh_batch_axes(mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes a batch dimension is split over: those of the logical "batch" dimension the mesh has."""
    return parallel.axes("batch", mesh)


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
      w_dv: [D, V] output projection. With `mesh`, V is split over its ("fsdp", "tensor") axes (V must divide).
      targets_bt: [B, T] int target ids in [0, V).
      temperature: logits are divided by it (the rollout temperature).
      time_chunk: time steps per chunk; peak logits memory is B * time_chunk * V float32.
      mesh: optional mesh with axes among ("data", "fsdp", "tensor"): B is split over the data axes ("data",
        "fsdp"), V over ("fsdp", "tensor").

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
        return run(hidden_btd, w_dv, targets_bt)

    vocab_axes = parallel.axes("vocab", mesh) or None
    vocab_shards = math.prod(mesh.shape[a] for a in vocab_axes or ())
    if w_dv.shape[1] % vocab_shards:
        raise ValueError(f"vocab size {w_dv.shape[1]} is not divisible by the mesh's {vocab_axes} axes "
                         f"({vocab_shards} shards)")
    batch_axes = mesh_batch_axes(mesh) or None
    batch_shards = math.prod(mesh.shape[a] for a in batch_axes or ())
    if hidden_btd.shape[0] % batch_shards:
        raise ValueError(f"batch size {hidden_btd.shape[0]} is not divisible by the mesh's data axes "
                         f"{batch_axes} ({batch_shards} shards)")
    # "fsdp" splits both the rows and the vocabulary: its group's rows are gathered, one chunk at a time.
    row_axis = next((a for a in batch_axes or () if a in (vocab_axes or ()) and mesh.shape[a] > 1), None)
    in_specs = (P(batch_axes, None, None), P(None, vocab_axes), P(batch_axes, None))
    if all(axis_type == AxisType.Explicit for axis_type in mesh.axis_types):
        # Explicit-sharding meshes need the inputs laid out as the specs say (on Auto meshes shard_map does it).
        hidden_btd, w_dv, targets_bt = (
            jax.reshard(x, NamedSharding(mesh, spec)) for x, spec in zip((hidden_btd, w_dv, targets_bt), in_specs))
    sharded = jax.shard_map(
        functools.partial(run, vocab_axes=vocab_axes, row_axis=row_axis),
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
