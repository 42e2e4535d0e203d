"""Packed trajectories: the packing itself, the packed forward against the unpacked one, and a whole train step."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.rl.conftest import STEP_UPDATE, TINY_MODEL
from llds_jax import parallel
from llds_jax.model import ModelConfig, Transformer
from llds_jax.config.sections import ObjectiveConfig
from llds_jax.rl.logprobs import model_token_logp
from llds_jax.rl.packing import first_fit_rows, pack, rows_needed, unpack
from llds_jax.rl.train_step import RLTrainStep
from tests.placement import shard_model


def test_first_fit_by_decreasing_length():
    assert first_fit_rows(np.array([5, 3, 4, 2]), 8) == [[0, 1], [2, 3]]
    assert first_fit_rows(np.array([8, 8, 1]), 8) == [[0], [1], [2]]
    with pytest.raises(ValueError, match="a trajectory has 9 tokens, more than the row length 8"):
        first_fit_rows(np.array([9]), 8)


def test_pack_places_every_real_token_once_and_unpack_brings_it_back(make_rollout):
    batch = make_rollout(3, 16, 24, 96)  # left and right padding
    tokens_xbt, mask_xbt = batch.tokens_bt.reshape(4, 4, 24), batch.mask_bt.reshape(4, 4, 24)
    num_rows = rows_needed(mask_xbt)
    assert num_rows < 4
    rows = pack(tokens_xbt, mask_xbt, num_rows)
    assert rows.tokens_rt.shape == (4, num_rows, 24) and rows.source_bt.shape == (4, 4, 24)
    np.testing.assert_array_equal(rows.mask_rt.sum(axis=(1, 2)), mask_xbt.sum(axis=(1, 2)))
    for n in range(4):
        real_bt = mask_xbt[n] > 0
        first_real_bt = real_bt & (np.cumsum(real_bt, axis=1) == 1)
        # Every real token but each trajectory's first has a place; the places are distinct and hold the token.
        np.testing.assert_array_equal(rows.source_bt[n] >= 0, real_bt & ~first_real_bt)
        places = rows.source_bt[n][rows.source_bt[n] >= 0]
        assert len(set(places.tolist())) == len(places)
        back_bt = unpack(jnp.asarray(rows.tokens_rt[n], jnp.float32), jnp.asarray(rows.source_bt[n]))
        np.testing.assert_array_equal(np.asarray(back_bt), np.where(rows.source_bt[n] >= 0, tokens_xbt[n], 0))
        # segment_first: each packed token's trajectory starts there (a real token whose predecessor is another
        # trajectory's or none); padding points at itself.
        first_rt, index_t = rows.segment_first_rt[n], np.arange(24)
        assert np.all(first_rt <= index_t)
        np.testing.assert_array_equal(first_rt[rows.mask_rt[n] == 0], np.broadcast_to(index_t, first_rt.shape)[
            rows.mask_rt[n] == 0])
        starts = np.sum(first_rt == index_t[None], where=rows.mask_rt[n] > 0)
        assert starts == 4  # one start per trajectory
    with pytest.raises(ValueError, match=rf"micro-batch 0 needs {rows_needed(mask_xbt[:1])} rows, more than 1"):
        pack(tokens_xbt[:1], mask_xbt[:1], 1)


def test_rows_longer_than_the_batch_take_more_trajectories(make_rollout):
    batch = make_rollout(3, 16, 24, 96)
    tokens_xbt, mask_xbt = batch.tokens_bt.reshape(4, 4, 24), batch.mask_bt.reshape(4, 4, 24)
    assert rows_needed(mask_xbt, 96) == 1 < rows_needed(mask_xbt)  # 4 trajectories of <= 24 tokens in one row
    rows = pack(tokens_xbt, mask_xbt, 2, 96)
    assert rows.tokens_rt.shape == (4, 2, 96) and rows.source_bt.shape == (4, 4, 24)
    for n in range(4):
        back_bt = unpack(jnp.asarray(rows.tokens_rt[n], jnp.float32), jnp.asarray(rows.source_bt[n]))
        np.testing.assert_array_equal(np.asarray(back_bt), np.where(rows.source_bt[n] >= 0, tokens_xbt[n], 0))
    assert rows.mask_rt[:, 1].sum() == 0  # the second row is not needed
    with pytest.raises(ValueError, match="rows of 16 tokens are shorter than the batch length 24"):
        pack(tokens_xbt, mask_xbt, 4, 16)


@pytest.mark.slow
@pytest.mark.parametrize("implementation", ["xla", "blockwise", "splash"])
def test_packed_forward_equals_unpacked_values_and_gradients(make_rollout, implementation):
    """Log-probs and entropies of packed rows, unpacked, equal the one-row-per-trajectory forward wherever a token
    has a prediction; so do the parameter gradients of a loss on the loss tokens (RoPE restarts, no attention
    across trajectories: a leak or a shifted position changes the values)."""
    cfg = ModelConfig.tiny(**TINY_MODEL, attention=implementation, attention_query_block=8, attention_key_block=8)
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    batch = make_rollout(5, 8, 24, cfg.vocab_size)
    rows = jax.tree.map(lambda x: jnp.asarray(x[0]), pack(batch.tokens_bt[None], batch.mask_bt[None],
                                                          rows_needed(batch.mask_bt[None])))
    assert rows.num_rows < 8
    weights_bt = jnp.asarray(batch.loss_mask_bt) * jnp.cos(jnp.arange(24.0))

    def unpacked(params):
        return model_token_logp(nnx.merge(graphdef, params), batch.tokens_bt, batch.mask_bt, time_chunk=8)

    def packed(params):
        logp_rt, entropy_rt = model_token_logp(nnx.merge(graphdef, params), rows.tokens_rt, rows.mask_rt,
                                               time_chunk=8, segment_first_bt=rows.segment_first_rt)
        return unpack(logp_rt, rows.source_bt), unpack(entropy_rt, rows.source_bt)

    def loss(forward, params):
        logp_bt, entropy_bt = forward(params)
        return jnp.sum(weights_bt * (logp_bt + 0.5 * entropy_bt))

    has_prediction = np.asarray(rows.source_bt) >= 0
    for want, got in zip(jax.jit(unpacked)(params), jax.jit(packed)(params)):
        np.testing.assert_allclose(np.asarray(got)[has_prediction], np.asarray(want)[has_prediction], atol=2e-5)
    want_grads = jax.jit(jax.grad(lambda p: loss(unpacked, p)))(params)
    got_grads = jax.jit(jax.grad(lambda p: loss(packed, p)))(params)
    for want, got in zip(jax.tree.leaves(want_grads), jax.tree.leaves(got_grads)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=1e-4)


def _packed_step(cfg, mesh=None, update=dataclasses.replace(STEP_UPDATE, pack_trajectories=True), seed=0):
    model = Transformer(cfg, rngs=nnx.Rngs(seed))
    if mesh is not None:
        shard_model(model, mesh)
    return RLTrainStep(model, ObjectiveConfig(), update, mesh=mesh)


def _assert_same_step(state, metrics, plain_state, plain_metrics):
    for want, got in zip(jax.tree.leaves(plain_state.params), jax.tree.leaves(state.params)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-4)
    for key, want in plain_metrics.per_update.items():
        if not key.startswith("perf/"):
            np.testing.assert_allclose(metrics.per_update[key], want, atol=1e-6, rtol=1e-4, err_msg=key)
    for key, want in plain_metrics.scalars.items():
        if not key.startswith("perf/"):
            np.testing.assert_allclose(metrics.scalars[key], want, atol=1e-6, rtol=1e-4, err_msg=key)
    np.testing.assert_allclose(metrics.delta_traj_b, plain_metrics.delta_traj_b, atol=1e-5)


@pytest.mark.slow
def test_packed_train_step_equals_unpacked(tiny_model_cfg, step_batch, plain_step_result):
    """Same micro-batches (counted in trajectories), same objective: every loss term, LLDS gate and LLD metric of
    every update, and the parameters after the step, as without packing."""
    _, plain_state, plain_metrics = plain_step_result
    step = _packed_step(tiny_model_cfg)
    prepared = step.prepare_batch(step_batch)
    assert all(rows.num_rows < STEP_UPDATE.micro_batch_size for rows in prepared.rows)  # fewer rows
    state = step.init_state()
    state, metrics = step.train_on_batch(state, step.reference_params(state.params), step_batch, measure_lld=True)
    assert metrics.scalars["loss/llds"] > 0  # the second update's LLDS term is live, and equal
    _assert_same_step(state, metrics, plain_state, plain_metrics)


@pytest.mark.slow
def test_packed_train_step_on_a_mesh_equals_unpacked(tiny_model_cfg, step_batch, plain_step_result, mesh8):
    """On data 2 x fsdp 2 x tensor 2: packed rows are a multiple of the 4 data shards; a trajectory's tokens may sit
    on another device's row, and come back to its own."""
    _, plain_state, plain_metrics = plain_step_result
    step = _packed_step(tiny_model_cfg, mesh8)
    assert all(rows.num_rows % 4 == 0 for rows in step.prepare_batch(step_batch).rows)
    state = step.init_state()
    state, metrics = step.train_on_batch(state, step.reference_params(state.params), step_batch, measure_lld=True)
    _assert_same_step(state, metrics, plain_state, plain_metrics)


@pytest.mark.slow
def test_rows_longer_than_the_batch_and_a_row_count_per_update_equal_unpacked(tiny_model_cfg, step_batch,
                                                                              plain_step_result):
    """Rows of 32 tokens for a 24-token batch (`optim.pack_row_tokens`): the two updates' micro-batches pack into 3
    and 2 rows, each update's forwards on its own rows; losses, gates, LLD metrics and parameters as unpacked."""
    _, plain_state, plain_metrics = plain_step_result
    step = _packed_step(tiny_model_cfg, update=dataclasses.replace(STEP_UPDATE, pack_trajectories=True,
                                                                  pack_row_tokens=32))
    prepared = step.prepare_batch(step_batch)
    assert [rows.tokens_rt.shape for rows in prepared.rows] == [(1, 4, 3, 32), (1, 4, 2, 32)]
    state = step.init_state()
    state, metrics = step.train_on_batch(state, step.reference_params(state.params), step_batch, measure_lld=True)
    _assert_same_step(state, metrics, plain_state, plain_metrics)
    real = float(np.sum(step_batch.mask_bt > 0))
    np.testing.assert_allclose(metrics.scalars["perf/padding"], 1 - real / (4 * 3 * 32 + 4 * 2 * 32), rtol=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("with_mesh", [False, True])
def test_row_counts_compiled_ahead_leave_nothing_to_compile(tiny_model_cfg, make_rollout, with_mesh):
    """With `precompile_row_counts`, the first batch of a length compiles the forwards of every row count its
    updates can need (`row_counts`); a later batch of that length needing other counts compiles nothing. Also on a
    one-device mesh, as the trainer runs the demo (programs under the mesh: its index scalars are the mesh's)."""
    update = dataclasses.replace(STEP_UPDATE, pack_trajectories=True, pack_row_tokens=48, precompile_row_counts=True)
    mesh = parallel.make_mesh(1, 1, 1, devices=jax.devices()[:1]) if with_mesh else None
    step = _packed_step(tiny_model_cfg, mesh, update, seed=1)
    assert step.layout.row_counts(24) == [1, 2]  # micro-batches of 4, two 24-token trajectories to a 48-token row
    long_batch = make_rollout(7, 32, 24, tiny_model_cfg.vocab_size)
    mask_bt = long_batch.mask_bt.copy()
    mask_bt[:16, 12:] = 0.0  # the first update's trajectories fit one row each micro-batch, the second's need two
    short_batch = dataclasses.replace(long_batch, mask_bt=mask_bt,
                                      loss_mask_bt=long_batch.loss_mask_bt * mask_bt)
    counts = [[rows.num_rows for rows in step.prepare_batch(b).rows] for b in (long_batch, short_batch)]
    assert counts[0] != counts[1]
    state = step.init_state()
    ref = step.reference_params(state.params)
    state, metrics = step.train_on_batch(state, ref, long_batch)
    assert metrics.scalars["perf/compile_rows_s"] > 0
    compiles = []

    def listener(event, duration, **kwargs):
        if event.endswith("backend_compile_duration"):
            compiles.append(kwargs.get("fun_name"))

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        state, metrics = step.train_on_batch(state, ref, short_batch)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compiles == [] and metrics.scalars["perf/compile_rows_s"] == 0.0


def test_a_segmented_trajectory_packs_whole_with_each_segment_restarting():
    """Trajectory 0 holds segments of 3 and 4 tokens, trajectory 1 one of 2: one row of 10; each segment's tokens
    point at their own start, and a segment's first token has no prediction (source -1)."""
    tokens_xbt = np.asarray([[[1, 2, 3, 4, 5, 6, 7, 0], [8, 9, 0, 0, 0, 0, 0, 0]]], np.int32)
    mask_xbt = (tokens_xbt > 0).astype(np.float32)
    first_xbt = np.asarray([[[0, 0, 0, 3, 3, 3, 3, 7], [0, 0, 2, 3, 4, 5, 6, 7]]], np.int32)
    rows = pack(tokens_xbt, mask_xbt, 1, 10, first_xbt)
    assert rows.tokens_rt.tolist() == [[[1, 2, 3, 4, 5, 6, 7, 8, 9, 0]]]
    assert rows.segment_first_rt.tolist() == [[[0, 0, 0, 3, 3, 3, 3, 7, 7, 9]]]
    assert rows.source_bt.tolist() == [[[-1, 1, 2, -1, 4, 5, 6, -1], [-1, 8, -1, -1, -1, -1, -1, -1]]]
    plain = pack(tokens_xbt, mask_xbt, 1, 10)  # without segments: each trajectory one sequence
    assert plain.segment_first_rt.tolist() == [[[0, 0, 0, 0, 0, 0, 0, 7, 7, 9]]]
    assert plain.source_bt.tolist() == [[[-1, 1, 2, 3, 4, 5, 6, -1], [-1, 8, -1, -1, -1, -1, -1, -1]]]
