"""One GRPO + LLDS training step on a rollout batch: frozen log-probs, then mini-batch updates with accumulation.

Flow of `RLTrainStep.train_on_batch(state, ref_params, batch)`, `batch` a `RolloutBatch` (llds_jax/rl/batch.py) with
its rewards and advantages set:
1. check the batch on the host; the whole-batch statistics of the configured loss terms (`terms.batch_statistics`,
   e.g. LLDS-MA's beta); lay the batch out as [updates U, micro-batches X, micro-batch size, ...]
   (llds_jax/rl/batch_layout.py: a `LaidOutBatch`, sharded on the micro-batch axis over the mesh's data axes, so
   every micro-batch spans all devices); with `optim.pack_trajectories`, each micro-batch's trajectories are also
   packed into fewer rows for the forward (llds_jax/rl/packing.py: same micro-batches, same per-token results, less
   padding), as many rows as each update's micro-batches need (rows of `optim.pack_row_tokens`);
2. old_logp (current params) and ref_logp (frozen reference params), once, jitted, forward only, one call per
   update's mini-batch (on its rows);
3. U optimizer updates, one per mini-batch, in order (no shuffle, one epoch), all by the same jitted function: the
   loss of each of the X micro-batches, averaged; gradients averaged the same way; clip to global norm; AdamW. A
   non-finite loss or gradient leaves params and optimizer state unchanged and counts the skip;
4. optionally (`measure_lld`) logp of the same batch under the new params: Delta_traj and the LLD rate. Both sides
   of Delta_traj run the model in float32 (`lld_logp`): with a bfloat16 compute dtype, the pre-update side is one
   more forward before the updates (small updates would otherwise leave bfloat16 log-probs unchanged: ties);
5. every metric fetched from the device once, at the end.

The learning rate follows the reference code: linear warmup from 0 counted in rollout batches
(`lr = base * step / warmup_steps`, the first batch at lr 0), then constant; it is fixed within a batch.

`RLTrainStep.abstract_programs` names every program of the above at abstract arguments (llds_jax/programs.py's
`CompilablePrograms`), for `--mode=compile`: `train_on_batch` and it read one list of the programs
(`_batch_programs`).
"""
import contextlib
import dataclasses
import functools
import math
import time
import warnings
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from llds_jax.model.transformer import compute_weights
from llds_jax.programs import AbstractProgram, CompilablePrograms, Role
from llds_jax.rl.batch import RolloutBatch
from llds_jax.rl.batch_layout import BatchLayout, LaidOutBatch, PreparedBatch
from llds_jax.config.sections import ObjectiveConfig, UpdateConfig
from llds_jax.rl.diagnostics import DISPLACEMENT_METRICS, likelihood_metrics, lld_metrics, update_metrics
from llds_jax.rl.logprobs import model_token_logp
from llds_jax.rl.losses import objective_loss
from llds_jax.rl.packing import PackedRows, unpack
from llds_jax.rl.terms import LossInputs, batch_statistics


class TrainState(NamedTuple):
    """What changes from step to step.

    Attributes:
      params: trainable parameters (nnx.State of the model's nnx.Param variables).
      opt_state: optax state.
      step: int32 scalar, rollout batches trained on (drives the learning-rate schedule).
      nonfinite_count: int32 scalar, updates skipped because the loss or gradient was not finite.
    """

    params: nnx.State
    opt_state: optax.OptState
    step: jax.Array
    nonfinite_count: jax.Array


@dataclasses.dataclass(frozen=True)
class TrainShapes:
    """What `RLTrainStep.abstract_programs` lowers the programs at: a rollout batch of `num` trajectories of
    `length` tokens (packed: the worst case, one row per trajectory), with the LLD measurement's programs when
    `measure_lld`."""

    num: int
    length: int
    measure_lld: bool


class BatchMetrics(NamedTuple):
    """Metrics of one rollout batch, on the host.

    Attributes:
      scalars: name -> float: means over updates (plus `actor/grad_norm_max`); those of `DISPLACEMENT_METRICS`
        (0 by construction on update 0) over updates 1..U-1, left out when the batch makes a single update;
        pre-update likelihood metrics,
        seconds of the frozen log-probs (`perf/logp_s`) and of the updates (`perf/update_s`), the padding share of
        the rows the forwards run on (`perf/padding`), seconds compiling the packed-row counts of a new batch
        length ahead (`perf/compile_rows_s`), post-update LLD metrics when measured.
      per_update: name -> [U] array, one value per optimizer update (mean over its micro-batches).
      delta_traj_b: [B] Delta_traj per trajectory when `measure_lld`, else None.
    """

    scalars: dict[str, float]
    per_update: dict[str, np.ndarray]
    delta_traj_b: np.ndarray | None


def learning_rate(step: jax.Array, cfg: UpdateConfig) -> jax.Array:
    """`base * min(step / warmup_steps, 1)` (constant `base` without warmup); step counts rollout batches."""
    if cfg.warmup_steps == 0:
        return jnp.float32(cfg.learning_rate)
    return cfg.learning_rate * jnp.minimum(jnp.asarray(step, jnp.float32) / cfg.warmup_steps, 1.0)


def make_optimizer(cfg: UpdateConfig) -> optax.GradientTransformation:
    """clip_by_global_norm then AdamW, the learning rate an injected hyperparameter set per rollout batch."""

    def build(learning_rate):
        return optax.chain(
            optax.clip_by_global_norm(cfg.max_grad_norm),
            optax.adamw(learning_rate, b1=cfg.adam_b1, b2=cfg.adam_b2, eps=cfg.adam_eps,
                        weight_decay=cfg.weight_decay),
        )

    return optax.inject_hyperparams(build)(learning_rate=0.0)


def _with_learning_rate(opt_state, lr):
    return opt_state._replace(hyperparams={**opt_state.hyperparams, "learning_rate": lr})


def _copier(tree, dtype=None):
    """The jitted copy of `tree` (optionally cast) into new buffers laid out like it."""
    shardings = jax.tree.map(lambda x: x.sharding, tree)
    copy = lambda x: jnp.copy(x if dtype is None else x.astype(dtype))  # noqa: E731
    return jax.jit(lambda t: jax.tree.map(copy, t), out_shardings=shardings)


def _fresh_copy(tree, dtype=None):
    """New buffers holding `tree` (optionally cast), laid out like it: never aliases what the updates donate."""
    return _copier(tree, dtype)(tree)


def _flat(x: jax.Array) -> jax.Array:
    """[U, X, micro, ...] -> [B, ...]."""
    return x.reshape((-1,) + x.shape[3:])


def _float32_compute(cfg):
    """A model config computing in float32 (cuDNN attention, half precision only, gives way to "auto")."""
    return dataclasses.replace(cfg, dtype="float32", attention="auto" if cfg.attention == "cudnn" else cfg.attention)


def _likelihood_metrics(old_logp_uxbt: jax.Array, batch: LaidOutBatch) -> dict[str, jax.Array]:
    """`likelihood_metrics` of a laid-out batch (a trajectory is correct when its reward is > 0)."""
    flat = batch.flat()
    return likelihood_metrics(_flat(old_logp_uxbt), flat.loss_mask_bt, flat.action_ids_bt, flat.rewards_b > 0,
                              flat.sampler_logp_bt)


def _lld_metrics(new_logp_uxbt: jax.Array, old_logp_uxbt: jax.Array, batch: LaidOutBatch
                 ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """`lld_metrics` of a laid-out batch: ([B] Delta_traj, metrics)."""
    flat = batch.flat()
    return lld_metrics(_flat(new_logp_uxbt), _flat(old_logp_uxbt), flat.loss_mask_bt, flat.rewards_b > 0)


def _update_means(per_update: dict[str, np.ndarray]) -> dict[str, float]:
    """Each per-update metric's mean over a batch's U updates; a displacement metric's (`DISPLACEMENT_METRICS`) over
    updates 1..U-1, none with U = 1."""
    return {key: float(np.mean(values[1:] if key in DISPLACEMENT_METRICS else values))
            for key, values in per_update.items() if key not in DISPLACEMENT_METRICS or len(values) > 1}


def _step_scalars(stacked: dict[str, np.ndarray], total_skips, prepared: PreparedBatch,
                  real_tokens: float) -> dict[str, float]:
    """The step's actor/ scalars of the updates' stacked metrics [U] (`_update_means`, the largest gradient norm,
    the non-finite updates skipped in the step and in the run) and perf/padding: the share of the forwards' tokens
    (of the laid-out batch, or of its packed rows) that are not the batch's `real_tokens`."""
    scalars = _update_means(stacked)
    scalars["actor/grad_norm_max"] = float(np.max(stacked["actor/grad_norm"]))
    scalars["actor/nonfinite"] = float(np.sum(stacked["actor/nonfinite"]))
    scalars["actor/nonfinite_total"] = float(total_skips)
    scalars["actor/updates"] = float(prepared.num_updates)
    forward_tokens = (math.prod(prepared.batch.tokens_uxbt.shape) if prepared.rows is None
                      else sum(math.prod(rows.tokens_rt.shape) for rows in prepared.rows))
    scalars["perf/padding"] = 1.0 - real_tokens / forward_tokens
    return scalars


class RLTrainStep(CompilablePrograms[TrainShapes]):
    """GRPO + KL + entropy + LLDS updates of a model on rollout batches (jitted; sharded when given a mesh); its
    programs at abstract arguments: `abstract_programs` (`programs.CompilablePrograms`).

    Usage:
      step = RLTrainStep(model, ObjectiveConfig(), UpdateConfig(...), mesh=mesh)
      state = step.init_state()
      ref_params = step.reference_params(state.params)
      state, metrics = step.train_on_batch(state, ref_params, batch)
      model = step.to_model(state.params)

    Args:
      model: a llds_jax.model.Transformer (`hidden(tokens, mask)`, `unembedding()`, `cfg.dtype`), its parameters
        already placed (e.g. by `hf_io.load_model(path, mesh=mesh)`); its nnx.Param variables are trained.
      objective: loss coefficients.
      update: mini/micro-batching and optimizer.
      mesh: optional (data, fsdp, tensor) mesh: batches are split over (data, fsdp), the vocabulary of the log-probs
        over tensor, and the model runs under `jax.set_mesh(mesh)`.
      segmented: its batches carry segments (`RolloutBatch.segment_first_bt`: rollout.context_policy other than
        none), which its abstract programs then take.
    """

    def __init__(self, model: nnx.Module, objective: ObjectiveConfig, update: UpdateConfig, mesh: Mesh | None = None,
                 segmented: bool = False):
        self.graphdef, self._params, self._rest = nnx.split(model, nnx.Param, ...)
        self._compute_dtype = model.cfg.dtype
        self.objective = objective
        self.update_cfg = update
        self.mesh = mesh
        self.layout = BatchLayout(update, mesh, segmented)
        self.optimizer = make_optimizer(update)
        self._logp = jax.jit(self._logp_impl, out_shardings=self.layout.sharding(4))
        # The LLD measurement's forwards run in float32: with a float32 model they are those of `sequence_logp`.
        self._lld_in_float32 = jnp.dtype(model.cfg.dtype) != jnp.float32
        self._logp_float32 = jax.jit(functools.partial(self._logp_impl, float32_compute=True),
                                     out_shardings=self.layout.sharding(4))
        self._likelihood = jax.jit(_likelihood_metrics)
        self._lld = jax.jit(_lld_metrics)
        self._update = None  # jitted on first use, with the state's shardings as output shardings
        self._concat_updates = jax.jit(lambda parts: jnp.concatenate(parts), out_shardings=self.layout.sharding(4))
        self._precompiled_lengths: set[int] = set()  # batch lengths whose row counts `compile_row_counts` did

    # ----- state ---------------------------------------------------------------------------------------------------
    def init_state(self, params: nnx.State | None = None) -> TrainState:
        """A fresh state: `params` (default: the model's) and a zero optimizer state laid out like them."""
        params = _fresh_copy(self._params if params is None else params)  # updates donate the state's buffers
        init = self._init_optimizer(params)
        with self._mesh_context():
            opt_state = init(params)
        # Committed (to the mesh, or to the device) as the updates' outputs are: the same program signature.
        placement = self._replicated() or jax.devices()[0]
        step, nonfinite_count = (jax.device_put(np.int32(0), placement) for _ in range(2))  # distinct buffers
        return TrainState(params=params, opt_state=opt_state, step=step, nonfinite_count=nonfinite_count)

    def _init_optimizer(self, params: nnx.State):
        """The jitted optimizer init, its state laid out like `params` (concrete or abstract, with shardings)."""
        param_shardings = jax.tree.map(lambda x: x.sharding, params)
        abstract = jax.eval_shape(self.optimizer.init, params)
        replicated = self._replicated()
        opt_shardings = optax.tree_map_params(
            self.optimizer, lambda _, sharding: sharding, abstract, param_shardings,
            transform_non_params=lambda _: replicated)
        return jax.jit(self.optimizer.init, out_shardings=opt_shardings)

    def abstract_state(self) -> TrainState:
        """`init_state()` as ShapeDtypeStructs with their shardings: nothing is allocated (the model may be abstract,
        e.g. built with `nnx.eval_shape` and placed on a deviceless TPU topology's mesh)."""
        params = self._params
        opt_state = self._init_optimizer(params).eval_shape(params)
        scalar = jax.ShapeDtypeStruct((), jnp.int32, sharding=self._replicated())
        return TrainState(params=params, opt_state=opt_state, step=scalar, nonfinite_count=scalar)

    def reference_params(self, params: nnx.State) -> nnx.State:
        """A frozen copy of `params` for the KL reference, in `optim.reference_dtype`, laid out like `params`."""
        return self._reference_copier(params)(params)

    def abstract_reference(self, params: nnx.State) -> nnx.State:
        """`reference_params(params)` as ShapeDtypeStructs with their shardings (`params` may be abstract)."""
        return self._reference_copier(params).eval_shape(params)

    def _reference_copier(self, params: nnx.State):
        return _copier(params, jnp.dtype(self.update_cfg.reference_dtype))

    def to_model(self, params: nnx.State) -> nnx.Module:
        """The model with `params` (e.g. to hand new weights to the sampler)."""
        return nnx.merge(self.graphdef, params, self._rest)

    # ----- batch ---------------------------------------------------------------------------------------------------
    def prepare_batch(self, batch: RolloutBatch) -> PreparedBatch:
        """Checks a rollout batch (`RolloutBatch.checked`), computes the loss terms' batch statistics and lays it out
        on the device(s) (`BatchLayout.lay_out`).

        Warns when LLDS is on and the batch makes a single optimizer update (LLDS would be exactly zero).
        """
        batch = batch.checked()
        num_updates = self.layout.shape(batch.num_trajectories)[0]
        if self.objective.llds.enabled and num_updates == 1:
            warnings.warn("LLDS is on but there is one optimizer update per rollout batch: logp == old_logp on the "
                          "first update, so LLDS is exactly zero; use optim.mini_batch_size < the batch size",
                          stacklevel=2)
        return self.layout.lay_out(batch, batch_statistics(batch, self.objective))

    def batch_spec(self, num: int, length: int, num_rows: int | None = None) -> PreparedBatch:
        """The abstract `prepare_batch` result of a rollout batch of `num` trajectories of `length` tokens, for
        ahead-of-time compilation (`BatchLayout.spec`)."""
        stat_names = list(batch_statistics(RolloutBatch.zeros(1, 1), self.objective))
        return self.layout.spec(num, length, stat_names, num_rows)

    def _replicated(self):
        return None if self.mesh is None else NamedSharding(self.mesh, P())

    def _mesh_context(self):
        return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    # ----- jitted pieces -------------------------------------------------------------------------------------------
    def _token_logp(self, params, tokens_bt, mask_bt, rows: PackedRows | None, float32_compute: bool = False):
        """(logp, entropy) [micro, T] of one micro-batch's trajectories: a forward over the trajectories, or over
        their packed rows (`rows`, one micro-batch's) brought back to the trajectories' layout. `float32_compute`:
        the model computes in float32 whatever its compute dtype."""
        model = nnx.merge(self.graphdef, params, self._rest)
        if float32_compute:
            model.cfg = _float32_compute(model.cfg)
        logp = functools.partial(model_token_logp, model, temperature=self.objective.temperature,
                                 time_chunk=self.update_cfg.logp_time_chunk, mesh=self.mesh)
        if rows is None:
            return logp(tokens_bt, mask_bt)
        logp_rt, entropy_rt = logp(rows.tokens_rt, rows.mask_rt, segment_first_bt=rows.segment_first_rt)
        return unpack(logp_rt, rows.source_bt), unpack(entropy_rt, rows.source_bt)

    def _logp_impl(self, params, tokens_uxbt, mask_uxbt, rows: PackedRows | None, index,
                   float32_compute: bool = False):
        """Forward-only logp of update `index`'s mini-batch of a laid-out batch, one micro-batch at a time, on the
        update's packed rows (`rows`, [1, X, R, T'] arrays) or on its trajectories. [1, X, micro, T]."""
        take = functools.partial(jax.lax.dynamic_slice_in_dim, start_index=index, slice_size=1, axis=0)
        tokens_1xbt, mask_1xbt = take(tokens_uxbt), take(mask_uxbt)
        flat = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), (tokens_1xbt, mask_1xbt, rows))
        logp_xbt = jax.lax.map(lambda xs: self._token_logp(params, *xs, float32_compute=float32_compute)[0], flat)
        return logp_xbt.reshape(tokens_1xbt.shape)

    def sequence_logp(self, params: nnx.State, prepared: PreparedBatch, program: Callable | None = None
                      ) -> jax.Array:
        """logp of every token of a prepared batch under `params` (no gradient) by `program`, a jitted
        `_logp_impl` (default the policy's, `_logp`), one call per update's mini-batch. [U, X, micro, T]."""
        program = self._logp if program is None else program
        batch = prepared.batch
        with self._mesh_context():
            return self._concat_updates(tuple(
                program(params, batch.tokens_uxbt, batch.mask_uxbt, prepared.update_rows(u), jnp.int32(u))
                for u in range(prepared.num_updates)))

    def _micro_loss(self, params, micro: RolloutBatch, rows: PackedRows | None, old_logp_bt, ref_logp_bt,
                    batch_stats, first_update):
        logp_bt, entropy_bt = self._token_logp(params, micro.tokens_bt, micro.mask_bt, rows)
        # The first update runs on the very parameters old_logp came from, so logp == old_logp exactly; take old_logp's
        # value (gradient unchanged) so that recomputation noise cannot open LLDS gates or move the ratio off 1.
        logp_bt = jnp.where(first_update, old_logp_bt + (logp_bt - jax.lax.stop_gradient(logp_bt)), logp_bt)
        inputs = LossInputs(
            logp_bt=logp_bt, entropy_bt=entropy_bt, old_logp_bt=old_logp_bt, ref_logp_bt=ref_logp_bt,
            advantages_b=micro.advantages_b, loss_mask_bt=micro.loss_mask_bt, action_ids_bt=micro.action_ids_bt,
            answer_mask_bt=micro.answer_mask_bt, batch_stats=batch_stats,
            sampler_logp_bt=micro.sampler_logp_bt if self.objective.tis_cap else None,
            segment_first_bt=micro.segment_first_bt)
        loss, terms = objective_loss(inputs, self.objective)
        metrics = {f"loss/{name}": value for name, value in terms.items()}
        metrics.update(update_metrics(inputs, self.objective))
        return loss, metrics

    def _update_impl(self, state: TrainState, batch: LaidOutBatch, rows: PackedRows | None, batch_stats, old_logp,
                     ref_logp, index):
        """One optimizer update on mini-batch `index` of a laid-out batch, its forwards on `rows`, that update's
        packed rows ([1, X, R, T'] arrays), or on its trajectories (None).

        Update 0 must run on the parameters old_logp was computed with (train_on_batch guarantees it).
        """
        micro_x = batch.micro_batches(index)
        take = functools.partial(jax.lax.dynamic_index_in_dim, index=index, axis=0, keepdims=False)
        rows_x = jax.tree.map(lambda x: x[0], rows)
        old_x = take(old_logp)
        ref_x = None if ref_logp is None else take(ref_logp)
        grad_fn = jax.value_and_grad(self._micro_loss, has_aux=True)
        # Each micro-batch's gradient with respect to the weights cast once to the compute dtype: in bfloat16 it is
        # held in bfloat16 (as the paper's FSDP mixed precision holds it) and summed in float32.
        params_c = compute_weights(state.params, self._compute_dtype)

        def accumulate(grad_sum, xs):
            micro, micro_rows, old_bt, ref_bt = xs
            (loss, metrics), grads = grad_fn(params_c, micro, micro_rows, old_bt, ref_bt, batch_stats, index == 0)
            return jax.tree.map(lambda total, g: total + g.astype(total.dtype), grad_sum, grads), (loss, metrics)

        zeros = jax.tree.map(jnp.zeros_like, state.params)
        grad_sum, (loss_x, metrics_x) = jax.lax.scan(accumulate, zeros, (micro_x, rows_x, old_x, ref_x))
        num_micro = loss_x.shape[0]
        grads = jax.tree.map(lambda g: g / num_micro, grad_sum)
        loss = jnp.mean(loss_x)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

        lr = learning_rate(state.step, self.update_cfg)
        opt_state = _with_learning_rate(state.opt_state, lr)
        updates, new_opt_state = self.optimizer.update(grads, opt_state, state.params)
        new_params = optax.apply_updates(state.params, updates)
        keep = functools.partial(jax.tree.map, lambda new, old: jnp.where(finite, new, old))
        new_state = TrainState(
            params=keep(new_params, state.params),
            opt_state=keep(new_opt_state, state.opt_state),
            step=state.step,
            nonfinite_count=state.nonfinite_count + (~finite).astype(jnp.int32),
        )
        metrics = {name: jnp.mean(value) for name, value in metrics_x.items()}
        metrics.update({"actor/loss": loss, "actor/grad_norm": grad_norm, "actor/lr": lr,
                        "actor/nonfinite": (~finite).astype(jnp.float32)})
        return new_state, metrics

    def _jitted_update(self, state: TrainState):
        if self._update is None:
            shardings = jax.tree.map(lambda x: x.sharding, state)
            self._update = jax.jit(self._update_impl, donate_argnums=0, out_shardings=(shardings, self._replicated()))
        return self._update

    # ----- the programs of a batch ---------------------------------------------------------------------------------
    def _batch_programs(self, state: TrainState, with_reference: bool, measure_lld: bool) -> dict[Role, Callable]:
        """The one list of the jitted programs `train_on_batch` runs on a batch, by role, in the order a run first
        runs them: `train_on_batch` calls them from it and `_programs` lowers them (so --mode=compile compiles
        exactly what a step runs). The reference's log-probs only `with_reference`; the LLD measurement's programs
        only when `measure_lld`, its float32 forward only with a model that does not compute in float32 (else its
        log-probs are the policy's program's)."""
        programs = {Role.REFERENCE_LOGP: self._logp} if with_reference else {}
        programs.update({Role.POLICY_LOGP: self._logp, Role.LIKELIHOOD_METRICS: self._likelihood})
        if measure_lld and self._lld_in_float32:
            programs[Role.LLD_LOGP] = self._logp_float32
        programs[Role.UPDATE] = self._jitted_update(state)
        if measure_lld:
            programs[Role.LLD_METRICS] = self._lld
        return programs

    # ----- ahead of time ------------------------------------------------------------------------------------------
    def abstract_programs(self, at: TrainShapes) -> list[AbstractProgram]:
        """Every program `init_state`, `reference_params` and `train_on_batch` run, at abstract values
        (`abstract_state()`, `abstract_reference` of its params, `batch_spec`) of a batch of `at.num` trajectories
        of `at.length` tokens; see `_programs`."""
        state = self.abstract_state()
        ref_params = self.abstract_reference(state.params) if self.objective.kl_coef else None
        return self._programs(state, ref_params, self.batch_spec(at.num, at.length), at.measure_lld)

    def _programs(self, state: TrainState, ref_params: nnx.State | None, prepared: PreparedBatch,
                  measure_lld: bool) -> list[AbstractProgram]:
        """The programs of `abstract_programs` at `state`, `ref_params` (None: no reference) and `prepared` (arrays
        or abstract values), each with its role in `train_on_batch`, in the order a run first runs them (the
        log-probs: one update's mini-batch, as each call computes it)."""
        batch = prepared.batch
        rows = prepared.update_rows(0)
        # The log-probs come out of a jitted program: committed to a device also without a mesh.
        logp_sharding = self.layout.sharding(4) or jax.sharding.SingleDeviceSharding(jax.devices()[0])
        logp = jax.ShapeDtypeStruct(batch.tokens_uxbt.shape, jnp.float32, sharding=logp_sharding)
        index = jax.ShapeDtypeStruct((), jnp.int32, sharding=self._replicated())  # as an int32 under the mesh
        shapes = f"{batch.num_trajectories} x {batch.length} tokens, micro-batch {batch.micro_batch_size}"
        program = functools.partial(AbstractProgram, shapes=shapes, mesh=self.mesh)
        tokens_mask = (batch.tokens_uxbt, batch.mask_uxbt)
        args = {  # each role's arguments in `train_on_batch`
            Role.REFERENCE_LOGP: (ref_params, *tokens_mask, rows, index),
            Role.POLICY_LOGP: (state.params, *tokens_mask, rows, index),
            Role.LIKELIHOOD_METRICS: (logp, batch),
            Role.LLD_LOGP: (state.params, *tokens_mask, rows, index),
            Role.UPDATE: (state, batch, rows, prepared.batch_stats, logp, None if ref_params is None else logp, index),
            Role.LLD_METRICS: (logp, logp, batch),
        }
        programs = [program(Role.OPTIMIZER_INIT, fn=self._init_optimizer(state.params), args=(state.params,))]
        if ref_params is not None:
            programs.append(program(Role.REFERENCE_COPY, fn=self._reference_copier(state.params),
                                    args=(state.params,)))
        return programs + [
            program(role, fn=fn, args=args[role],
                    detail=f"{prepared.num_updates} per step" if role is Role.UPDATE else "")
            for role, fn in self._batch_programs(state, ref_params is not None, measure_lld).items()]

    def compile_row_counts(self, state: TrainState, ref_params: nnx.State | None, num: int, length: int,
                           measure_lld: bool) -> int:
        """Compiles ahead, without running them, the log-probs and the update at every packed-row count a batch of
        `num` trajectories of `length` tokens can need (`BatchLayout.row_counts`), so that no later batch of that
        length compiles (as the sampler's shape grid). Returns the programs compiled."""
        modules = set()  # the reference's log-probs are the policy's program when both have the same dtypes
        for num_rows in self.layout.row_counts(length):
            for program in self._programs(state, ref_params, self.batch_spec(num, length, num_rows), measure_lld):
                if program.role in (Role.REFERENCE_LOGP, Role.POLICY_LOGP, Role.LLD_LOGP, Role.UPDATE):
                    lowered = program.lower()
                    module = lowered.as_text()
                    if module not in modules:
                        modules.add(module)
                        lowered.compile()
        return len(modules)

    # ----- the step ------------------------------------------------------------------------------------------------
    def train_on_batch(
        self, state: TrainState, ref_params: nnx.State | None, batch: RolloutBatch, *, measure_lld: bool = False,
        between_updates: Callable[[], None] | None = None,
    ) -> tuple[TrainState, BatchMetrics]:
        """All updates of one rollout batch (see the module docstring).

        Args:
          state: the train state (donated: use the returned one).
          ref_params: frozen reference parameters (`reference_params`); None only when objective.kl_coef == 0.
          batch: the rollout batch, its rewards and advantages set.
          measure_lld: recompute logp after the updates and report Delta_traj / LLD rate / tie share (one extra
            forward; two with a bfloat16 compute dtype, both in float32).
          between_updates: called once each update but the last has run on the device (the loop then waits for
          each update before starting the next); what it raises ends the batch, with `state` donated already.

        Returns:
          (new state, metrics fetched to the host).
        """
        if ref_params is None and self.objective.kl_coef:
            raise ValueError("ref_params is required when objective.kl_coef > 0")
        prepared = self.prepare_batch(batch)
        compile_rows_s = self._precompile_rows(state, ref_params, prepared, batch, measure_lld)
        run = self._batch_programs(state, ref_params is not None, measure_lld)
        start = time.perf_counter()
        old_logp = self.sequence_logp(state.params, prepared, run[Role.POLICY_LOGP])
        ref_logp = None if ref_params is None else self.sequence_logp(ref_params, prepared, run[Role.REFERENCE_LOGP])
        jax.block_until_ready((old_logp, ref_logp))  # once per batch: times the frozen log-probs apart
        logp_s = time.perf_counter() - start
        before = run[Role.LIKELIHOOD_METRICS](old_logp, prepared.batch)
        # The float32 log-probs before the updates (taken before the updates donate the state): old_logp itself when
        # the model computes in float32 (no LLD_LOGP program: the same program on the same parameters), else one
        # float32 forward.
        lld_logp = run.get(Role.LLD_LOGP, run[Role.POLICY_LOGP])
        lld_old_logp = None
        if measure_lld:
            lld_old_logp = self.sequence_logp(state.params, prepared, lld_logp) if Role.LLD_LOGP in run else old_logp
        state, per_update = self._run_updates(state, prepared, run[Role.UPDATE], old_logp, ref_logp, between_updates)
        after, delta_traj_b = {}, None
        if measure_lld:
            delta_traj_b, after = run[Role.LLD_METRICS](self.sequence_logp(state.params, prepared, lld_logp),
                                                       lld_old_logp, prepared.batch)
        before, per_update, after, delta_traj_b, total_skips = jax.device_get(
            (before, per_update, after, delta_traj_b, state.nonfinite_count))
        stacked = {key: np.stack([m[key] for m in per_update]) for key in per_update[0]}
        real_tokens = float(np.sum(np.asarray(batch.mask_bt) > 0))
        scalars = _step_scalars(stacked, total_skips, prepared, real_tokens)
        scalars["perf/logp_s"] = logp_s
        scalars["perf/compile_rows_s"] = compile_rows_s
        scalars["perf/update_s"] = time.perf_counter() - start - logp_s
        scalars.update({key: float(value) for key, value in {**before, **after}.items()})
        return state, BatchMetrics(scalars=scalars, per_update=stacked, delta_traj_b=delta_traj_b)

    def _precompile_rows(self, state: TrainState, ref_params: nnx.State | None, prepared: PreparedBatch,
                         batch: RolloutBatch, measure_lld: bool) -> float:
        """Compiles every packed-row count of the batch's length the first time a packed batch has that length
        (`update.precompile_row_counts`, `compile_row_counts`); returns the seconds it took (0.0: nothing
        compiled)."""
        length = batch.tokens_bt.shape[1]
        if prepared.rows is None or not self.update_cfg.precompile_row_counts or length in self._precompiled_lengths:
            return 0.0
        self._precompiled_lengths.add(length)
        start = time.perf_counter()
        self.compile_row_counts(state, ref_params, batch.num_trajectories, length, measure_lld)
        return time.perf_counter() - start

    def _run_updates(self, state: TrainState, prepared: PreparedBatch, update: Callable, old_logp: jax.Array,
                     ref_logp: jax.Array | None, between_updates: Callable[[], None] | None,
                     ) -> tuple[TrainState, list[dict[str, jax.Array]]]:
        """The batch's updates in order, `between_updates` called once each update but the last has run (see
        `train_on_batch`); returns the state with its step counted and each update's metrics (on the device)."""
        per_update = []
        with self._mesh_context():
            for index in range(prepared.num_updates):
                if index and between_updates is not None:
                    jax.block_until_ready(per_update[-1])
                    between_updates()
                state, metrics = update(state, prepared.batch, prepared.update_rows(index), prepared.batch_stats,
                                        old_logp, ref_logp, jnp.int32(index))
                per_update.append(metrics)
        return state._replace(step=state.step + 1), per_update
