"""rollout.params_dtype: the rollout samples on a copy of the params cast once per rollout; the training params (what
the optimizer and the trainer's log-probs use) stay the same float32 arrays. The trainer's groups are the
trajectories' lineage."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llds_jax.rollout import layout as layout_lib
from llds_jax.rollout.driver import sequence_keys
from llds_jax.train import trainer as trainer_lib
from tests.configs import launched
from tests.run_fixtures import tiny_trainer_config

BF16, F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)


def dtypes(tree) -> set:
    return {x.dtype for x in jax.tree.leaves(tree)}


def test_cast_keeps_the_layout_and_copies_nothing_in_the_same_dtype(make_train_state):
    params, _ = make_train_state(0)
    cast = layout_lib.cast_params(params, "bfloat16")
    assert dtypes(params) == {F32} and dtypes(cast) == {BF16}
    mesh = jax.tree.leaves(params)[0].sharding.mesh
    training_layout = layout_lib.RolloutLayout(mesh, None)
    abstract = layout_lib.abstract_rollout_params(training_layout, params, "bfloat16")
    for x, y, a in zip(jax.tree.leaves(params), jax.tree.leaves(cast), jax.tree.leaves(abstract)):
        assert y.sharding.is_equivalent_to(x.sharding, x.ndim) and a.sharding.is_equivalent_to(x.sharding, x.ndim)
        assert (a.shape, a.dtype) == (y.shape, y.dtype)
        np.testing.assert_array_equal(np.asarray(y), np.asarray(x).astype(jnp.bfloat16))
    assert layout_lib.cast_params(params, "float32") is params
    assert layout_lib.rollout_params(training_layout, params, "float32") is params


@pytest.mark.slow
def test_one_bfloat16_cast_per_rollout_and_the_training_params_untouched(tiny_assets, tmp_path, monkeypatch):
    """Two rollouts (two steps) of 2 prompts x 4 samples on the 8 CPU devices, each in 2 sessions of 4 sequences
    with several engine steps: one cast per rollout, every step of a rollout on its bfloat16 arrays, after the
    first rollout's grid no step program compiled for the second; the training params are the same float32 arrays
    afterwards. Each trajectory's lineage: its prompt's group (what the trainer's batch groups it by), its own tree,
    its sequence's key."""
    cfg = tiny_trainer_config(tiny_assets, str(tmp_path / "run"))
    cfg.rollout.params_dtype = "bfloat16"
    cfg.rollout.max_batch_size = 4
    cfg.rollout.decode_chunk = 2  # 8-token turns: up to 4 chunks a turn
    cfg.rollout.top_p = 1.0  # no nucleus bisection (30 sums over the 152k-token vocabulary) in every decode step
    trainer = trainer_lib.Trainer(*launched(cfg))
    casts, decoded = [], []
    cast = layout_lib._cast
    monkeypatch.setattr(layout_lib, "_cast", lambda params, dtype: casts.append(dtype) or cast(params, dtype))
    dispatch = trainer.sampler.runner.dispatch  # the engine overlaps its calls: each is dispatched

    def recording_dispatch(params, batch, previous):
        decoded.append((params, len(batch.tokens_t)))
        return dispatch(params, batch, previous)

    monkeypatch.setattr(trainer.sampler.runner, "dispatch", recording_dispatch)
    params = trainer.rl_train_step.init_state().params
    leaves = jax.tree.leaves(params)
    prompts = next(trainer.data)
    rollouts, compiled = [], []
    try:
        for step in (1, 2):
            rollouts.append(trainer.rollout(params, prompts, jax.random.key(step)))
            trainer.sampler.freeze_shapes()  # as the trainer does after its first rollout
            compiled.append(trainer.sampler.runner.compiles)
        group_b = trainer.training_batch(rollouts[0].trajectories).group_b
    finally:
        trainer.close()

    assert casts == [BF16, BF16]
    first = decoded[0][0]
    per_rollout = [[shape for p, shape in decoded if p is copy] for copy in (first, decoded[-1][0])]
    assert decoded[-1][0] is not first and sum(map(len, per_rollout)) == len(decoded)  # two copies, one per rollout
    assert min(map(len, per_rollout)) > 4 and dtypes(first) == dtypes(decoded[-1][0]) == {BF16}
    # Step programs: one per token bucket, none new for the second rollout's copy.
    buckets = trainer.sampler.engine_config.token_budgets
    assert compiled == [len(buckets)] * 2 and compiled[0] < len(per_rollout[0]), (compiled, per_rollout)
    np.testing.assert_array_equal(group_b, [0] * 4 + [1] * 4)
    for step, rollout in zip((1, 2), rollouts):  # sessions of 4: sequence p samples from fold_in(fold_in(rng,
        # p // 4), p % 4)
        keys = [tuple(int(x) for x in sequence_keys(jax.random.fold_in(jax.random.key(step), p // 4), [p % 4])[0])
                for p in range(8)]
        assert [(t.lineage.group, t.lineage.tree, t.lineage.key_data) for t in rollout.trajectories] == [
            (p // 4, p, keys[p]) for p in range(8)]
    for rollout in rollouts:
        assert len(rollout.trajectories) == 8
        for t in rollout.trajectories:
            sampled = t.loss_mask.astype(bool)
            assert sampled.any() and np.isfinite(t.sampler_logp[sampled]).all()
            assert (t.sampler_logp[sampled] <= 0).all()
    assert all(a is b for a, b in zip(jax.tree.leaves(params), leaves)) and dtypes(params) == {F32}
