"""Output folders the project writes into only when they are provably its own; it never deletes a user's file.

Every folder a key or a flag names for the project's output (`run_dir`, `demo.assets_dir`, `sft.output_dir`,
`--export_dir`, the report's `--out`, the index builder's `--out` and its `.partial` folder) goes through `claim`
before anything is written into it. A folder is the project's when it does not exist (it is created), is empty, or
holds the marker file `MARKER` that `claim` writes into every folder it accepts (`{"kind": ..., "spec": ...}`: which
writer claimed it, and the settings it was claimed for). A folder an older version wrote, before the marker, is
recognized by its contents, never by a file name alone: its `Kind.strangers` names the entries that are not proven
to be the project's (demo assets: a COMPLETE whose JSON is a demo spec; a warm start: a warm_start.json or a
metrics.jsonl of the records the warm start writes; ...). Anything else is refused with one line naming the key,
the folder and the entries that are not the project's, and nothing in it is written or deleted (issue 58: a
`demo.assets_dir` naming an existing folder lost everything in it; issue 66: a file named COMPLETE, metrics.jsonl or
warm_start.json was enough to adopt a user's folder and write over it).

A kind with a spec (demo assets, a warm start, a run folder) also reads the spec of the finished output a folder
holds (`Kind.recorded`): a folder that holds one of other settings is refused as well, naming the settings that
differ, so that another variant never writes over a finished result.
"""
from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping
from typing import Any

from etils import epath

from llds_jax.errors import InputError
from llds_jax.runtime import lease

MARKER = ".llds_jax_output"
SHOWN = 5  # entries or settings named in a message; the rest are counted


class FolderNotOursError(InputError):
    """The folder holds files the project did not write, another output, or an output of other settings (or it
    cannot be written); the message names the key and the folder."""


def _none(folder: str) -> dict | None:
    return None


def _unproven(folder: str, entries: list[str]) -> list[str]:
    return entries


@dataclasses.dataclass(frozen=True)
class Kind:
    """What a folder is for, and how to tell an older version's folder of that kind by its contents.

    `name` goes into the marker and the messages ("demo assets"). `strangers(folder, entries)` returns the entries
    of an unmarked folder that are not proven to be the project's (all of them when nothing in it proves it was
    written by the project; by default no unmarked folder is). `recorded(folder)` is the spec of the finished output
    the folder holds (None when it holds none); only consulted when `claim` is given a spec.
    """

    name: str
    strangers: Callable[[str, list[str]], list[str]] = _unproven
    recorded: Callable[[str], dict | None] = _none


def proven_by(proof: Callable[[str], bool], names: Callable[[str], bool]) -> Callable[[str, list[str]], list[str]]:
    """A `Kind.strangers`: when `proof(folder)` holds (a file's content is what the project writes), the entries
    whose names `names` does not accept; else every entry."""
    def strangers(folder: str, entries: list[str]) -> list[str]:
        if not proof(folder):
            return entries
        return [entry for entry in entries if not names(entry)]
    return strangers


def read_json(path: str) -> Any:
    """The JSON value of a file, or None when it is missing, unreadable or not JSON (a user's file of the same
    name)."""
    try:
        with open(path, "rb") as f:
            return json.loads(f.read().decode("utf-8"))
    except (OSError, ValueError):
        return None


def json_lines(path: str) -> list[Any] | None:
    """The JSON value of every non-empty line of a file, or None when one line is not JSON (or it cannot be read)."""
    try:
        with open(path, "rb") as f:
            return [json.loads(line.decode("utf-8")) for line in f if line.strip()]
    except (OSError, ValueError):
        return None


def claim(folder: str, key: str, kind: Kind, spec: Mapping[str, Any] | None = None) -> None:
    """Makes `folder` (local) the project's output folder of `kind`, creating it if missing, and marks it.

    `key` names it in the messages as the user wrote it (`demo.assets_dir`, `--out`). With `spec` (the settings
    the output is written for), a folder whose finished output was written for other settings is refused too.
    Raises FolderNotOursError (one line, nothing written or deleted) when the folder is a file, holds another
    kind's marker, holds entries not proven to be the project's, or holds an output of other settings.
    """
    what = f"{key} {folder}"
    entries = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    if not _marked(os.path.join(folder, MARKER), what, kind):
        strangers = kind.strangers(folder, [entry for entry in entries if entry != MARKER])
        if strangers:
            raise FolderNotOursError(f"{what} holds files llds_jax did not write ({_shown(strangers)}): nothing was "
                                     f"written or deleted; name an empty or new folder for the {kind.name}")
    if spec is not None:
        check_settings(folder, key, kind.recorded(folder) if entries else None, spec)
    _mark(folder, what, kind, spec)


def check_settings(folder: str, key: str, recorded: Mapping[str, Any] | None, spec: Mapping[str, Any]) -> None:
    """Raises FolderNotOursError naming the settings that differ when the folder holds a finished output
    (`recorded`: its spec; None when it holds none) of other settings than `spec`."""
    if recorded is not None and dict(recorded) != dict(spec):
        raise FolderNotOursError(f"{key} {folder} was written for other settings ({differences(recorded, spec)}): "
                                 f"nothing was written or deleted; set {key} to another folder (or delete that one)")


def _marked(marker: str, what: str, kind: Kind) -> bool:
    """Whether the marker file is this kind's; raises when it is another kind's. A marker that is missing or was
    cut by a crash as it was written (then nothing else was written after it) leaves the folder to its contents."""
    record = read_json(marker)
    found = record.get("kind") if isinstance(record, dict) else None
    if found is not None and found != kind.name:
        raise FolderNotOursError(f"{what} holds another output of llds_jax ({found}), not {kind.name}: nothing "
                                 "was written or deleted; name another folder")
    return found == kind.name


def _mark(folder: str, what: str, kind: Kind, spec: Mapping[str, Any] | None) -> None:
    """Creates `folder` if missing and writes its marker; a folder that cannot be written, or is a file (or below
    one), is one line."""
    marker = os.path.join(folder, MARKER)
    record = {"kind": kind.name, "spec": None if spec is None else dict(spec)}
    if read_json(marker) == record:  # a folder shared read-only is reused
        return
    try:
        lease.make_folder(epath.Path(folder), what)
    except lease.FolderNotWritableError as e:
        raise FolderNotOursError(str(e)) from None
    try:
        with open(marker, "w") as f:
            json.dump(record, f)
    except OSError as e:  # a read-only folder or a full disk
        raise FolderNotOursError(f"{what} is not writable: cannot write {marker}: {e.strerror or e}") from None


def differences(recorded: Mapping[str, Any], spec: Mapping[str, Any]) -> str:
    """`seed 0 there, 1 here; ...`: the settings in which a folder's recorded spec and this run's differ (the first
    SHOWN, then a count)."""
    keys = [key for key in sorted(set(recorded) | set(spec)) if recorded.get(key) != spec.get(key)]
    named = [f"{key} {recorded.get(key)!r} there, {spec.get(key)!r} here" for key in keys]
    return "; ".join(named[:SHOWN]) + (f"; and {len(named) - SHOWN} more" if len(named) > SHOWN else "")


def _shown(entries: list[str]) -> str:
    """`a, b, c and 4 more`."""
    return ", ".join(entries[:3]) + (f" and {len(entries) - 3} more" if len(entries) > 3 else "")
