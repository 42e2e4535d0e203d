"""A whole run config validated before anything heavy runs (launch, the trainer, `--mode=compile`).

`llds_jax.config` is on the lowest floors: it checks what the declarations say (schema, bounds, choices and the
combinations of the typed config). This module sits above the components a config names and checks it against them:
the registered implementations (`llds_jax.registry`: loss terms, advantage estimators, LLDS gates and answer
weightings, KL estimators, aggregations), the model presets, the retriever backend's options, the TPU topologies, the
local model folders and, once the device count is known, the mesh; and it loads the application the config's `app` key names
(llds_jax.application), whose sections and checks `config.check` adds. Every error is a `config.ConfigError`
naming the run-config key.
"""
from __future__ import annotations

import os

import ml_collections

from llds_jax import config as config_lib
from llds_jax import application, parallel, topologies
from llds_jax.runtime import gcs
from llds_jax.config import ConfigError
from llds_jax.model.config import PRESETS
from llds_jax.rl.advantages import ADVANTAGES
from llds_jax.rl.llds import ANSWER_WEIGHTINGS, GATES
from llds_jax.rl.losses import KL_ESTIMATORS  # (also registers the built-in loss terms, "llds" among them)
from llds_jax.rl.terms import AGGREGATIONS, LOSS_TERMS
from llds_jax.search.factory import resolve_config
from llds_jax.search.retry import RequestPolicy
from llds_jax.train.rewards import named_rewards
from llds_jax.train.step_hooks import step_hooks


def validate(cfg: ml_collections.ConfigDict, num_devices: int | None = None, typed: RunConfig | None = None
             ) -> RunConfig:
    """Everything a run cannot start with; each error names the run-config key. Returns the typed run config (a
    launch builds it here, once).

    Without `num_devices` (the launch command's check before anything runs, in the modes that read the checkpoint)
    the mesh is not checked, and the local folders of model.path and model.tokenizer_path must exist (except keys
    the application sets when the run starts); with it (`--mode=compile`, which compiles a model.preset without its
    checkpoint) the mesh is checked (`check_mesh`) and the folders are not. `typed`: the config's typed form where
    the caller built it already (`config.check`: the launch command checks the values before its heavy imports)."""
    run = check_components(cfg, typed)
    if num_devices is None:
        app = application.load(cfg)
        _check_model_folders(run, app.provided_keys(cfg) if app is not None else ())
    else:
        check_mesh(run, num_devices)
    return run


def check_components(cfg: ml_collections.ConfigDict, typed: RunConfig | None = None) -> RunConfig:
    """The config (`config.check`, with its application's sections and checks) against the components: loss terms
    and the other registered names (rewards and step hooks among them), retriever backends, model presets, TPU
    topologies. Returns the typed run config (`typed`, where given: `config.check`'s of `cfg`)."""
    run = typed if typed is not None else config_lib.check(cfg, application.load(cfg))
    for registry in (LOSS_TERMS, ADVANTAGES, GATES, ANSWER_WEIGHTINGS, KL_ESTIMATORS, AGGREGATIONS):
        config_lib.check_choice(cfg, registry.key, registry.names())
    named_rewards(run.reward.functions)  # registered names, none twice
    step_hooks(run.train.hooks)
    try:
        retriever = resolve_config(run.retriever)  # keys and types of the chosen backend
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if isinstance(retriever, RequestPolicy):
        _check_retry_budget(RequestPolicy.of(retriever), run.rollout.search_timeout_s)
    if run.model.preset and run.model.preset.lower() not in PRESETS:
        raise ConfigError(f"model.preset {run.model.preset!r} is not one of {sorted(PRESETS)}")
    if run.mesh.topology:
        try:
            topologies.resolve(run.mesh.topology)
        except topologies.TopologyError as e:
            raise ConfigError(f"mesh.topology: {e}") from None
    return run


def check_mesh(run: RunConfig, num_devices: int) -> None:
    """The device mesh of `run` on `num_devices` devices (the trainer's, or a compiled topology's)."""
    data, fsdp, tensor = parallel.mesh_shape(num_devices, run.mesh.data, run.mesh.fsdp, run.mesh.tensor)
    if run.model.mlp_chunks > 1 and tensor > 1:
        raise ConfigError(f"model.mlp_chunks = {run.model.mlp_chunks} slices the MLP width, which mesh.tensor = "
                          f"{tensor} shards: use one or the other")
    if run.optim.micro_batch_size % (data * fsdp):
        raise ConfigError(f"optim.micro_batch_size ({run.optim.micro_batch_size}) must be a multiple of the "
                          f"mesh's batch axes data x fsdp = {data * fsdp}")


def _check_retry_budget(policy: RequestPolicy, search_timeout_s: float) -> None:
    """A failing request must be able to give up (`RequestPolicy.worst_case_s`) before the rollout abandons the
    search (`rollout.search_timeout_s`); else every retry past that point is wasted and the error the rollout
    records is a bare timeout instead of the retriever's last error."""
    if policy.worst_case_s > search_timeout_s:
        raise ConfigError(f"retriever: a failing request retries for up to {policy.worst_case_s:g} s (timeout_s "
                          f"{policy.timeout_s:g} x {1 + policy.max_retries} attempts + backoff), longer than "
                          f"rollout.search_timeout_s = {search_timeout_s:g} s, when the rollout abandons the "
                          "search: raise rollout.search_timeout_s or lower retriever.timeout_s / "
                          "retriever.max_retries")


def _check_model_folders(run: RunConfig, provided: tuple[str, ...]) -> None:
    """The local folders that model.path and model.tokenizer_path name exist (a gs:// path's bucket is checked by
    the launcher, llds_jax.runtime.gcs; a key in `provided`, the application's, is set when the run starts)."""
    for key, path in (("model.path", run.model.path), ("model.tokenizer_path", run.model.tokenizer_path)):
        if path and key not in provided and not gcs.is_gcs(path) and not os.path.isdir(path):
            raise ConfigError(f"{key} {path}: {'not a folder' if os.path.exists(path) else 'no such folder'}")
