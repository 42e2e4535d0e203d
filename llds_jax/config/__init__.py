"""Run configuration: the config built from its declarations (`llds_jax.config.sections`: one frozen dataclass per
section, each key declared once with its default, range or choices and doc), the schema check, the typed config.

`default_config()` is the schema, built from the declarations: a run config may change values, never add keys
(except the retriever backend's options, which each backend declares and checks, `llds_jax.search.options`, and
the sections of the application its `app` key names, llds_jax.application) or change a value's type. `check`
constructs the typed config (`typed`), whose sections check their keys' ranges and their own combinations and whose
`RunConfig` checks the combinations across sections; every error names the run-config key. `table()` is the README's
config table (`python -m llds_jax.config README.md` rewrites it; the retriever backends' blocks after it:
`python -m llds_jax.search README.md`).

On the lowest floors of the package: it imports only leaves and the declarations, so importing it loads no JAX.
`llds_jax.checks` (above the components) validates a whole run config against them.
"""
from __future__ import annotations

import dataclasses
import json
import re
import types
from collections.abc import Mapping, Sequence
from typing import Any

import ml_collections

from llds_jax import bounds
from llds_jax.runtime import redaction
from llds_jax.bounds import ConfigError
from llds_jax.config.sections import RetrieverConfig, RunConfig


def as_config_dict(instance: Any) -> ml_collections.ConfigDict:
    """The ConfigDict of a section instance (its declared keys, nested sections included), in declaration order."""
    c = ml_collections.ConfigDict()
    for f in bounds.declarations(type(instance)):
        value = getattr(instance, f.name)
        c[f.name] = as_config_dict(value) if "section" in f.metadata else value
    if isinstance(instance, RetrieverConfig):  # as given: the backend and its options, index_dir among them or not
        c = ml_collections.ConfigDict({"backend": instance.backend, **instance.options})
    return c


def _frozen(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def build(cls: type, values: ml_collections.ConfigDict) -> Any:
    """The section `cls` of a run config's (schema-checked) section `values` (`RunConfig`: the whole config, built
    with `RunConfig.of`): lists become tuples; the retriever's keys it does not declare are its backend's
    `options` (with index_dir where it gives one)."""
    kwargs = {}
    for f in bounds.declarations(cls):
        if f.name in values:
            value = values[f.name]
            kwargs[f.name] = build(f.metadata["section"], value) if "section" in f.metadata else _frozen(value)
    if cls is RetrieverConfig:
        kwargs["options"] = types.MappingProxyType({k: _frozen(v) for k, v in values.items() if k != "backend"})
    return cls.of(**kwargs) if cls is RunConfig else cls(**kwargs)


def with_values(run: RunConfig, values: Mapping[str, Any]) -> RunConfig:
    """`run` with some keys set, dotted ("model.path") or a whole section ("retriever": its mapping), each section
    rebuilt (its checks run again) and the run-owned fields set again: what an application's preparation and the
    warm start give a launch."""
    fields = {f.name: f for f in dataclasses.fields(RunConfig)}
    changed: dict[str, Any] = {}
    for key, value in values.items():
        name, _, rest = key.partition(".")
        if "section" not in fields[name].metadata:
            changed[name] = value
        elif rest:
            section = changed.setdefault(name, as_config_dict(getattr(run, name)))
            *inner, last = rest.split(".")
            for part in inner:  # a nested section's key ("objective.llds.variant")
                section = section[part]
            section[last] = value
        else:
            changed[name] = ml_collections.ConfigDict(dict(value))
    return run.replaced(**{name: build(fields[name].metadata["section"], value)
                           if "section" in fields[name].metadata else value for name, value in changed.items()})


def as_json(cfg: ml_collections.ConfigDict) -> dict[str, Any]:
    """`cfg` as a run folder's config.json holds it (secrets redacted)."""
    return json.loads(redacted(cfg).to_json_best_effort())


def whole(run: RunConfig, cfg: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """A launch's whole config: `run`'s keys (after the application's preparation and the warm start) and the
    application's sections as `cfg` gives them. Not redacted: print `redacted(...)`, record `recorded(...)`."""
    config = as_config_dict(run)
    for name in cfg:
        if name not in config:
            config[name] = cfg[name]
    return config


def recorded(run: RunConfig, cfg: ml_collections.ConfigDict) -> dict[str, Any]:
    """What the run folder's config.json records of a launch's run (`whole`, secrets redacted)."""
    return as_json(whole(run, cfg))


def default_config() -> ml_collections.ConfigDict:
    """The run config at its declared defaults: the schema."""
    return as_config_dict(RunConfig.of())


def typed(cfg: ml_collections.ConfigDict) -> RunConfig:
    """The typed run config of `cfg`, whose schema `check` has checked (`check_schema`); ConfigError naming the key
    of the first value out of its range or choices, or of the first combination a section or the run refuses."""
    return build(RunConfig, cfg)


def _rule_words(f: dataclasses.Field) -> str:
    if "choices" in f.metadata:
        return " / ".join('""' if c == "" else str(c) for c in f.metadata["choices"])
    return f.metadata["bound"].words if "bound" in f.metadata else ""


def table(cls: type = RunConfig, prefix: str = "") -> str:
    """The markdown table of the run-config keys `cls` declares (key, default, allowed values, doc), nested sections
    after the keys of their parent."""
    rows = ["| key | default | allowed | what it is |", "|---|---|---|---|"] if not prefix else []
    nested = []
    for f in bounds.declarations(cls):
        if "section" in f.metadata:
            nested.append(f)
            continue
        default = f.default if not isinstance(f.default, tuple) else ", ".join(f.default)
        default = '""' if default == "" else default
        rows.append(f"| `{prefix}{f.name}` | {default} | {_rule_words(f)} | {f.metadata['doc']} |")
    for f in nested:
        rows.append(table(f.metadata["section"], f"{prefix}{f.name}."))
    return "\n".join(rows)


TABLE_START = "<!-- config table: generated by `python -m llds_jax.config README.md` -->"
TABLE_END = "<!-- end of config table -->"


def with_table(text: str) -> str:
    """`text` (the README) with the part between TABLE_START and TABLE_END replaced by `table()`."""
    start, end = text.index(TABLE_START) + len(TABLE_START), text.index(TABLE_END)
    return f"{text[:start]}\n{table()}\n{text[end:]}"


_FREE_FORM = ("retriever",)  # sub-configs whose keys depend on a choice inside them


def _type_name(value: Any) -> str:
    return type(value).__name__


def schema(app: Any = None) -> ml_collections.ConfigDict:
    """The schema of a run config: `default_config()` and the sections of its application (`app`: the module
    `llds_jax.application.load` returns for the config's `app` key; None: no application)."""
    c = default_config()
    if app is not None:
        for name, section in app.config_sections().items():
            if name in c:
                raise ConfigError(f"app {app.__name__!r} declares the config section {name!r}, which is the "
                                  f"library's")
            c[name] = section
    return c


# Keys a run config may still set from an older release, and why they went (said in the unknown-key error).
_PAGED_ONLY = "the paged engine is now the only rollout engine"
REMOVED_KEYS = {
    "rollout.engine": _PAGED_ONLY,
    "rollout.min_capacity_bucket": f"{_PAGED_ONLY} (its pool: rollout.num_pages, rollout.page_size)",
    "rollout.min_observation_bucket": f"{_PAGED_ONLY} (observations go in its ragged steps: rollout.max_step_tokens)",
    "rollout.reuse_buckets": f"{_PAGED_ONLY}: its step programs are compiled once per token bucket "
                             "(rollout.compile_grid)",
    "rollout.extend_chunk": f"{_PAGED_ONLY} (observations go in its ragged steps: rollout.max_step_tokens)",
    "rollout.cache_block": f"{_PAGED_ONLY}: its attention reads a sequence's pages alone",
    "rollout.max_extend_rows": f"{_PAGED_ONLY} (observations go in its ragged steps: rollout.max_step_tokens)",
    "rollout.shared_prompt_prefill": f"{_PAGED_ONLY}: a GRPO group's samples share their prompt's pages",
}


def check_schema(cfg: ml_collections.ConfigDict, schema: ml_collections.ConfigDict | None = None,
                 prefix: str = "") -> None:
    """Raises ConfigError for a key the schema lacks or a value of another type (an int is a valid float)."""
    schema = default_config() if schema is None else schema
    for key, value in cfg.items():
        name = f"{prefix}{key}"
        if key not in schema:
            if name in REMOVED_KEYS:
                raise ConfigError(f"unknown config key {name!r}: removed, {REMOVED_KEYS[name]}")
            raise ConfigError(f"unknown config key {name!r} (known at this level: {', '.join(sorted(schema))})")
        expected = schema[key]
        if isinstance(expected, ml_collections.ConfigDict):
            if not isinstance(value, ml_collections.ConfigDict):
                raise ConfigError(f"config key {name!r} must be a section, got {_type_name(value)}")
            if key not in _FREE_FORM or prefix:
                check_schema(value, expected, name + ".")
            continue
        if isinstance(expected, (list, tuple)):  # the schema's only sequences are file lists
            if not (isinstance(value, (list, tuple)) and all(isinstance(path, str) for path in value)):
                raise ConfigError(f"{name} must be a tuple of paths (str), got {value!r}")
            continue
        ok = isinstance(value, type(expected)) or (isinstance(expected, float) and isinstance(value, int)
                                                    and not isinstance(value, bool))
        if not ok or (isinstance(value, bool) != isinstance(expected, bool)):
            raise ConfigError(f"config key {name!r} must be {_type_name(expected)}, got {_type_name(value)} "
                              f"{value!r}")


# Words of a key whose value is a secret ("es_password", "access_token", ...); "key" only after api/access/private.
_SECRET_WORDS = frozenset({"password", "passwd", "secret", "token", "apikey", "credential", "credentials", "auth"})
_KEY_QUALIFIERS = frozenset({"api", "access", "private"})
REDACTED = redaction.REDACTED


def _is_secret_key(key: str) -> bool:
    words = set(re.split(r"[^a-z0-9]+", key.lower()))
    return bool(words & _SECRET_WORDS) or ("key" in words and bool(words & _KEY_QUALIFIERS))


def _redact(key: str, value: Any) -> Any:
    if isinstance(value, (ml_collections.ConfigDict, dict)):
        return {k: _redact(k, v) for k, v in value.items()}
    if _is_secret_key(key) and value not in (None, "", (), []):
        return REDACTED
    if isinstance(value, str):
        return redaction.redact(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_redact(key, v) for v in value)
    return value


def redacted(cfg: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """A copy of `cfg` safe to print or save: the user info of every URL in a string value (also inside lists, e.g.
    `retriever.hosts = "https://elastic:PASSWORD@host:9200"`; a password may hold unencoded `/ # ? @ :` and
    spaces, `llds_jax.runtime.redaction`) becomes `***@`, and the value of every key named like
    a secret (password, token, secret, api_key, credentials, auth, ...) becomes `***`."""
    return ml_collections.ConfigDict(_redact("", cfg))


def redacted_argument(arg: str) -> str:
    """A command-line argument safe to print or log, as `redacted` makes a config: in `KEY=VALUE` (e.g.
    `--config.retriever.password=...`) the value of a key named like a secret becomes `***`, and the user info of
    any URL becomes `***@`."""
    key, sep, value = arg.partition("=")
    if sep and value and _is_secret_key(key):
        return f"{key}={REDACTED}"
    return redaction.redact(arg)


def summary(run: RunConfig) -> str:
    """A few lines on what `run` trains (secrets redacted): where, the model, the data and the step, the objective,
    the retriever. The whole config goes to the run folder's config.json."""
    llds = run.objective.llds
    objective = (f"GRPO + LLDS (lambda {llds.lam:g}, {llds.gate} gate)" if llds.enabled else "GRPO (LLDS off)")
    options = _redact("", dict(run.retriever.options))
    retriever = ", ".join(f"{k} {v}" for k, v in options.items() if v not in ("", None, ()))
    r = run.rollout
    trees = (f" ({r.trees} tree(s) x (1 + {r.tree_rounds} x {r.tree_forks}) leaves, {r.tree_select} forks)"
             if r.trees else "")
    return "\n".join([
        f"run {redaction.redact(run.run_dir)} (seed {run.seed}{', app ' + run.app if run.app else ''}); the whole "
        "config: <run_dir>/config.json, or --print_config",
        f"  model {run.model.preset or run.model.path} in {run.model.param_dtype} (compute {run.model.dtype})",
        f"  step: {run.data.prompts_per_step} prompts x {run.data.samples_per_prompt} samples{trees}, "
        f"{run.updates_per_step} update(s) of {run.optim.mini_batch_size} at lr {run.optim.learning_rate:g}; "
        f"{run.train.total_steps} steps",
        f"  objective {objective}, KL {run.objective.kl_coef:g}, advantages {run.objective.advantages}",
        f"  retriever {run.retriever.backend}{' (' + retriever + ')' if retriever else ''}",
    ])


def check_choice(cfg: ml_collections.ConfigDict, key: str, choices: Sequence[str]) -> None:
    """Raises ConfigError naming `key` unless its value is one of `choices`."""
    if value(cfg, key) not in choices:
        raise ConfigError(f"{key} must be one of {', '.join(map(repr, choices))}, got {value(cfg, key)!r}")


def value(cfg: ml_collections.ConfigDict, key: str) -> Any:
    """The value of a dotted run-config key ("rollout.top_p")."""
    for part in key.split("."):
        cfg = cfg[part]
    return cfg


def check(cfg: ml_collections.ConfigDict, app: Any = None) -> RunConfig:
    """Schema, then the typed config (each section's bounds, choices and combinations, then the run's), then the
    application's own checks; each error names the run-config key. Returns the typed config.

    `app`: the application module the config's `app` key names (`llds_jax.application.load`), whose sections the
    schema accepts and whose own checks run here. The checks against components (loss terms, retriever backends,
    model presets, TPU topologies, the device mesh) are `llds_jax.checks.validate`'s, which loads the application
    and runs this first."""
    if cfg.get("app", "") and app is None:
        raise ConfigError(f"app {cfg.app!r} is set: check the config with llds_jax.checks.validate, which loads it")
    check_schema(cfg, schema(app))
    run = typed(cfg)
    if app is not None:
        app.check_config(cfg)
    # An application may set model.path when the run starts (the demo: its generated policy).
    if not cfg.model.path and "model.path" not in (app.provided_keys(cfg) if app is not None else ()):
        raise ConfigError("model.path must name a Hugging Face checkpoint folder")
    return run

