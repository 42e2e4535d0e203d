"""One run's parts from its validated config, built in one place for the trainer (the loaded model's arrays) and
the compile check (abstract arrays: shapes and shardings, no weight read), so that neither repeats the other:

    layout = run_layout(cfg)                        # from the config alone: the meshes and the architecture
    model = load_model(cfg, layout)                 # the checkpoint's weights on the training mesh
    parts = build(cfg, layout, model, stop_ids)     # the train step and the training and evaluation samplers

With `devices` (a deviceless TPU topology's), `run_layout` lays the run out as the job on those devices would, the
rollout on the first host's chips (every host's layout is alike); `abstract_model` is the model to build on then.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Optional

import jax
import ml_collections
from flax import nnx
from jax.sharding import Mesh

from llds_jax import config as config_lib
from llds_jax import parallel
from llds_jax.model import ModelConfig, Transformer, from_hf_config, hf_io, preset, run_overrides
from llds_jax.rl.train_step import RLTrainStep
from llds_jax.rollout.config import AgentConfig, KernelTiles, PagingConfig, SamplingConfig
from llds_jax.rollout.layout import RolloutLayout, make_layout
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


def model_config(cfg: ml_collections.ConfigDict, platform: str) -> ModelConfig:
    """The run's architecture without its weights: `model.preset`, else `config.json` in `model.path`; the run's
    numerics (`model` section) on top, attention decided for `platform` (the devices', not JAX's CPU backend when
    compiling for a TPU)."""
    m = cfg.model
    overrides = dict(run_overrides(m), attention_platform=platform)
    if m.preset:
        return preset(m.preset, **overrides)
    try:
        return from_hf_config(hf_io.read_config(m.path), **overrides)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"model.path: {e} (set model.preset to compile without the checkpoint)") from None


def run_layout(cfg: ml_collections.ConfigDict, devices: Optional[Sequence[Any]] = None) -> RunLayout:
    """The layout of a run of `cfg` on `devices` (default: this job's, the rollout on this process's chips; given:
    the rollout on the first host's). Reads no weight, so a layout the model cannot take fails before any load."""
    if devices is None:
        devices, local = jax.devices(), jax.local_devices()
    else:
        first_host = min(d.process_index for d in devices)
        local = [d for d in devices if d.process_index == first_host]
    mesh = parallel.make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, devices=devices)
    model_cfg = model_config(cfg, devices[0].platform)
    r = cfg.rollout
    rollout = make_layout(r.tensor_parallel, model_cfg, mesh, local, cfg.mesh.tensor)
    return RunLayout(mesh, model_cfg, rollout)


def abstract_model(layout: RunLayout) -> Transformer:
    """The run's model with ShapeDtypeStructs for params, carrying their shardings on the training mesh."""
    model = nnx.eval_shape(lambda: Transformer(layout.model_cfg, rngs=nnx.Rngs(0)))
    nnx.update(model, parallel.abstract_params(nnx.state(model, nnx.Param), layout.mesh))
    return model


def load_model(cfg: ml_collections.ConfigDict, layout: RunLayout) -> Transformer:
    """The run's model with the weights of `model.path` (checked against `model.preset` when set), on the
    training mesh."""
    m = cfg.model
    return hf_io.load_model(m.path, mesh=layout.mesh, preset=m.preset, **run_overrides(m),
                            attention_platform=layout.model_cfg.attention_platform)


def build(cfg: ml_collections.ConfigDict, layout: RunLayout, model: Transformer, stop_ids: tuple[int, ...]
          ) -> RunParts:
    """The train step over `model` (loaded, or `abstract_model`) and the two samplers stopping a turn at
    `stop_ids` (the tokenizer's; a program's shapes do not depend on them)."""
    typed_cfg = config_lib.typed(cfg)
    step = RLTrainStep(model, typed_cfg.objective, typed_cfg.optim, layout.mesh)
    graphdef = layout.rollout.graphdef(nnx.split(model)[0])
    paging = PagingConfig.of(typed_cfg.rollout)
    shapes = []
    for evaluation, sequences in ((False, config_lib.rollout_sequences(cfg, jax.process_count())),
                                  (True, cfg.eval.batch_size)):
        agent = AgentConfig.of(typed_cfg.rollout, typed_cfg.eval if evaluation else None)
        sampling = SamplingConfig.of(typed_cfg.rollout, stop_ids, greedy=evaluation)
        slots = min(sequences, agent.max_batch_size or sequences)
        shapes.append((sampling, engine_config(agent, sampling, slots, paging.page_size, paging.max_step_tokens,
                                               paging.num_pages)))
    largest = max((engine for _, engine in shapes), key=lambda engine: engine.num_pages)
    pool = PagePool(pool_shape(layout.rollout.model_cfg, largest, layout.rollout.mesh))  # shared: never run at once
    tiles = KernelTiles.of(typed_cfg.rollout)
    return RunParts(step, *[PagedSampler(graphdef, layout.rollout.model_cfg, sampling, engine, layout.rollout.mesh,
                                         pool, tiles) for sampling, engine in shapes])
