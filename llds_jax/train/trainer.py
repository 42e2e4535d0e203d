"""The training loop: prompts -> n rollouts each -> rewards -> GRPO + LLDS updates -> metrics, eval, checkpoints.

One `Trainer` per process. Everything it needs comes from the run config (llds_jax.config); the resolved config is
printed and saved as `<run_dir>/config.json`. A run folder is resumed automatically from its latest complete
checkpoint; SIGTERM / SIGINT save a checkpoint and end the run with exit status 0.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from typing import Any, Optional, Sequence

import jax
import ml_collections
import numpy as np
from etils import epath
from flax import nnx

from llds_jax import config as config_lib
from llds_jax import distributed, parallel
from llds_jax.data.iterator import PromptIterator
from llds_jax.data.qa import QAExample, read_qa
from llds_jax.model import hf_io
from llds_jax.rl.train_step import RLTrainStep, TrainState
from llds_jax.rollout import agent
from llds_jax.rollout.sampler import Sampler
from llds_jax.rollout.trajectory import Trajectory, pack_trajectories
from llds_jax.search.factory import make_retriever
from llds_jax.tokenizer import load_tokenizer
from llds_jax.train import evaluation
from llds_jax.train.checkpoint import Checkpointer, rng_from_json, rng_to_json
from llds_jax.train.metrics import MetricsWriter
from llds_jax.train.preemption import PreemptionGuard

log = logging.getLogger(__name__)


def read_examples(files: Sequence[str], what: str) -> list[QAExample]:
    """QA examples of several files, uids made unique across files."""
    if not files:
        raise config_lib.ConfigError(f"data.{what} lists no files")
    examples = []
    for index, path in enumerate(files):
        if not epath.Path(path).exists():
            raise FileNotFoundError(f"data.{what}: file not found: {path}")
        examples += [dataclasses.replace(ex, uid=f"{index}:{ex.uid}") for ex in read_qa(path)]
    return examples


def training_batch(trajectories: Sequence[Trajectory], group_b: np.ndarray, pad_id: int,
                   bucket: int) -> dict[str, np.ndarray]:
    """The rollout batch dict of `RLTrainStep.train_on_batch`; lengths padded to a multiple of `bucket`."""
    packed = pack_trajectories(trajectories, pad_id=pad_id, pad_to_multiple=bucket)
    return {
        "tokens_bt": packed.tokens_bt, "mask_bt": packed.attn_mask_bt, "loss_mask_bt": packed.loss_mask_bt,
        "action_ids_bt": packed.action_ids_bt, "answer_mask_bt": packed.answer_mask_bt,
        "sampler_logp_bt": packed.sampler_logp_bt, "rewards_b": packed.rewards_b, "uids_b": group_b,
        "search_count_b": np.asarray([t.num_valid_searches for t in trajectories], np.float32),
    }


class Trainer:
    """Builds every component of a run from its config; `run()` trains, `evaluate()` evaluates."""

    def __init__(self, cfg: ml_collections.ConfigDict, *, training: bool = True):
        self.cfg = cfg
        config_lib.validate(cfg, jax.device_count())
        self.mesh = parallel.make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
        self.run_dir = epath.Path(cfg.run_dir)
        self.is_main = distributed.is_main_process()
        self.tokenizer = load_tokenizer(cfg.model.tokenizer_path or cfg.model.path,
                                        fallback_chat_template=cfg.model.chat_template)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        m = cfg.model
        model = hf_io.load_model(m.path, mesh=self.mesh, dtype=m.dtype, param_dtype=m.param_dtype,
                                 scan_layers=m.scan_layers, remat=m.remat)
        self.step_fn = RLTrainStep(model, config_lib.objective_config(cfg), config_lib.update_config(cfg), self.mesh)
        graphdef, _ = nnx.split(model)
        stop_ids = agent.turn_stop_ids(self.tokenizer)
        self.sampler = Sampler(graphdef, config_lib.sampling_config(cfg, stop_ids), self.mesh)
        self.eval_sampler = Sampler(graphdef, config_lib.sampling_config(cfg, stop_ids, evaluation=True), self.mesh)
        self.agent_cfg = config_lib.agent_config(cfg)
        self.eval_agent_cfg = config_lib.agent_config(cfg, evaluation=True)
        self.runner = asyncio.Runner()
        self.retriever = make_retriever(cfg.retriever)
        self.runner.run(self.retriever.check())
        self.eval_examples = read_examples(cfg.data.eval_files, "eval_files") if cfg.data.eval_files else []
        if training:
            self.data = PromptIterator(read_examples(cfg.data.train_files, "train_files"),
                                       batch_size=cfg.data.prompts_per_step, seed=cfg.seed,
                                       process_index=jax.process_index(), process_count=jax.process_count())
        self.base_rng = jax.random.key(cfg.seed)

    # ----- pieces of a step ----------------------------------------------------------------------------------------
    def rollout(self, params, prompts: Sequence[QAExample], rng: jax.Array) -> agent.Rollout:
        """n samples of each prompt through the agent loop (the samples of prompt i form group i)."""
        n = self.cfg.data.samples_per_prompt
        examples = [ex for ex in prompts for _ in range(n)]
        return agent.rollout(self.sampler, params, self.tokenizer, self.retriever, examples, rng, self.agent_cfg,
                             runner=self.runner)

    def train_step(self, state: TrainState, ref_params, step: int) -> tuple[TrainState, dict[str, float],
                                                                           list[Trajectory]]:
        """One rollout batch and its updates. Returns the new state, the step's metrics and its trajectories."""
        start = time.perf_counter()
        prompts = next(self.data)
        rng = jax.random.fold_in(self.base_rng, step)
        rollout = self.rollout(state.params, prompts, rng)
        rollout_s = time.perf_counter() - start
        n = self.cfg.data.samples_per_prompt
        group_b = np.repeat(np.arange(len(prompts), dtype=np.int32), n)
        batch = training_batch(rollout.trajectories, group_b, self.pad_id, self.cfg.train.sequence_bucket)
        lld_every = self.cfg.train.lld_every
        state, batch_metrics = self.step_fn.train_on_batch(state, ref_params, batch,
                                                           measure_lld=bool(lld_every) and step % lld_every == 0)
        step_s = time.perf_counter() - start
        tokens = float(batch["mask_bt"].sum())
        metrics = {f"rollout/{k}": v for k, v in rollout.metrics.items()}
        metrics.update(batch_metrics.scalars)
        metrics.update({
            "reward/mean": rollout.metrics["reward"],
            "perf/step_s": step_s, "perf/rollout_s": rollout_s, "perf/update_s": step_s - rollout_s,
            "perf/tokens_per_s": tokens / step_s, "perf/sequence_length": float(batch["tokens_bt"].shape[1]),
            "optim/learning_rate": float(self.step_fn_learning_rate(step)),
        })
        return state, metrics, rollout.trajectories

    def step_fn_learning_rate(self, step: int) -> float:
        from llds_jax.rl.train_step import learning_rate
        return float(learning_rate(step - 1, self.step_fn.update_cfg))

    def evaluate(self, params, examples: Sequence[QAExample], out_dir: Optional[epath.Path] = None,
                 prefix: str = "eval") -> dict[str, float]:
        """Greedy rollouts with eval.max_turns; EM per data_source and their unweighted mean."""
        trajectories = []
        size = self.cfg.eval.batch_size
        for first in range(0, len(examples), size):
            rollout = agent.rollout(self.eval_sampler, params, self.tokenizer, self.retriever,
                                    list(examples[first:first + size]), self.base_rng, self.eval_agent_cfg,
                                    runner=self.runner)
            trajectories += rollout.trajectories
        table = evaluation.em_table(trajectories)
        if out_dir is not None and self.is_main:
            evaluation.write_results(out_dir, trajectories, table, self.tokenizer)
        return {f"{prefix}/em_{source}": value for source, value in table.items()}

    # ----- the loop ------------------------------------------------------------------------------------------------
    def run(self) -> int:
        """Trains until train.total_steps (or a stop signal); returns the last completed step."""
        cfg = self.cfg
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.json").write_text(cfg.to_json_best_effort(indent=2))
        state = self.step_fn.init_state()
        ref_params = self.step_fn.reference_params(state.params) if cfg.objective.kl_coef else None
        ckpt = Checkpointer(str(self.run_dir / "checkpoints"), save_every=cfg.train.checkpoint_every,
                            keep=cfg.train.keep_checkpoints)
        start = 0
        restored = ckpt.restore_latest(state.params, state.opt_state)
        if restored is not None:
            start = restored.step
            self.data.restore(restored.meta["data"])
            self.base_rng = rng_from_json(restored.meta["rng"])
            state = state._replace(
                params=restored.params, opt_state=restored.opt_state,
                step=jax.device_put(np.int32(start), state.step.sharding),
                nonfinite_count=jax.device_put(np.int32(restored.meta["nonfinite_count"]),
                                               state.nonfinite_count.sharding))
            log.warning("resumed from step %d of %s", start, self.run_dir)
        writer = MetricsWriter(str(self.run_dir), total_steps=cfg.train.total_steps, start_step=start + 1)
        step = start
        try:
            with PreemptionGuard() as guard:
                for step in range(start + 1, cfg.train.total_steps + 1):
                    state, metrics, trajectories = self.train_step(state, ref_params, step)
                    if cfg.train.eval_every and step % cfg.train.eval_every == 0 and self.eval_examples:
                        subset = self.eval_examples[:cfg.train.eval_max_examples or None]
                        metrics.update(self.evaluate(state.params, subset,
                                                     self.run_dir / "eval" / f"step_{step}"))
                    writer.write(step, metrics)
                    if cfg.train.transcripts_every and step % cfg.train.transcripts_every == 0:
                        writer.write_texts(step, {
                            f"transcripts/{i}": evaluation.transcript_text(t, self.tokenizer)
                            for i, t in enumerate(trajectories[:cfg.train.num_transcripts])})
                    stop = guard.should_stop()
                    if stop or ckpt.should_save(step) or step == cfg.train.total_steps:
                        ckpt.save(step, state.params, state.opt_state, {
                            "data": self.data.state(), "rng": rng_to_json(self.base_rng),
                            "nonfinite_count": int(jax.device_get(state.nonfinite_count))})
                    if stop:
                        log.warning("stop requested: saved step %d, exiting", step)
                        break
        finally:
            ckpt.close()
            writer.close()
        self.final_params = state.params
        return step

    def close(self) -> None:
        self.runner.run(self.retriever.close())
        self.runner.close()
