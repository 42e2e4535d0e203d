"""The batch layout: a host rollout batch as U updates of X micro-batches of B trajectories, on the device(s).

The shared batch (conftest): 32 trajectories of 24 tokens = 2 updates of 4 micro-batches of 4.
"""
import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from llds_jax.rl.batch import RolloutBatch
from llds_jax.rl.batch_layout import BatchLayout, LaidOutBatch
from tests.rl.conftest import STEP_UPDATE


def assert_batches_equal(got: RolloutBatch, want: RolloutBatch):
    for field in dataclasses.fields(RolloutBatch):
        np.testing.assert_array_equal(np.asarray(getattr(got, field.name)), np.asarray(getattr(want, field.name)),
                                      err_msg=field.name)


def test_fields_are_those_of_the_rollout_batch_in_its_order():
    """The two types convert by position: field k of one is field k of the other ([B, ...] <-> [U, X, B, ...])."""
    rollout = [f.name.rsplit("_", 1) for f in dataclasses.fields(RolloutBatch)]
    laid_out = [f.name.rsplit("_", 1) for f in dataclasses.fields(LaidOutBatch)]
    assert [name for name, _ in laid_out] == [name for name, _ in rollout]
    assert [(b, u) for (_, b), (_, u) in zip(rollout, laid_out)] == [("bt", "uxbt")] * 6 + [("b", "uxb")] * 4 + [
        ("bt", "uxbt")]


def test_counts_and_placement_of_the_trajectories(step_batch):
    """Trajectory b goes to update b // (X micro), micro-batch (b // micro) % X, place b % micro; the counts are the
    laid-out batch's own (a RolloutBatch of the same arrays would count U trajectories)."""
    laid_out = LaidOutBatch.of(step_batch.checked(), (2, 4, 4))
    assert (laid_out.num_updates, laid_out.tokens_uxbt.shape[1], laid_out.micro_batch_size) == (2, 4, 4)
    assert (laid_out.num_trajectories, laid_out.length) == (32, 24)
    assert laid_out.tokens_uxbt.shape == (2, 4, 4, 24) and laid_out.advantages_uxb.shape == (2, 4, 4)
    for b in (0, 5, 17, 31):
        np.testing.assert_array_equal(laid_out.tokens_uxbt[b // 16, (b // 4) % 4, b % 4], step_batch.tokens_bt[b])
        assert laid_out.rewards_uxb[b // 16, (b // 4) % 4, b % 4] == step_batch.rewards_b[b]


def test_host_to_laid_out_to_host_is_the_checked_batch(step_batch):
    checked = step_batch.checked()
    back = LaidOutBatch.of(checked, (2, 4, 4)).flat()
    assert back.num_trajectories == 32
    assert_batches_equal(back, checked)


def test_micro_batches_of_an_update_are_its_trajectories_in_order(step_batch):
    checked = step_batch.checked()
    micro_k = LaidOutBatch.of(checked, (2, 4, 4)).micro_batches(1)
    assert isinstance(micro_k, RolloutBatch) and micro_k.tokens_bt.shape == (4, 4, 24)
    assert_batches_equal(jax.tree.map(lambda x: x.reshape((16,) + x.shape[2:]), micro_k),
                         jax.tree.map(lambda x: x[16:], checked))


def test_laid_out_on_a_mesh_comes_back_to_the_host_batch(step_batch, mesh8):
    """On data 2 x fsdp 2 x tensor 2: the micro axis split over the 4 data shards, the statistics replicated; the
    device arrays are the host batch (without packed rows)."""
    unpacked = dataclasses.replace(STEP_UPDATE, pack_trajectories=False)
    prepared = BatchLayout(unpacked, mesh8).lay_out(step_batch.checked(), {"answer_beta": 0.5})
    batch = prepared.batch
    assert isinstance(batch, LaidOutBatch) and prepared.num_updates == 2 and prepared.rows is None
    assert batch.mask_uxbt.sharding.spec == P(None, None, ("data", "fsdp"))
    assert batch.group_uxb.sharding.spec == P(None, None, ("data", "fsdp"))
    beta = prepared.batch_stats["answer_beta"]
    assert beta.sharding.spec == P() and float(beta) == 0.5
    assert_batches_equal(jax.device_get(batch).flat(), step_batch.checked())


def test_packed_rows_per_update(step_batch):
    """With packing: one PackedRows per update, [1, X, R_u, T'] rows and [1, X, B, T] sources."""
    layout = BatchLayout(dataclasses.replace(STEP_UPDATE, pack_trajectories=True, pack_row_tokens=32))
    prepared = layout.lay_out(step_batch.checked(), {})
    assert [rows.tokens_rt.shape for rows in prepared.rows] == [(1, 4, 3, 32), (1, 4, 2, 32)]
    assert {rows.source_bt.shape for rows in prepared.rows} == {(1, 4, 4, 24)}
    assert prepared.update_rows(1) is prepared.rows[1]
    spec = layout.spec(32, 24, ["answer_beta"])
    assert [rows.tokens_rt.shape for rows in spec.rows] == [(1, 4, 4, 32)] * 2  # the worst case: a row each
    assert spec.batch.num_trajectories == 32 and list(spec.batch_stats) == ["answer_beta"]


def test_shape_errors_name_the_setting(mesh8):
    with pytest.raises(ValueError, match="batch size 24 is not a multiple of optim.mini_batch_size \\(16\\)"):
        BatchLayout(STEP_UPDATE).shape(24)
    with pytest.raises(ValueError, match="optim.micro_batch_size \\(2\\) must be a multiple of the mesh's data axes "
                                         "size \\(4\\)"):
        BatchLayout(dataclasses.replace(STEP_UPDATE, micro_batch_size=2), mesh8).shape(32)
