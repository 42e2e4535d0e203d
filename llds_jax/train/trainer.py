"""The training loop: prompts -> n rollouts each -> rewards -> GRPO + LLDS updates -> metrics, eval, checkpoints.

One `Trainer` per process. Everything it needs comes from the typed run config (`RunConfig`, which the launch
builds once); what the launch records of it is saved as `<run_dir>/config.json`. A run folder is resumed automatically from its latest complete
checkpoint; the metrics of every saved step are on disk before its checkpoint is (a resume drops those of later
steps, so the log holds each step once).

Stopping (SIGTERM / SIGINT, docs/reliability.md): the signal is read between the rollout's sessions, between
updates and at the end of each step (`train.stop_within_step`; else only at the end). At the end of a step that step
is saved; in the middle of one, the state from before it (a copy in host memory taken as the step starts) is saved
with the data position that replays the step, so the resumed run equals an uninterrupted one. Either way the run
ends with exit status 0. The watchdog (llds_jax.train.watchdog) ends a run whose retriever keeps failing (saved the
same way, exit status 2) or whose updates are all skipped.

Several hosts (processes): the updates run on the GLOBAL mesh (every device of the job; params and optimizer state
sharded over it). Rollouts are host-local: each host samples its own slice of the step's prompts (PromptIterator)
on a mesh of its own devices, with a host-local copy of the current params laid out as `rollout.tensor_parallel`
says (`llds_jax.rollout.layout`: tensor parallelism over the host's chips, or the training layout), and calls its
own retriever. Sequence ids are global (`agent.RolloutRequest.first_sequence`), so the hosts together sample what one
process would. The hosts' trajectories are then packed to one agreed length and gathered into the global
training batch on every host (`global_batch`); `train_on_batch` places it on the global mesh. Rollout metrics
are combined over the hosts (`combine_over_processes`). With one process nothing is gathered: the rollout uses the
training mesh and, with `rollout.params_dtype` the params' own dtype, the very same param arrays (training layout),
or its own tensor-parallel copy on a mesh of the same devices.

`rollout.params_dtype` (e.g. bfloat16 on float32 master weights): the rollout's params are cast once per rollout
(`layout.cast_params`, on the training mesh, before any gather: the host-local copy is half the size), and the
rollout engine's step programs run on those arrays; old / reference / policy log-probs and the updates use the
training params.

`rollout.partial` (llds_jax/rollout/partial.py): each step starts ceil(rollout.over_sampling x prompts) groups,
carried ones first, trains the first complete ones and carries the rest (`self.carry`). Each host carries its own
groups and draws its own fresh prompts, so its carry and its data position are its own record in every checkpoint
(the `hosts` item, llds_jax/train/checkpoint.py); a step that ends early saves the carry from before it with its
data position.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, Optional, Sequence

import jax
import numpy as np
from etils import epath
from flax import nnx
from jax.experimental import multihost_utils

from llds_jax.bounds import ConfigError
from llds_jax.config.sections import RetrieverConfig, RunConfig
from llds_jax.runtime import distributed, storage
from llds_jax.train import run_builder
from llds_jax.data.iterator import PromptIterator
from llds_jax.data.qa import QAExample, read_qa
from llds_jax.rl.advantages import ADVANTAGES
from llds_jax.rl.batch import RolloutBatch
from llds_jax.rl.train_step import BatchMetrics, TrainState, learning_rate
from llds_jax.rollout import agent
from llds_jax.rollout.agent import PartialRequest, RolloutRequest
from llds_jax.rollout.config import AgentConfig, PartialConfig
from llds_jax.rollout.layout import rollout_params
from llds_jax.rollout.partial import Carry, StepPlan, plan_step
from llds_jax.rollout.trajectory import Trajectory
from llds_jax.search.factory import make_retriever
from llds_jax.search.types import Retriever, RetrieverUnavailableError
from llds_jax.model.tokenizer import load_tokenizer
from llds_jax.train import evaluation, run_config
from llds_jax.train.batching import global_batch, global_rows, padded_batch, padded_length, training_length
from llds_jax.train.checkpoint import Checkpointer, rng_from_json, rng_to_json
from llds_jax.train.metrics import MetricsWriter
from llds_jax.train.preemption import ABANDON_EVALUATION, PreemptionGuard, StepInterrupted, StopRequested
from llds_jax.train.rewards import named_rewards, summed_rewards
from llds_jax.train.step_hooks import FinishedStep, StepContext, step_hooks
from llds_jax.train.watchdog import Watchdog, search_counts

log = logging.getLogger(__name__)
START_EVAL = "start"  # eval/<this>/ holds the evaluation of the starting policy (train.eval_at_start)


@dataclasses.dataclass
class PreStep:
    """What a step that ends early saves: the step before it (`step`) and the data position that replays it.

    `unsaved`: that step is not in the checkpoint folder yet (step 0, the run's start, never needs saving: a rerun
    reproduces it). `copy`: a host copy of its state (`host_copy`), taken when a stop between updates, after the
    state was donated, may need it; else None. `carry`: the partial rollouts' carried groups before the step."""

    step: int
    data: dict
    unsaved: bool
    copy: Optional[TrainState]
    carry: Carry


def host_copy(tree):
    """`tree`'s arrays copied to pinned host memory with the same shardings (each host holds its own shards). The
    copy runs in the background; an update that donates the arrays waits for it."""
    return jax.tree.map(lambda x: jax.device_put(x, x.sharding.with_memory_kind("pinned_host")), tree)


def read_examples(files: Sequence[str], what: str, empty_answer: str, max_prompt_tokens: int) -> list[QAExample]:
    """QA examples of several files, uids made unique across files (`empty_answer`: `reward.empty_answer`, which
    decides whether rows no non-empty answer can match are kept; `max_prompt_tokens`: rollout.max_prompt_tokens,
    which bounds the questions; data.qa.read_qa)."""
    if not files:
        raise ConfigError(f"data.{what} lists no files")
    examples = []
    for index, path in enumerate(files):
        if not epath.Path(path).exists():
            raise FileNotFoundError(f"data.{what}: file not found: {path}")
        examples += [dataclasses.replace(ex, uid=f"{index}:{ex.uid}")
                     for ex in read_qa(path, empty_answer, max_prompt_tokens)]
    return examples


# Rollout metrics that add up over hosts: the decode rate and the budget's counts (agent.Rollout).
HOST_SUMMED_METRICS = ("sampled_tokens", "sampled_tokens_per_s", "prompt_tokens", "prompts_cut", "observation_tokens",
                       "searches", "preemptions",
                       "trajectories", "bad_documents", "forked_prefix_tokens",
                       # partial rollouts' counts (rollout/partial.py)
                       "partial/dropped", "partial/resumed", "partial/reprefill_tokens", "partial/groups_started",
                       "partial/carried", "partial/carried_groups", "partial/dropped_group_size")
# One trajectory's most of the batch (trajectory.rollout_metrics): the job's is the hosts' largest.
HOST_MAX_METRICS = ("turns_max", "valid_searches_max", "context_tokens_max")


def combine_over_processes(metrics: dict[str, float], summed: Sequence[str] = HOST_SUMMED_METRICS,
                           maxed: Sequence[str] = HOST_MAX_METRICS) -> dict[str, float]:
    """Rollout metrics of the whole job (the same keys on every host): the `summed` ones added up over the hosts,
    the `maxed` ones their largest, the others averaged (with equal host batches a host's batch mean averages to
    the global batch mean; seconds become the hosts' mean). A collective."""
    if jax.process_count() == 1:
        return metrics
    keys = sorted(metrics)
    gathered = np.asarray(multihost_utils.process_allgather(np.asarray([metrics[k] for k in keys], np.float32)))
    # [processes, keys]
    combine = lambda k, column: column.sum() if k in summed else column.max() if k in maxed else column.mean()
    return {k: float(combine(k, gathered[:, i])) for i, k in enumerate(keys)}


def open_retriever(retriever_cfg: RetrieverConfig, runner: asyncio.Runner) -> Retriever:
    """The configured retriever once its check passed; closed again when the check raises (its
    RetrieverUnavailableError names backend and address)."""
    retriever = make_retriever(retriever_cfg)
    try:
        runner.run(retriever.check())
    except BaseException:
        runner.run(retriever.close())
        raise
    return retriever


class Trainer:
    """Builds every component of a run from its config; `run()` trains, `evaluate()` evaluates.

    The rewards of a step's trajectories are summed (`reward.functions`, llds_jax.train.rewards; exact match by
    default); after each step its hooks run, in order (`train.hooks` among them, llds_jax.train.step_hooks)."""

    def __init__(self, config: RunConfig, recorded: Mapping[str, Any], *, training: bool = True):
        """`config`: the run's typed config (built once by the launch, `checks.validate`, its mesh checked on this
        job's devices, `checks.check_mesh`); `recorded`: what the run folder's config.json records of it
        (`llds_jax.config.recorded`)."""
        self.config, self.recorded = config, recorded
        self.reward_fns = named_rewards(config.reward.functions)
        self.step_hooks = step_hooks(config.train.hooks)
        self.run_dir = epath.Path(config.run_dir)
        self.is_main = distributed.is_main_process()
        self.tokenizer = load_tokenizer(config.model.tokenizer_path or config.model.path,
                                        fallback_chat_template=config.model.chat_template)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        # From the config alone, before any weight is read: a layout the model cannot take fails fast.
        layout = run_builder.run_layout(config)
        self.mesh, self.layout = layout.mesh, layout.rollout
        parts = run_builder.build(config, layout, run_builder.load_model(config, layout),
                                  agent.turn_stop_ids(self.tokenizer))
        self.rl_train_step, self.sampler, self.eval_sampler = parts.step, parts.sampler, parts.eval_sampler
        self._advantages = jax.jit(ADVANTAGES[config.objective.advantages])
        self.agent_cfg = AgentConfig.of(config.rollout)
        self.partial_cfg = PartialConfig.of(config.rollout)
        self.carry = Carry()  # the partial rollouts' groups carried into the next step
        self.eval_agent_cfg = AgentConfig.of(config.rollout, config.eval)
        rule = config.reward.empty_answer
        prompt_tokens = config.rollout.max_prompt_tokens
        self.eval_examples = (read_examples(config.data.eval_files, "eval_files", rule, prompt_tokens)
                              if config.data.eval_files else [])
        if training:
            self.data = PromptIterator(read_examples(config.data.train_files, "train_files", rule, prompt_tokens),
                                       batch_size=config.data.prompts_per_step, seed=config.seed,
                                       process_index=jax.process_index(), process_count=jax.process_count())
        # Last: nothing below raises, so an open retriever always reaches `close` (unclosed client sessions are
        # reported at exit).
        self.runner = asyncio.Runner()
        try:
            self.retriever = open_retriever(config.retriever, self.runner)
        except BaseException:  # e.g. StopRequested in the middle of the check: no task of it outlives the runner
            self.runner.close()
            raise
        self.base_rng = jax.random.key(config.seed)
        self._lengths: set[int] = set()  # training batch lengths used so far
        self.watchdog = Watchdog(search_failure_rate=config.rollout.search_failure_rate,
                                 max_failed_search_steps=config.rollout.max_failed_search_steps,
                                 max_skipped_updates=config.optim.max_skipped_updates)

    # ----- pieces of a step ----------------------------------------------------------------------------------------
    def rollout_params(self, params: nnx.State) -> nnx.State:
        """`params` (on the training mesh) as the rollout samples with them (`llds_jax.rollout.layout`): in
        `rollout.params_dtype`, on the rollout mesh. Called once per rollout, so every session and decode chunk of
        it runs on the same arrays. A collective with several processes. The training params are not changed: the
        trainer's log-probs and updates keep using them."""
        return rollout_params(self.layout, params, self.config.rollout.params_dtype)

    def rollout(self, params, prompts: Sequence[QAExample], rng: jax.Array,
                between_sessions: Optional[Callable[[], None]] = None,
                stopping: Optional[Callable[[], bool]] = None, version: int = 0,
                plan: Optional[StepPlan] = None) -> agent.Rollout:
        """n samples of each of this host's prompts through the agent loop (the samples of the step's prompt i,
        numbered over every host, form GRPO group i: `Lineage.group`); sequence ids count from this host's first
        row of the global batch. `between_sessions` and `stopping`: as for `agent.RolloutRequest`; `version`: the step.
        A partial step (`plan`, rollout.partial) runs the plan's groups instead of `prompts` and trains its first
        `plan.prompts` complete ones (this host's groups numbered from its first of the global batch)."""
        n = self.config.data.samples_per_prompt
        examples = plan.examples if plan is not None else [ex for ex in prompts for _ in range(n)]
        partial = (None if plan is None else
                   PartialRequest(plan, first_group=jax.process_index() * plan.prompts,
                                  max_staleness=self.partial_cfg.max_staleness))
        request = RolloutRequest(examples, rng, self.agent_cfg, group_size=n,
                                 first_sequence=jax.process_index() * len(examples), version=version,
                                 partial=partial, between_sessions=between_sessions, stopping=stopping)
        return agent.rollout(self.sampler, self.rollout_params(params), self.tokenizer, self.retriever, request,
                             runner=self.runner)

    def step_rollout(self, params, step: int, between_sessions: Optional[Callable[[], None]] = None,
                     stopping: Optional[Callable[[], bool]] = None) -> agent.Rollout:
        """Step `step`'s rollout: of the next prompts, or with rollout.partial of the step's plan (`plan_step`: the
        carried groups first, fresh prompts up to the over-sampling), its carry kept for the next step."""
        rng = jax.random.fold_in(self.base_rng, step)
        if not self.partial_cfg.partial:
            return self.rollout(params, next(self.data), rng, between_sessions, stopping, version=step)
        plan = plan_step(self.carry, lambda: next(self.data), self.partial_cfg, self.data.batch_size //
                         jax.process_count(), self.config.data.samples_per_prompt, step)
        rollout = self.rollout(params, (), rng, between_sessions, stopping, version=step, plan=plan)
        if not rollout.stopped:
            self.carry = rollout.carry
        return rollout

    def stop_check(self, guard: Optional[PreemptionGuard], phase: str) -> Optional[Callable[[], None]]:
        """A function that raises StepInterrupted(phase) when a stop was requested on any host (a collective), or
        None when stops wait for the end of the step (no guard, or train.stop_within_step off)."""
        if not self.stops_within_step(guard):
            return None

        def check() -> None:
            if guard.should_stop():
                raise StepInterrupted(phase)

        return check

    def stops_within_step(self, guard: Optional[PreemptionGuard]) -> bool:
        """Whether a stop request cuts the step short (a guard and train.stop_within_step): its searches in flight
        are then abandoned."""
        return guard is not None and self.config.train.stop_within_step

    def check_searches(self, trajectories: Sequence[Trajectory]) -> None:
        """The watchdog's count of the step's failed searches (over every host; a collective)."""
        counts = combine_over_processes(search_counts(trajectories), summed=("searches", "search_failures"))
        errors = [error for t in trajectories for error in t.retriever_errors]
        self.watchdog.check_searches(counts, errors[-1] if errors else None)

    def train_step(self, state: TrainState, ref_params, step: int, guard: Optional[PreemptionGuard] = None
                   ) -> tuple[TrainState, dict[str, float], list[Trajectory]]:
        """One rollout batch and its updates: rollout -> rewards -> advantages -> update -> metrics. Returns the new
        state, the step's metrics and this host's trajectories.

        With a `guard`, raises StepInterrupted when a stop is requested between sessions or updates (see the
        module docstring); RetrieverUnavailableError comes before the updates when the watchdog ends the run."""
        start = time.perf_counter()
        in_rollout = self.stop_check(guard, "rollout")
        rollout = self.step_rollout(state.params, step, between_sessions=in_rollout,
                                    stopping=(lambda: guard.requested) if self.stops_within_step(guard) else None)
        rollout_s = time.perf_counter() - start
        shape_metrics = self.after_rollout(rollout.trajectories, step, rollout_s, in_rollout)
        rewards_b, reward_means = summed_rewards(self.reward_fns, rollout.trajectories, self.config.reward)
        batch = self.training_batch(rollout.trajectories).with_rewards(rewards_b)
        batch = global_batch(batch)  # every host's rows, on every host
        tree_b = global_rows(np.asarray([t.lineage.tree for t in rollout.trajectories], np.int32))
        advantages_b = self._advantages(batch.rewards_b, batch.group_b, tree_b)
        batch = batch.with_advantages(np.asarray(advantages_b))
        lld_every = self.config.train.lld_every
        state, batch_metrics = self.rl_train_step.train_on_batch(
            state, ref_params, batch, measure_lld=bool(lld_every) and step % lld_every == 0,
            between_updates=self.stop_check(guard, "updates"))
        self.watchdog.count_updates(batch_metrics.per_update["actor/nonfinite"])
        metrics = self.step_metrics(step, rollout, batch, batch_metrics, time.perf_counter() - start, rollout_s)
        if reward_means:  # several rewards: each one's mean over the job
            metrics.update({f"reward/{name}": v for name, v in combine_over_processes(reward_means, ()).items()})
        return state, {**metrics, **shape_metrics}, rollout.trajectories

    def after_rollout(self, trajectories: Sequence[Trajectory], step: int, rollout_s: float,
                      in_rollout: Optional[Callable[[], None]]) -> dict[str, float]:
        """Between the rollout and the updates: a stop check (first: a stopped rollout holds no trajectories), the
        watchdog's count of failed searches, and the step programs of every token bucket compiled after the first
        rollout (`rollout.compile_grid`; `perf/compile_grid_s` when that compiled)."""
        if in_rollout is not None:
            in_rollout()
        self.check_searches(trajectories)
        log.info("step %d: %d trajectories sampled in %.1f s; updates next", step, len(trajectories), rollout_s)
        grid_start = time.perf_counter()
        if self.sampler.freeze_shapes(grid=self.config.rollout.compile_grid):  # later rollouts compile nothing
            return {"perf/compile_grid_s": time.perf_counter() - grid_start}
        return {}

    def training_batch(self, trajectories: Sequence[Trajectory]) -> RolloutBatch:
        """This host's trajectories packed to the step's length (the same on every host: a collective; remembered
        for the resume), each in its GRPO group (`Lineage.group`); with a context policy, each row its trajectory's
        segments (`batching.padded_batch`)."""
        length = training_length(padded_length(trajectories, self.config.train.sequence_bucket), self._lengths)
        self._lengths.add(length)
        return padded_batch(trajectories, self.pad_id, length, self.config.rollout.context_policy != "none")

    def step_metrics(self, step: int, rollout: agent.Rollout, batch: RolloutBatch, batch_metrics: BatchMetrics,
                     step_s: float, rollout_s: float) -> dict[str, float]:
        """The step's metrics: the rollout's (over every host), the reward, the updates', seconds and tokens/s."""
        job_rollout_metrics = combine_over_processes(rollout.metrics)
        job_rollout_metrics["reward"] = float(np.mean(batch.rewards_b, dtype=np.float64))
        tokens = float(batch.mask_bt.sum())
        metrics = {f"rollout/{k}": v for k, v in job_rollout_metrics.items()}
        metrics.update(batch_metrics.scalars)
        metrics.update({
            "reward/mean": job_rollout_metrics["reward"],
            "perf/step_s": step_s, "perf/rollout_s": rollout_s, "perf/retrieval_s": job_rollout_metrics["search_s"],
            "perf/tokens_per_s": tokens / step_s, "perf/sequence_length": float(batch.tokens_bt.shape[1]),
            "optim/learning_rate": float(learning_rate(step - 1, self.rl_train_step.update_cfg)),
        })
        return metrics

    def step_context(self) -> StepContext:
        """What the step hooks see of the run (llds_jax.train.step_hooks): the typed config, the run folder, the
        tokenizer, whether this process writes and the periodic evaluation (None without evaluation files)."""
        return StepContext(self.config, self.run_dir, self.tokenizer, self.is_main,
                           self._periodic_evaluation if self.eval_examples else None)

    def _periodic_evaluation(self, params, out_dir: epath.Path,
                             stopping: Optional[Callable[[], bool]]) -> dict[str, float]:
        """`evaluate` of the `train.eval_max_examples` subset (`eval_subset`), its files in `out_dir`."""
        return self.evaluate(params, self.eval_subset(self.config.train.eval_max_examples), out_dir, stopping=stopping)

    def eval_subset(self, size: int) -> list[QAExample]:
        """The evaluation questions of a `size` setting (`eval.max_examples`, `train.eval_max_examples`): a fixed
        subset stratified over data_source (`evaluation.stratified_subset`, seeded by `seed`); 0: all of them."""
        return evaluation.stratified_subset(self.eval_examples, size, self.config.seed)

    def evaluate(self, params, examples: Sequence[QAExample], out_dir: Optional[epath.Path] = None,
                 prefix: str = "eval", stopping: Optional[Callable[[], bool]] = None) -> dict[str, float]:
        """Greedy rollouts with eval.max_turns; EM and searches per question per data_source, and their unweighted
        means (`{prefix}/em_*`, `{prefix}/searches_*`).

        On several hosts every host evaluates every example on its own devices (same results; only process 0
        writes them). `stopping` (this host's stop request, as for `agent.RolloutRequest`): once true, the evaluation is
        abandoned with StepInterrupted("evaluation")."""
        trajectories = []
        size = self.config.eval.batch_size
        params = self.rollout_params(params)
        for first in range(0, len(examples), size):
            request = RolloutRequest(list(examples[first:first + size]), self.base_rng, self.eval_agent_cfg,
                                     stopping=stopping)
            rollout = agent.rollout(self.eval_sampler, params, self.tokenizer, self.retriever, request,
                                    runner=self.runner)
            if rollout.stopped or (stopping is not None and stopping()):
                raise StepInterrupted("evaluation")
            trajectories += rollout.trajectories
        table = evaluation.em_table(trajectories, self.config.reward.empty_answer)
        searches = evaluation.searches_table(trajectories)
        if out_dir is not None and self.is_main:
            with storage.operation("writing evaluation results to", out_dir, self.config.train.storage_timeout_s):
                evaluation.write_results(out_dir, trajectories, table, searches, self.tokenizer,
                                         self.config.reward.empty_answer)
        return {**{f"{prefix}/em_{source}": value for source, value in table.items()},
                **{f"{prefix}/searches_{source}": value for source, value in searches.items()}}

    # ----- the loop ------------------------------------------------------------------------------------------------
    def run(self, guard: Optional[PreemptionGuard] = None) -> int:
        """Trains until train.total_steps (or a stop signal); returns the last completed step.

        `guard`: the command's PreemptionGuard (in abort mode until the loop starts: a stop while restoring or
        evaluating the start raises StopRequested); without one the run installs its own."""
        with contextlib.ExitStack() as stack:
            if guard is None:
                guard = stack.enter_context(PreemptionGuard())
            return self._run(guard)

    def _run(self, guard: PreemptionGuard) -> int:
        """The step loop: restore, the start's evaluation, then each step with its hooks (`step_hooks`) and its
        save, until the last step or a stop; returns the last step run."""
        config = self.config
        timeout_s = config.train.storage_timeout_s
        ckpt = Checkpointer(str(self.run_dir / "checkpoints"), save_every=config.train.checkpoint_every,
                            keep=config.train.keep_checkpoints, timeout_s=timeout_s)
        try:
            self._write_run_config(ckpt.latest_step() or 0)
        except BaseException:
            ckpt.close()
            raise
        state = self.rl_train_step.init_state()
        ref_params = self.rl_train_step.reference_params(state.params) if config.objective.kl_coef else None
        state, start = self._restore(ckpt, state)
        # A fresh run that evaluates its start rewrites step 0's record too (the first attempt may have written it).
        first_record = start + 1 if start or not config.train.eval_at_start else 0
        writer = MetricsWriter(str(self.run_dir), total_steps=config.train.total_steps, start_step=first_record,
                               timeout_s=timeout_s)
        step = saved = start
        try:
            if start == 0 and config.train.eval_at_start and self.eval_examples:
                self._evaluate_start(state, writer, guard)
            guard.defer()
            for step in range(start + 1, config.train.total_steps + 1):
                unsaved = step - 1 > saved
                pre_step = PreStep(step - 1, self.data.state(), unsaved,
                                   host_copy(state) if unsaved and config.train.stop_within_step else None, self.carry)
                try:
                    state, metrics, trajectories = self.train_step(state, ref_params, step, guard)
                except StepInterrupted as stop:  # between updates `state` is donated already: save the copy
                    self._save_pre_step(ckpt, writer, pre_step, pre_step.copy if stop.phase == "updates" else state)
                    log.warning("stop requested during the %s of step %d: saved the state before it, exiting",
                                stop.phase, step)
                    step -= 1
                    break
                except RetrieverUnavailableError as e:  # raised before the updates: `state` is the pre-step one
                    self._save_pre_step(ckpt, writer, pre_step, state)
                    raise RetrieverUnavailableError(f"{e}; the run is saved before step {step}: the same "
                                                    f"command resumes there") from None
                del pre_step
                stopping = (lambda: guard.requested) if self.stops_within_step(guard) else None
                finished = FinishedStep(self.step_context(), step, state, metrics, trajectories, writer, stopping)
                for hook in self.step_hooks:
                    hook(finished)
                self.watchdog.check_updates(state.params, step)
                stop = guard.should_stop()
                if stop or ckpt.should_save(step) or step == config.train.total_steps:
                    self._save(ckpt, writer, step, state, self.data.state(), self.carry)
                    saved = step
                if stop:
                    log.warning("stop requested: saved step %d, exiting", step)
                    break
        except BaseException:  # the first error is the one to report: closing must not replace it
            for close in (ckpt.close, writer.close):
                with contextlib.suppress(Exception):
                    close()
            raise
        ckpt.close()
        writer.close()
        self.final_params = state.params
        return step

    def _write_run_config(self, latest: int) -> None:
        """The run config, secrets redacted, as `config.json` of the run folder (by the main process; a resume from
        step `latest` with changed keys keeps the earlier config and says so: llds_jax.train.run_config). A folder
        whose latest checkpoint is past `train.total_steps` is a ConfigError: nothing would train."""
        total = self.config.train.total_steps
        if latest > total:
            raise ConfigError(
                f"run folder {self.run_dir} holds a checkpoint of step {latest}, past train.total_steps = {total}: "
                "raise train.total_steps to train on, or start a new run with another --config.run_dir")
        if self.is_main:
            with storage.operation("writing the run config to", self.run_dir, self.config.train.storage_timeout_s):
                self.run_dir.mkdir(parents=True, exist_ok=True)
                changed = run_config.record(self.run_dir, self.recorded, latest)
            if changed:
                print(run_config.notice(self.run_dir, latest, changed), file=sys.stderr, flush=True)

    def _check_meta(self, meta: dict, host_meta: Optional[dict]) -> None:
        """Raises ValueError, KeyError or TypeError when a checkpoint's records cannot be resumed from (a data
        position, the rng, the counter or this host's carry missing or out of range): the checkpointer then falls
        back to the step before."""
        self.data.check(meta["data"])
        rng_from_json(meta["rng"])
        int(meta["nonfinite_count"])
        if host_meta is not None:
            self.data.check(host_meta["data"])
            Carry.from_json(host_meta["partial"])

    def _restore(self, ckpt: Checkpointer, state: TrainState) -> tuple[TrainState, int]:
        """`state` from the run folder's latest checkpoint, with the data order, the random stream and the
        training lengths it saved, and its step; `(state, 0)` unchanged when there is none."""
        restored = ckpt.restore_latest(state.params, state.opt_state, check_meta=self._check_meta)
        if restored is None:
            return state, 0
        start = restored.step
        self.base_rng = rng_from_json(restored.meta["rng"])
        self._lengths = set(restored.meta.get("lengths", ()))  # the resumed steps pad as the first attempt did
        if restored.host_meta is not None:
            self.data.restore(restored.host_meta["data"])
            self.carry = Carry.from_json(restored.host_meta["partial"])
        else:
            self.data.restore(restored.meta["data"])
            self.carry = Carry()
            if restored.host_count and self.partial_cfg.partial:
                log.warning("the checkpoint of step %d was saved by %d processes and is resumed by %d: the hosts' "
                            "carried partial-rollout groups are dropped, the prompts resume at process 0's position",
                            restored.step, restored.host_count, jax.process_count())
        if self.carry.groups and not self.partial_cfg.partial:
            log.warning("the checkpoint of step %d carries %d partial-rollout group(s); rollout.partial is off: "
                        "they are dropped", restored.step, len(self.carry.groups))
            self.carry = Carry()
        state = state._replace(
            params=restored.params, opt_state=restored.opt_state,
            step=jax.device_put(np.int32(start), state.step.sharding),
            nonfinite_count=jax.device_put(np.int32(restored.meta["nonfinite_count"]), state.nonfinite_count.sharding))
        print(f"llds_jax: resumed from step {start} of {self.run_dir}", file=sys.stderr, flush=True)
        return state, start

    def _evaluate_start(self, state: TrainState, writer: MetricsWriter, guard: PreemptionGuard) -> None:
        """The evaluation of the starting policy (train.eval_at_start) as step 0's record; a stop request abandons
        it and ends the run with StopRequested (nothing to save: a rerun repeats it)."""
        guard.defer(ABANDON_EVALUATION)
        try:
            writer.write(0, self.evaluate(state.params, self.eval_subset(self.config.eval.max_examples),
                                          self.run_dir / "eval" / START_EVAL, stopping=lambda: guard.requested))
        except StepInterrupted:
            raise StopRequested(guard.signal_name, "the evaluation of the start") from None

    def _save(self, ckpt: Checkpointer, writer: MetricsWriter, step: int, state: TrainState,
              data_state: dict, carry: Carry) -> None:
        """Saves `step` (`state`, the data position and the partial rollouts' carry after it, the rng); the metrics
        written so far reach the disk first, so that every saved step's metrics are in the log."""
        writer.flush()
        meta = {"data": data_state, "rng": rng_to_json(self.base_rng), "lengths": sorted(self._lengths),
                "nonfinite_count": int(jax.device_get(state.nonfinite_count))}
        ckpt.save(step, state.params, state.opt_state, meta, host_meta={"data": data_state, "partial": carry.to_json()})

    def _save_pre_step(self, ckpt: Checkpointer, writer: MetricsWriter, pre_step: PreStep,
                       state: TrainState) -> None:
        """Saves `state`, the state from before an unfinished step, unless that step is saved already."""
        if pre_step.unsaved:
            self._save(ckpt, writer, pre_step.step, state, pre_step.data, pre_step.carry)

    def close(self) -> None:
        self.runner.run(self.retriever.close())
        self.runner.close()
