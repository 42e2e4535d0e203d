"""Output folders the project writes into only when they are its own; it never deletes one.

A folder named by a key or a flag (`demo.assets_dir`, `python -m llds_jax.train.report --out`) may be a user's folder
holding their own files. Before writing, `claim` checks that the folder is the project's: it does not exist (it is
created), it is empty, or it holds the marker file `MARKER` that `claim` writes into every folder it accepts (its
`kind` says which writer made it: a report folder is not taken for demo assets). A folder that an older version
wrote, before the marker, is recognized by the caller's `legacy` test on its entries. Anything else is refused with
one line naming the key and the folder, and nothing in it is written or deleted (issue 58: a `demo.assets_dir`
naming an existing folder lost everything in it).
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable

from llds_jax.errors import InputError

MARKER = ".llds_jax_output"


class FolderNotOursError(InputError):
    """The folder holds files the project did not write (or cannot be written); the message names the key and the
    folder."""


def claim(folder: str, what: str, kind: str, legacy: Callable[[list[str]], bool] = lambda entries: False) -> None:
    """Makes `folder` (local) the project's output folder of `kind` (e.g. "demo assets"), creating it if missing.

    `what` names it for the message (e.g. "demo.assets_dir runs/w"); `legacy(entries)` says whether a folder
    without the marker was written by the project before the marker existed. Raises FolderNotOursError when the
    folder is a file, holds another kind's marker, or holds other files.
    """
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise FolderNotOursError(f"{what} is a file, not a folder: name a folder (or move the file away)")
    os.makedirs(folder, exist_ok=True)
    entries = sorted(os.listdir(folder))
    marker = os.path.join(folder, MARKER)
    if MARKER in entries:
        found = _marked_kind(marker)
        if found not in (kind, None):  # None: a marker cut by a crash as it was written is still ours
            raise FolderNotOursError(f"{what} holds another output of llds_jax ({found}), not {kind}: nothing "
                                     "was written or deleted; name another folder")
        if found == kind:
            return
    if entries and not legacy(entries):
        shown = ", ".join(entries[:3]) + (f" and {len(entries) - 3} more" if len(entries) > 3 else "")
        raise FolderNotOursError(f"{what} holds files llds_jax did not write ({shown}): nothing was written or "
                                 f"deleted; name an empty or new folder for the {kind}")
    try:
        with open(marker, "w") as f:
            json.dump({"kind": kind}, f)
    except OSError as e:  # a read-only folder or a full disk
        raise FolderNotOursError(f"{what} is not writable: cannot write {marker}: {e.strerror or e}") from None


def _marked_kind(marker: str) -> str | None:
    """The kind recorded in a marker file, or None when it cannot be read."""
    try:
        with open(marker) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record.get("kind") if isinstance(record, dict) else None
