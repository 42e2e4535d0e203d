"""The hook through which an application built on the library (llds_jax.apps: the demo) joins a run.

A run config's `app` key names the application's module ("" for none; e.g. "llds_jax.apps.demo"). The library knows
nothing of any application: it imports the named module here, by name, and calls the functions below, which the
module must define.

    config_sections() -> {name: ConfigDict}   the run-config sections the app owns, at their defaults: the schema
                                              check (llds_jax.config.check) accepts them beside the library's; a
                                              config file adds them (`c.demo = ...`)
    check_config(cfg)                         its own bounds, choices and combinations (ConfigError naming the key)
    provided_keys(cfg) -> tuple[str, ...]     run-config keys that prepare_run sets, which the config may leave
                                              empty (the demo: model.path, pointed at its generated policy)
    paths(cfg) -> {key: path}                 its keys that name files or folders, for the launcher's checks
                                              (a gs:// path's bucket is checked before anything runs)
    prepare_run(cfg) -> {key: value}          called by `python -m llds_jax.launch` (and bench/step_profile.py) on
                                              every process after validation, before the warm start and the model;
                                              returns the keys it sets, dotted or a whole section, and their values,
                                              which the launch sets on its typed config (`config.with_values`; the
                                              demo: builds its assets and points the model, data, retriever and sft
                                              keys at them)
"""
from __future__ import annotations

import importlib
from types import ModuleType

import ml_collections

from llds_jax.config import ConfigError

PROTOCOL = ("config_sections", "check_config", "provided_keys", "paths", "prepare_run")


def load(cfg: ml_collections.ConfigDict) -> ModuleType | None:
    """The application module that `cfg.app` names, or None when it names none; ConfigError naming the `app` key
    when it cannot be imported or lacks a function of the protocol."""
    name = cfg.get("app", "")
    if not name:
        return None
    if not isinstance(name, str):
        raise ConfigError(f"config key 'app' must be str, got {type(name).__name__} {name!r}")
    try:
        module = importlib.import_module(name)
    except ImportError as e:
        raise ConfigError(f"app {name!r} cannot be imported: {e}") from None
    missing = [function for function in PROTOCOL if not callable(getattr(module, function, None))]
    if missing:
        raise ConfigError(f"app {name!r} is not an application module: it lacks {', '.join(missing)} "
                          f"(llds_jax.application)")
    return module
