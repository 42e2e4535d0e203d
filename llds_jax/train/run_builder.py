"""One run's parts from its validated config, built in one place for the trainer (the loaded model's arrays) and
the compile check (abstract arrays: shapes and shardings, no weight read), so that neither repeats the other:

    layout = run_layout(run)                        # from the config alone: the meshes and the architecture
    model = load_model(run, layout)                 # the checkpoint's weights on the training mesh
    parts = build(run, layout, model, stop_ids)     # the train step and the training and evaluation samplers

`run` is the typed run config (`llds_jax.config.sections.RunConfig`).

With `devices` (a deviceless TPU topology's), `run_layout` lays the run out as the job on those devices would, the
rollout on the first host's chips (every host's layout is alike); `abstract_model` is the model to build on then.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Optional

import jax
from flax import nnx
from jax.sharding import Mesh

from llds_jax.config import ConfigError
from llds_jax.config.sections import RunConfig, pool_pages
from llds_jax import parallel
from llds_jax.model import ModelConfig, Transformer, from_hf_config, hf_io, preset, run_overrides
from llds_jax.rl.train_step import RLTrainStep
from llds_jax.rollout.config import AgentConfig, KernelTiles, PagingConfig, SamplingConfig
from llds_jax.rollout.layout import RolloutLayout, make_layout
from llds_jax.rollout.engine import EngineConfig
from llds_jax.rollout.paged_sampler import PagedSampler, engine_config
from llds_jax.rollout.runner import PagePool, pool_shape


@dataclasses.dataclass(frozen=True)
class RunLayout:
    """Where a run's programs run: the training `mesh` (every device of the job), the run's architecture
    (`model_cfg`, attention decided for the devices' platform) and this host's `rollout` layout
    (`llds_jax.rollout.layout`)."""
    mesh: Mesh
    model_cfg: ModelConfig
    rollout: RolloutLayout


@dataclasses.dataclass(frozen=True)
class RunParts:
    """The programs' owners: the GRPO + LLDS train step, and the samplers of the training rollout and of the
    (greedy) evaluation, which share the rollout's graph, mesh and page pool."""
    step: RLTrainStep
    sampler: PagedSampler
    eval_sampler: PagedSampler


def model_config(run: RunConfig, platform: str) -> ModelConfig:
    """The run's architecture without its weights: `model.preset`, else `config.json` in `model.path`; the run's
    numerics (`model` section) on top, attention decided for `platform` (the devices', not JAX's CPU backend when
    compiling for a TPU)."""
    m = run.model
    overrides = dict(run_overrides(m), attention_platform=platform)
    if m.preset:
        return preset(m.preset, **overrides)
    try:
        return from_hf_config(hf_io.read_config(m.path), **overrides)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"model.path: {e} (set model.preset to compile without the checkpoint)") from None


def run_layout(run: RunConfig, devices: Optional[Sequence[Any]] = None,
               local: Optional[Sequence[Any]] = None) -> RunLayout:
    """The layout of a run of `run` on `devices` (default: this job's, the rollout on this process's chips; given:
    the rollout on `local`, default the first host's). Reads no weight, so a layout the model cannot take fails
    before any load."""
    if devices is None:
        devices, local = jax.devices(), jax.local_devices()
    elif local is None:
        first_host = min(d.process_index for d in devices)
        local = [d for d in devices if d.process_index == first_host]
    mesh = parallel.make_mesh(run.mesh.data, run.mesh.fsdp, run.mesh.tensor, devices=devices)
    model_cfg = model_config(run, devices[0].platform)
    rollout = make_layout(run.rollout.tensor_parallel, model_cfg, mesh, local, run.mesh.tensor)
    return RunLayout(mesh, model_cfg, rollout)


def abstract_model(layout: RunLayout) -> Transformer:
    """The run's model with ShapeDtypeStructs for params, carrying their shardings on the training mesh."""
    model = nnx.eval_shape(lambda: Transformer(layout.model_cfg, rngs=nnx.Rngs(0)))
    nnx.update(model, parallel.abstract_params(nnx.state(model, nnx.Param), layout.mesh))
    return model


def load_model(run: RunConfig, layout: RunLayout) -> Transformer:
    """The run's model with the weights of `model.path` (checked against `model.preset` when set), on the
    training mesh."""
    m = run.model
    return hf_io.load_model(m.path, mesh=layout.mesh, preset=m.preset, **run_overrides(m),
                            attention_platform=layout.model_cfg.attention_platform)


def build(run: RunConfig, layout: RunLayout, model: Transformer, stop_ids: tuple[int, ...]
          ) -> RunParts:
    """The train step over `model` (loaded, or `abstract_model`) and the two samplers stopping a turn at
    `stop_ids` (the tokenizer's; a program's shapes do not depend on them)."""
    step = RLTrainStep(model, run.objective, run.optim, layout.mesh, segmented=run.rollout.context_policy != "none")
    graphdef = layout.rollout.graphdef(nnx.split(model)[0])
    check_pool(run, jax.process_count())
    shapes = rollout_shapes(run, jax.process_count(), stop_ids)
    largest = max((engine for _, engine in shapes), key=lambda engine: engine.num_pages)
    pool = PagePool(pool_shape(layout.rollout.model_cfg, largest, layout.rollout.mesh))  # shared: never run at once
    tiles = KernelTiles.of(run.rollout)
    return RunParts(step, *[PagedSampler(graphdef, layout.rollout.model_cfg, sampling, engine, layout.rollout.mesh,
                                         pool, tiles) for sampling, engine in shapes])


def rollout_shapes(run: RunConfig, process_count: int, stop_ids: tuple[int, ...] = ()
                   ) -> list[tuple[SamplingConfig, EngineConfig]]:
    """The sampling and the engine shapes of a host's training rollout, then of the evaluation (greedy): their
    sequence slots (`rollout.max_batch_size`, else all the sequences of a rollout call: the host's share of the
    step's conversations, `RunConfig.rollout_sequences`, or `eval.batch_size`) and the pool (`rollout.num_pages`, 0: every
    slot's worst case)."""
    paging = PagingConfig.of(run.rollout)
    shapes = []
    for evaluation, sequences in ((False, run.rollout_sequences(process_count)), (True, run.eval.batch_size)):
        agent = AgentConfig.of(run.rollout, run.eval if evaluation else None)
        sampling = SamplingConfig.of(run.rollout, stop_ids, greedy=evaluation)
        slots = run.engine_slots(sequences)
        shapes.append((sampling, engine_config(agent, sampling, slots, paging.page_size, paging.max_step_tokens,
                                               paging.num_pages)))
    return shapes


def check_pool(run: RunConfig, process_count: int) -> None:
    """Raises ConfigError naming rollout.num_pages when the pool cannot hold what a host's rollouts admit at once:
    the barrier and tree policies admit a whole session (every slot of the training rollout's engine or of the
    evaluation's, which share the pool) at its worst case, rollout.max_context_tokens each; the continuous policy
    admits what fits (the pool must hold one sequence: `RolloutConfig`)."""
    r = run.rollout
    if not r.num_pages or r.continuous_batching:
        return
    (_, train), (_, evaluation) = rollout_shapes(run, process_count)
    over_sampling = " x rollout.over_sampling" if r.partial else ""
    sessions = [(train, "training rollout", "tree" if r.trees else "barrier",
                 f"a host's data.prompts_per_step{over_sampling} x data.samples_per_prompt"),
                (evaluation, "evaluation", "barrier", "eval.batch_size")]
    engine, what, policy, source = max(sessions, key=lambda session: session[0].max_seqs)
    need = pool_pages(engine.max_seqs, engine.max_context, engine.page_size)
    if r.num_pages < need:
        source = "rollout.max_batch_size" if r.max_batch_size == engine.max_seqs else source
        raise ConfigError(f"rollout.num_pages ({r.num_pages}) cannot hold a session of the {policy} policy: the "
                          f"{what}'s {engine.max_seqs} sequences ({source}) at rollout.max_context_tokens "
                          f"({r.max_context_tokens}) need {engine.max_seqs} x {engine.pages_per_seq} pages of "
                          f"rollout.page_size {r.page_size} slots and the padding page, at least {need} (0: sized to "
                          "fit; or rollout.continuous_batching, which admits what fits)")
