"""The train step: update schedule, micro-batch accumulation, sharding, non-finite skips, LLDS timing.

The shared steps (conftest) train on 32 trajectories: 2 optimizer updates of 4 micro-batches of 4, lr 1e-3, no warmup.
"""
import collections
import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from llds_jax.model import Transformer
from llds_jax.model.transformer import COMPUTE_DTYPE_PARAMS, compute_weights
from llds_jax.programs import Role
from llds_jax.rl.advantages import grpo_advantages
from llds_jax.config.sections import LLDSConfig, ObjectiveConfig, UpdateConfig
from llds_jax.rl.llds import action_ids_from_loss_mask
from llds_jax.rl.logprobs import model_token_logp
from llds_jax.rl.losses import objective_loss
from llds_jax.rl.terms import LossInputs
from llds_jax.rl.train_step import RLTrainStep, TrainShapes, learning_rate


def assert_trees_close(got, want, atol=1e-5):
    got, want = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=atol, rtol=0)


def test_llds_is_exactly_zero_on_the_first_update_and_acts_on_the_second(plain_step_result):
    _, _, metrics = plain_step_result
    llds_u = metrics.per_update["loss/llds"]
    assert llds_u[0] == 0.0 and metrics.per_update["actor/approx_kl"][0] == 0.0
    assert llds_u[1] > 0.0
    assert metrics.scalars["actor/updates"] == 2


def test_displacement_metrics_are_reported_over_the_updates_after_the_first(plain_step_result, plain_step,
                                                                            step_batch, host_copy):
    """loss/llds, the gate share, preserved delta, clip fraction and approx KL are 0 by construction on update 0:
    a batch reports them over updates 1..U-1 (here update 1 alone); the other metrics over every update. A batch of
    one update leaves them out (no empty mean)."""
    _, _, metrics = plain_step_result
    for key in ("loss/llds", "llds/gate_share", "llds/preserved_delta", "actor/clip_frac", "actor/approx_kl"):
        assert metrics.per_update[key][0] == 0.0, key
        assert metrics.scalars[key] == float(metrics.per_update[key][1]), key
    assert all(metrics.scalars[key] != 0 for key in ("loss/llds", "llds/gate_share", "actor/approx_kl"))
    for key in ("actor/entropy", "actor/loss", "actor/grad_norm", "actor/ref_kl_k3"):
        np.testing.assert_allclose(metrics.scalars[key], np.mean(metrics.per_update[key]), rtol=1e-6, err_msg=key)
    state = plain_step.init_state()
    with pytest.warns(UserWarning, match="one optimizer update"):
        _, one = plain_step.train_on_batch(state, plain_step.reference_params(state.params),
                                           jax.tree.map(lambda x: x[:16], step_batch))
    assert one.scalars["actor/updates"] == 1 and "llds/gate_share" not in one.scalars
    assert "actor/entropy" in one.scalars and all(np.isfinite(v) for v in one.scalars.values())


def test_warns_when_llds_is_on_with_one_update_per_batch(plain_step, step_batch, tiny_model_cfg):
    one_update = jax.tree.map(lambda x: x[:16], step_batch)
    with pytest.warns(UserWarning, match="LLDS is on but there is one optimizer update"):
        plain_step.prepare_batch(one_update)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plain_step.prepare_batch(step_batch)  # two updates: no warning
        no_llds = RLTrainStep(Transformer(tiny_model_cfg, rngs=nnx.Rngs(0)),
                              ObjectiveConfig(llds=LLDSConfig(enabled=False)), plain_step.update_cfg)
        no_llds.prepare_batch(one_update)


def naive_logp_entropy(model, tokens_bt, mask_bt, temperature):
    """Full-logits log-probs / entropies aligned to tokens (column 0 = 0)."""
    logp_btv = jax.nn.log_softmax(model(tokens_bt, mask_bt) / temperature, axis=-1)[:, :-1]
    logp_bt = jnp.take_along_axis(logp_btv, tokens_bt[:, 1:, None], axis=-1)[..., 0]
    entropy_bt = -jnp.sum(jnp.exp(logp_btv) * logp_btv, axis=-1)
    pad = lambda x: jnp.pad(x, ((0, 0), (1, 0)))  # noqa: E731
    return pad(logp_bt), pad(entropy_bt)


@pytest.mark.slow
def test_micro_batch_accumulation_matches_the_code_exact_definition(plain_step, plain_step_result, step_batch):
    """Each update = AdamW on the clipped gradient of the MEAN of the 4 per-micro-batch losses (each a token mean
    over its own loss tokens), computed here directly with full logits and plain optax."""
    initial, state, metrics = plain_step_result
    objective, cfg = plain_step.objective, plain_step.update_cfg
    graphdef = plain_step.graphdef
    batch = {field.name: jnp.asarray(getattr(step_batch, field.name)) for field in dataclasses.fields(step_batch)
             if getattr(step_batch, field.name) is not None}  # segment_first_bt: no segments
    advantages_b = jax.jit(grpo_advantages)(batch["rewards_b"], batch["group_b"])
    action_ids_bt = jax.jit(action_ids_from_loss_mask)(batch["loss_mask_bt"])
    params0 = jax.tree.map(jnp.asarray, initial)
    old_logp_bt = jax.jit(lambda p: naive_logp_entropy(nnx.merge(graphdef, p), batch["tokens_bt"], batch["mask_bt"],
                                                       objective.temperature)[0])(params0)  # = ref_logp (frozen copy)
    counts = [float(batch["loss_mask_bt"][4 * k:4 * k + 4].sum()) for k in range(4)]
    assert len(set(counts)) > 1  # micro-batches with different token counts: mean of means != global token mean

    def micro_batches(update, x):  # [32, ...] -> [4 micro-batches, 4, ...] of mini-batch `update`
        return jax.lax.dynamic_slice_in_dim(x, 16 * update, 16).reshape((4, 4) + x.shape[1:])

    def mini_batch_loss(params, update, first):
        # Rows are independent in the forward pass: one full-logits forward of the 16 rows, then per micro-batch.
        rows = lambda x: jax.lax.dynamic_slice_in_dim(x, 16 * update, 16)  # noqa: E731
        logp_bt, entropy_bt = naive_logp_entropy(nnx.merge(graphdef, params), rows(batch["tokens_bt"]),
                                                 rows(batch["mask_bt"]), objective.temperature)

        def micro_loss(logp_bt, entropy_bt, loss_mask_bt, action_ids_bt, answer_bt, advantages_b, old_bt):
            # On the first update the parameters are those of old_logp: logp == old_logp by definition.
            old_logp_bt = jnp.where(first, jax.lax.stop_gradient(logp_bt), old_bt)
            inputs = LossInputs(logp_bt, entropy_bt, old_logp_bt, old_bt, advantages_b, loss_mask_bt,
                                action_ids_bt, answer_bt, {"answer_beta": 0.2})
            return objective_loss(inputs, objective)[0]

        per_micro = [logp_bt.reshape(4, 4, -1), entropy_bt.reshape(4, 4, -1)] + [
            micro_batches(update, x) for x in (batch["loss_mask_bt"], action_ids_bt, batch["answer_mask_bt"],
                                               advantages_b, old_logp_bt)]
        return jnp.mean(jax.vmap(micro_loss)(*per_micro))

    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(cfg.learning_rate, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01))
    params, opt_state = params0, tx.init(params0)

    @jax.jit
    def direct_update(params, opt_state, update):
        loss, grads = jax.value_and_grad(mini_batch_loss)(params, update, update == 0)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, optax.tree.norm(grads)

    for update in range(2):
        params, opt_state, loss, grad_norm = direct_update(params, opt_state, update)
        np.testing.assert_allclose(metrics.per_update["actor/loss"][update], float(loss), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(metrics.per_update["actor/grad_norm"][update], float(grad_norm), rtol=1e-4)
    assert_trees_close(state.params, params)
    assert max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params0))) > 1e-4


@pytest.mark.slow
def test_lld_measurement_runs_in_float32_with_a_bfloat16_model(plain_step, step_batch, tiny_model_cfg, host_copy):
    """With bfloat16 compute and a small learning rate, bfloat16 log-probs move by rounding noise as large as the
    change (or not at all: ties). Delta_traj is measured with both forwards in float32: it equals the change of
    full-logits float32 log-probs from the params before to those after the updates, computed here directly."""
    bf16_cfg = dataclasses.replace(tiny_model_cfg, dtype="bfloat16")
    step = RLTrainStep(Transformer(bf16_cfg, rngs=nnx.Rngs(0)), ObjectiveConfig(),
                       dataclasses.replace(plain_step.update_cfg, learning_rate=1e-5))
    state = step.init_state()
    before = host_copy(state.params)
    state, metrics = step.train_on_batch(state, step.reference_params(state.params), step_batch, measure_lld=True)
    float32_model = dataclasses.replace(tiny_model_cfg, dtype="float32")
    graphdef = nnx.split(Transformer(float32_model, rngs=nnx.Rngs(0)))[0]
    tokens_bt, mask_bt = jnp.asarray(step_batch.tokens_bt), jnp.asarray(step_batch.mask_bt)
    logp = jax.jit(lambda p: naive_logp_entropy(nnx.merge(graphdef, p), tokens_bt, mask_bt, 1.0)[0])
    delta_bt = np.asarray(logp(jax.tree.map(jnp.asarray, host_copy(state.params)))) - np.asarray(logp(before))
    want_b = (delta_bt.astype(np.float64) * step_batch.loss_mask_bt).sum(axis=1)
    assert np.all(np.abs(want_b) > 1e-5)
    np.testing.assert_allclose(metrics.delta_traj_b, want_b, rtol=0.02, atol=2e-6)
    correct = step_batch.rewards_b > 0
    assert metrics.scalars["lld/tie_share"] == 0.0
    np.testing.assert_allclose(metrics.scalars["lld/rate"], np.mean(want_b[correct] < 0), rtol=1e-6)


@pytest.mark.slow
def test_a_step_runs_the_programs_abstract_programs_lists(plain_step, step_batch, monkeypatch):
    """`train_on_batch` runs its programs from the one list `abstract_programs` (what --mode=compile compiles) lowers:
    the roles it runs are the listed ones but the state's and reference's set-up. A float32 model measures LLD with
    one extra forward, the policy's program after the updates (the log-probs before them are old_logp itself: no
    float32 LLD program)."""
    assert not plain_step._lld_in_float32  # a float32 model
    ran = []
    listed = plain_step._batch_programs

    class Recorded:
        def __init__(self, role, fn):
            self.role, self.fn = role, fn

        def __call__(self, *args):
            ran.append(self.role)
            return self.fn(*args)

        def lower(self, *args):
            return self.fn.lower(*args)

    monkeypatch.setattr(plain_step, "_batch_programs",
                        lambda *args: {role: Recorded(role, fn) for role, fn in listed(*args).items()})
    state = plain_step.init_state()
    _, metrics = plain_step.train_on_batch(state, plain_step.reference_params(state.params), step_batch,
                                           measure_lld=True)
    updates = 2
    assert collections.Counter(ran) == {Role.POLICY_LOGP: 2 * updates, Role.REFERENCE_LOGP: updates,
                                        Role.LIKELIHOOD_METRICS: 1, Role.UPDATE: updates, Role.LLD_METRICS: 1}
    shapes = TrainShapes(step_batch.num_trajectories, step_batch.tokens_bt.shape[1], measure_lld=True)
    assert set(ran) == {p.role for p in plain_step.abstract_programs(shapes)} - {Role.OPTIMIZER_INIT,
                                                                                   Role.REFERENCE_COPY}
    assert np.isfinite(metrics.delta_traj_b).all() and "lld/rate" in metrics.scalars


@pytest.mark.slow
def test_sharded_step_equals_unsharded(sharded_step, plain_step_result, step_batch, mesh8):
    _, plain_state, plain_metrics = plain_step_result
    state = sharded_step.init_state()
    state, metrics = sharded_step.train_on_batch(state, sharded_step.reference_params(state.params), step_batch)
    assert_trees_close(state.params, plain_state.params)
    np.testing.assert_allclose(metrics.per_update["actor/loss"], plain_metrics.per_update["actor/loss"], rtol=1e-5,
                               atol=1e-7)
    lm_head = state.params["lm_head"].get_value()
    assert lm_head.sharding.mesh.shape == mesh8.shape and lm_head.sharding.spec == P(None, ("fsdp", "tensor"))
    mu_lm_head = jax.tree.leaves(state.opt_state)[[x.shape for x in jax.tree.leaves(state.opt_state)].index(
        lm_head.shape)]
    assert mu_lm_head.sharding.spec == P(None, ("fsdp", "tensor"))  # optimizer state laid out like its parameter


def test_nonfinite_gradient_skips_the_update_and_is_counted(plain_step, step_batch, host_copy):
    state = plain_step.init_state()
    ref = plain_step.reference_params(state.params)
    before = host_copy((state.params, state.opt_state))
    advantages_b = np.ones(32, np.float32)
    advantages_b[[3, 20]] = np.nan  # one trajectory in each mini-batch: both gradients become NaN
    poisoned = step_batch.with_advantages(advantages_b)
    state, metrics = plain_step.train_on_batch(state, ref, poisoned)
    assert metrics.scalars["actor/nonfinite"] == 2 and int(state.nonfinite_count) == 2
    assert np.all(np.isnan(metrics.per_update["actor/grad_norm"]))
    after = host_copy((state.params, state.opt_state))
    for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before)):
        np.testing.assert_array_equal(a, b)
    # A clean batch afterwards trains normally; the counter keeps its total.
    state, metrics = plain_step.train_on_batch(state, ref, step_batch)
    assert metrics.scalars["actor/nonfinite"] == 0 and int(state.nonfinite_count) == 2
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(host_copy(state.params)))
    assert any(np.any(a != b) for a, b in zip(jax.tree.leaves(host_copy(state.params)), jax.tree.leaves(before[0])))


def test_learning_rate_warms_up_linearly_from_zero_per_rollout_batch():
    cfg = UpdateConfig(learning_rate=1e-6, warmup_steps=4)
    np.testing.assert_allclose([float(learning_rate(s, cfg)) for s in range(6)],
                               [0.0, 0.25e-6, 0.5e-6, 0.75e-6, 1e-6, 1e-6], rtol=1e-6)
    assert float(learning_rate(0, UpdateConfig(learning_rate=1e-6))) == np.float32(1e-6)


def test_metrics_are_reported(plain_step_result, step_batch):
    _, state, metrics = plain_step_result
    s = metrics.scalars
    for key in ("actor/grad_norm", "actor/grad_norm_max", "actor/entropy", "actor/clip_frac", "actor/approx_kl",
                "actor/ref_kl_k3", "llds/gate_share", "llds/preserved_delta", "loss/llds", "lld/logp_sum_correct",
                "lld/logp_mean_incorrect", "lld/logp_mean_first_action", "lld/logp_mean_later_actions",
                "lld/delta_traj_correct", "lld/rate", "actor/nonfinite"):
        assert np.isfinite(s[key]), key
    assert s["actor/grad_norm_max"] == max(metrics.per_update["actor/grad_norm"])
    correct = step_batch.rewards_b > 0
    np.testing.assert_allclose(s["lld/rate"], np.mean(metrics.delta_traj_b[correct] < 0), rtol=1e-6)
    np.testing.assert_allclose(s["lld/tie_share"], np.mean(metrics.delta_traj_b[correct] == 0), rtol=1e-6)
    np.testing.assert_allclose(s["lld/delta_traj_correct"], np.mean(metrics.delta_traj_b[correct]), rtol=1e-5)
    assert int(state.step) == 1


def _first_loss_token(batch):
    loss_mask_bt = np.array(batch.loss_mask_bt)
    loss_mask_bt[0, 0] = 1.0
    return dataclasses.replace(batch, loss_mask_bt=loss_mask_bt)


@pytest.mark.parametrize("change, message", [
    (lambda b: dataclasses.replace(b, rewards_b=None), "batch.rewards_b is not set"),
    (lambda b: dataclasses.replace(b, advantages_b=None), "batch.advantages_b is not set"),
    (_first_loss_token, "batch.loss_mask_bt\\[:, 0\\] must be 0"),
    (lambda b: dataclasses.replace(b, mask_bt=b.mask_bt[:, 1:]), "batch.mask_bt must have shape \\(32, 24\\)"),
    (lambda b: dataclasses.replace(b, group_b=b.group_b[:8]), "batch.group_b must have shape \\(32,\\)"),
])
def test_batch_errors_name_the_field(plain_step, step_batch, change, message):
    with pytest.raises(ValueError, match=message):
        plain_step.prepare_batch(change(step_batch))


def test_reference_params_are_a_frozen_bf16_copy(plain_step, step_batch, tiny_model_cfg):
    step = RLTrainStep(Transformer(tiny_model_cfg, rngs=nnx.Rngs(0)), ObjectiveConfig(),
                       dataclasses.replace(plain_step.update_cfg, reference_dtype="bfloat16"))
    state = step.init_state()
    ref = step.reference_params(state.params)
    assert {x.dtype for x in jax.tree.leaves(ref)} == {jnp.dtype(jnp.bfloat16)}
    # Even a same-dtype copy owns its buffers: the updates donate the state's, the reference must survive them.
    f32_ref = plain_step.reference_params(state.params)
    assert all(r.unsafe_buffer_pointer() != p.unsafe_buffer_pointer()
               for r, p in zip(jax.tree.leaves(f32_ref), jax.tree.leaves(state.params)))
    prepared = step.prepare_batch(step_batch)
    ref_logp, logp = step.sequence_logp(ref, prepared), step.sequence_logp(state.params, prepared)
    assert ref_logp.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(ref_logp), np.asarray(logp), atol=0.05)


def test_abstract_values_are_those_of_the_real_step(sharded_step, step_batch, mesh8):
    """What --mode=compile lowers the programs at (`abstract_state`, `abstract_reference`, `batch_spec`) has the
    shapes, dtypes and shardings of what a run makes (`init_state`, `reference_params`, `prepare_batch` of the
    trainer's batch)."""
    layout = lambda tree: jax.tree.map(lambda x: (x.shape, x.dtype, x.sharding), tree)  # noqa: E731
    state = sharded_step.init_state()
    assert layout(sharded_step.abstract_state()) == layout(state)
    assert layout(sharded_step.abstract_reference(sharded_step.abstract_state().params)) == layout(
        sharded_step.reference_params(state.params))
    prepared = sharded_step.prepare_batch(step_batch)
    spec = sharded_step.batch_spec(*step_batch.tokens_bt.shape)
    assert layout(spec.batch) == layout(prepared.batch)
    assert layout(spec.batch_stats) == layout(prepared.batch_stats) and spec.num_updates == prepared.num_updates == 2
    assert list(spec.batch_stats) == ["answer_beta"]
    assert spec.batch.tokens_uxbt.sharding.spec == P(None, None, ("data", "fsdp"))


def test_abstract_programs_are_those_a_step_runs(sharded_step, tiny_model_cfg, mesh8):
    """What --mode=compile lowers (`abstract_programs`): every program of a step, in the order a run first runs
    them, the LLD measurement's only when asked, the reference's only with a KL term; at the abstract state and the
    laid-out batch's spec."""
    programs = sharded_step.abstract_programs(TrainShapes(32, 24, measure_lld=True))
    assert [p.name for p in programs] == ["optimizer init", "reference copy", "logp (reference)", "logp (policy)",
                                          "likelihood metrics", "update (2 per step)", "lld metrics"]
    assert {p.shapes for p in programs} == {"32 x 24 tokens, micro-batch 4"} and {p.mesh for p in programs} == {mesh8}
    layout = lambda tree: jax.tree.map(lambda x: (x.shape, x.dtype, x.sharding), tree)  # noqa: E731
    state, batch = programs[-2].args[:2]
    assert layout(state) == layout(sharded_step.abstract_state())
    assert batch == sharded_step.batch_spec(32, 24).batch and batch.num_trajectories == 32
    assert {x.shape for x in jax.tree.leaves(programs[4].lower().out_info)} == {()}  # scalar metrics
    no_kl = RLTrainStep(Transformer(tiny_model_cfg, rngs=nnx.Rngs(0)), ObjectiveConfig(kl_coef=0.0),
                        sharded_step.update_cfg)
    assert [p.name for p in no_kl.abstract_programs(TrainShapes(32, 24, measure_lld=False))] == [
        "optimizer init", "logp (policy)", "likelihood metrics", "update (2 per step)"]


@pytest.mark.slow
def test_micro_batch_gradients_are_taken_in_the_compute_dtype(tiny_model_cfg, step_batch):
    """`compute_weights` casts exactly the weights a bfloat16 model reads in bfloat16: the forward is bitwise the
    same, and the gradient with respect to the cast weights is the float32 parameters' gradient held in bfloat16
    (the norms and the embedding keep float32 and their float32 gradient)."""
    cfg = dataclasses.replace(tiny_model_cfg, dtype="bfloat16")
    graphdef, params, rest = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
    cast = compute_weights(params, cfg.dtype)
    dtypes = {jax.tree_util.keystr(path): leaf.dtype for path, leaf in jax.tree_util.tree_flatten_with_path(cast)[0]}
    halves = {name for name, dtype in dtypes.items() if dtype == jnp.bfloat16}
    assert halves and all(any(f"'{w}'" in name for w in COMPUTE_DTYPE_PARAMS) for name in halves)
    assert {name for name in dtypes if "norm" in name or "'embed'" in name}.isdisjoint(halves)
    tokens_bt, mask_bt = jnp.asarray(step_batch.tokens_bt[:4]), jnp.asarray(step_batch.mask_bt[:4])

    def loss(p):
        logp_bt, _ = model_token_logp(nnx.merge(graphdef, p, rest), tokens_bt, mask_bt)
        return jnp.sum(logp_bt * mask_bt), logp_bt

    (_, logp_f32), grads_f32 = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    (_, logp_cast), grads_cast = jax.jit(jax.value_and_grad(loss, has_aux=True))(cast)
    np.testing.assert_array_equal(np.asarray(logp_cast), np.asarray(logp_f32))
    for g_cast, g_f32, weight in zip(jax.tree.leaves(grads_cast), jax.tree.leaves(grads_f32), jax.tree.leaves(cast)):
        assert g_cast.dtype == weight.dtype and g_f32.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(g_cast, np.float32), np.asarray(g_f32), rtol=2 ** -7,
                                   atol=2 ** -7 * float(jnp.abs(g_f32).max()) / 64)
