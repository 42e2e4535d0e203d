"""The run folder's record of its config: `config.json` holds the config of the latest start (secrets redacted);
a resume whose config differs keeps the one it replaces as `config.before-step-N.json` (N: the step it resumes
from) and says which keys changed, so a folder never loses the config its checkpoints were trained with.

Keys of where a run executes, not of what it trains (`IGNORED`: the job's processes, the compilation cache), are
not compared.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import ml_collections
from etils import epath

from llds_jax import config as config_lib

CONFIG_FILE = "config.json"
BEFORE_FILE = "config.before-step-{step}.json"
IGNORED = ("distributed.", "compilation_cache_dir")
SHOWN_CHANGES = 5  # changed keys named in the notice; the rest are counted


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


def record(run_dir: epath.Path, cfg: ml_collections.ConfigDict, resumed_step: int) -> list[str]:
    """Writes `cfg` (redacted) as the folder's config.json; resuming from `resumed_step` > 0 with a config that
    differs from the recorded one first keeps that one as BEFORE_FILE. Returns the changes (empty for a fresh run
    or the same config)."""
    text = config_lib.redacted(cfg).to_json_best_effort(indent=2)
    path = run_dir / CONFIG_FILE
    found: list[str] = []
    if resumed_step and path.exists():
        before = path.read_text()
        found = changes(json.loads(before), json.loads(text))
        if found:
            (run_dir / BEFORE_FILE.format(step=resumed_step)).write_text(before)
    path.write_text(text)
    return found


def notice(run_dir: epath.Path, resumed_step: int, found: list[str]) -> str:
    """The one line that says a resume changed keys, and where the earlier config is."""
    named = "; ".join(found[:SHOWN_CHANGES]) + (f"; and {len(found) - SHOWN_CHANGES} more"
                                               if len(found) > SHOWN_CHANGES else "")
    return (f"llds_jax: resuming {run_dir} from step {resumed_step} with {len(found)} changed config key(s): "
            f"{named} (the earlier config is kept as {BEFORE_FILE.format(step=resumed_step)}; start a new run "
            "with another --config.run_dir to keep them apart)")
