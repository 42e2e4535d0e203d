"""The run folder's record of its config: `config.json` holds the config of the latest start (secrets redacted);
a resume whose config differs keeps the one it replaces as `config.before-step-N.json` (N: the step it resumes
from) and says which keys changed, so a folder never loses the config its checkpoints were trained with.

Keys of where a run executes, not of what it trains (`IGNORED`: the job's processes, the compilation cache), are
not compared.

What a run trains on (`trained_on`: the data, the retriever, the starting model and its warm start, the seed, the
application's section) may not change on a resume: the launcher refuses a run folder whose config.json was written
for other such settings before anything loads (issue 66: the demo with the e5 retriever "resumed" the finished BM25
demo in its folder and wrote over its evaluation). The schedule, the objective and the rollout may change, with
`notice`.
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from typing import Any

from etils import epath

from llds_jax.runtime import output_folder
from llds_jax.search import factory

CONFIG_FILE = "config.json"
BEFORE_FILE = "config.before-step-{step}.json"
IGNORED = ("distributed.", "compilation_cache_dir")
SHOWN_CHANGES = 5  # changed keys named in the notice; the rest are counted
# The keys (or sections, ending in ".") of what a run trains on, besides the application's sections.
TRAINED_ON = ("seed", "app", "model.path", "model.tokenizer_path", "model.chat_template", "model.preset",
              "data.train_files", "data.eval_files", "reward.", "retriever.", "sft.")
NOT_TRAINED_ON = ("sft.output_dir", "sft.log_every")  # where the warm start is cached, how often it logs
# The sections of every run config the project has written (config.json of an older version included).
SECTIONS = frozenset({"run_dir", "seed", "model", "data", "rollout", "objective", "optim", "train"})


def flat(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"train.total_steps": 20, ...} of a nested mapping (a config as JSON)."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def changes(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """`key: old -> new` for every compared key whose value differs between two configs as JSON (a key only one
    has: "(none)" on the other side), sorted by key."""
    old, new = flat(recorded), flat(current)
    shown = lambda tree, key: json.dumps(tree[key]) if key in tree else "(none)"  # noqa: E731
    return [f"{key}: {shown(old, key)} -> {shown(new, key)}" for key in sorted(old.keys() | new.keys())
            if not key.startswith(IGNORED) and old.get(key, ()) != new.get(key, ())]


def record(run_dir: epath.Path, config: Mapping[str, Any], resumed_step: int) -> list[str]:
    """Writes `config` (the run config as JSON, secrets redacted: `llds_jax.config.recorded`) as the folder's
    config.json; resuming from `resumed_step` > 0 with a config that differs from the recorded one first keeps that
    one as BEFORE_FILE. Returns the changes (empty for a fresh run or the same config)."""
    text = json.dumps(config, indent=2)
    path = run_dir / CONFIG_FILE
    found: list[str] = []
    if resumed_step and path.exists():
        before = path.read_text()
        found = changes(json.loads(before), json.loads(text))
        if found:
            (run_dir / BEFORE_FILE.format(step=resumed_step)).write_text(before)
    path.write_text(text)
    return found


def is_before_file(name: str) -> bool:
    """Whether `name` is a BEFORE_FILE's."""
    prefix, _, suffix = BEFORE_FILE.partition("{step}")
    return re.fullmatch(f"{re.escape(prefix)}[0-9]+{re.escape(suffix)}", name) is not None


def notice(run_dir: epath.Path, resumed_step: int, found: list[str]) -> str:
    """The one line that says a resume changed keys, and where the earlier config is."""
    named = "; ".join(found[:SHOWN_CHANGES]) + (f"; and {len(found) - SHOWN_CHANGES} more"
                                               if len(found) > SHOWN_CHANGES else "")
    return (f"llds_jax: resuming {run_dir} from step {resumed_step} with {len(found)} changed config key(s): "
            f"{named} (the earlier config is kept as {BEFORE_FILE.format(step=resumed_step)}; start a new run "
            "with another --config.run_dir to keep them apart)")


def trained_on(recorded: Mapping[str, Any], sections: tuple[str, ...] = (), left_out: tuple[str, ...] = (),
               warm_start: bool = False) -> dict[str, Any]:
    """The keys of a config as JSON (`recorded`: a run folder's config.json, or the config of the run that would
    use it) that say what a run trains on, flat: TRAINED_ON and the application's `sections`, less NOT_TRAINED_ON
    and the application's keys `left_out` (its output folders and the keys it sets when the run starts, which
    follow from its section: the demo's model, data and retriever); less model.path with a `warm_start`, which the
    run then starts from (the warm start's own folder records what it was trained from). The retriever's options
    are compared with their defaults filled in and without those of how it is reached
    (`search.factory.OPERATIONAL_KEYS`)."""
    if isinstance(recorded.get("retriever"), Mapping):
        recorded = {**recorded, "retriever": _retrieved_by(recorded["retriever"])}
    compared = TRAINED_ON + tuple(f"{name}." for name in sections)
    left_out = NOT_TRAINED_ON + (("model.path",) if warm_start else ()) + left_out
    return {key: value for key, value in flat(recorded).items()
            if _named(key, compared) and not _named(key, left_out)}


def _retrieved_by(section: Mapping[str, Any]) -> dict[str, Any]:
    """A retriever section's options that decide what it returns: defaults filled in (`search.factory.
    resolve_config`; as recorded when an older config does not resolve), less OPERATIONAL_KEYS."""
    try:
        resolved = factory.resolve_config(section).as_dict()
    except (ValueError, TypeError):
        resolved = dict(section)
    return {key: value for key, value in resolved.items() if key not in factory.OPERATIONAL_KEYS}


def _named(key: str, names: tuple[str, ...]) -> bool:
    """Whether `key` is one of `names` or inside one of its sections (a name ending in ".", or a provided section
    such as "retriever")."""
    return any(key == name or key.startswith(name if name.endswith(".") else f"{name}.") for name in names)


def recorded_config(run_dir: str) -> dict[str, Any] | None:
    """The config.json of a local run folder when it is a run config of the project's, else None (none, or a
    user's file of that name)."""
    recorded = output_folder.read_json(os.path.join(run_dir, CONFIG_FILE))
    return recorded if isinstance(recorded, dict) and SECTIONS <= recorded.keys() else None
