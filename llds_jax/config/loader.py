"""A run config file read as the command line reads it, with one-line messages for everything that goes wrong.

`python -m llds_jax.launch --config=FILE --config.KEY=VALUE ...` and the tools that load a run config without running
it (`load_config`: bench/, the study) share the parsers here: a value takes the type of its key, and a file-list key
(a tuple: `data.train_files`, ...) takes comma-separated paths, repeated flags or a Python tuple literal. What goes
wrong becomes one line naming the file (and its line) or the full key: a missing file, a syntax error, text that is
not UTF-8, an exception of `get_config()`, a value of the wrong type assigned in the file or on the command line, an
unknown key (with a suggestion), an argument that is not a flag.
"""
from __future__ import annotations

import importlib.util
import os
import re
import sys
import traceback
from collections.abc import Sequence

import ml_collections
from absl import flags
from ml_collections import config_flags
from ml_collections.config_flags import tuple_parser

from llds_jax.bounds import ConfigError
from llds_jax.config import REMOVED_KEYS


class PathListParser(tuple_parser.TupleParser):
    """Command-line value of a tuple (file-list) key: comma-separated paths, or a Python tuple/list literal."""

    def parse(self, argument):
        if isinstance(argument, str) and not argument.lstrip().startswith(("(", "[")):
            return tuple(path.strip() for path in argument.split(",") if path.strip())
        return super().parse(argument)


config_flags.register_flag_parser_for_type(tuple, PathListParser())


def file_of(spec: str) -> str:
    """The file of a config spec `PATH[:ARGS]` (ml_collections hands ARGS to the file's `get_config`)."""
    return spec.split(":", 1)[0]


def config_spec(argv: list[str]) -> str | None:
    """`PATH[:ARGS]` of `--config=PATH[:ARGS]` (or `--config PATH`) in argv, if given."""
    for i, arg in enumerate(argv):
        if arg.startswith(("--config=", "-config=")):
            return arg.split("=", 1)[1]
        if arg in ("--config", "-config") and i + 1 < len(argv):
            return argv[i + 1]
    return None


def config_path(argv: list[str]) -> str | None:
    """The file of `--config=PATH[:ARGS]` (or `--config PATH`) in argv, if given."""
    spec = config_spec(argv)
    return None if spec is None else file_of(spec)


def edit_distance(a: str, b: str) -> int:
    """The optimal string alignment distance of `a` and `b`: insertions, deletions, substitutions and swaps of two
    adjacent characters, each 1 (`totl_steps` -> `total_steps`: 1, `trian` -> `train`: 1)."""
    previous, row = None, list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        before, previous, row = previous, row, [i] + [0] * len(b)
        for j, y in enumerate(b, 1):
            row[j] = min(previous[j] + 1, row[j - 1] + 1, previous[j - 1] + (x != y))
            if before is not None and j > 1 and x == b[j - 2] and a[i - 2] == y:
                row[j] = min(row[j], before[j - 2] + 1)
    return row[-1]


def _holds_words(longer: str, shorter: str) -> bool:
    """Whether the `_`-separated words of `shorter` are consecutive words of `longer` (`max_turn` in
    `max_turn_tokens`, `steps` in `total_steps`; not `step` in `steps`)."""
    words, part = longer.split("_"), shorter.split("_")
    return any(words[i:i + len(part)] == part for i in range(len(words) - len(part) + 1))


def close_names(name: str, names: Sequence[str]) -> list[str]:
    """Up to 3 of `names` close to `name`, closest first: within a small edit distance (1 for a name of up to 4
    characters, else 2; `edit_distance`), then those whose words hold its words or are held by them
    (`_holds_words`)."""
    limit = 1 if len(name) <= 4 else 2
    near = sorted((d, k) for k in names if (d := edit_distance(name, k)) <= limit)
    close = [k for _, k in near]
    close += sorted(k for k in names if k not in close and (_holds_words(k, name) or _holds_words(name, k)))
    return close[:3]


def nearest_keys(key: str, spec: str) -> list[str]:
    """Up to 3 keys of the config `spec` (`PATH[:ARGS]`) close to the unknown dotted `key` (`close_names`), closest
    first: where a section of its path is unknown (`trian.total_steps`), the key with that section replaced by a
    close one (`train.total_steps`); else those beside it whose names are close to its last part. [] when none is
    or the file cannot be read."""
    parts = key.split(".")
    try:
        section = load_config(spec)
        for depth, part in enumerate(parts):
            names = list(section.keys()) if hasattr(section, "keys") else []
            if part not in names or depth == len(parts) - 1:
                break
            section = section[part]
    except Exception:  # noqa: BLE001 - a suggestion is optional; the error itself is reported either way
        return []
    return [".".join(parts[:depth] + [k] + parts[depth + 1:]) for k in close_names(parts[depth], names)]


def file_problem(path: str) -> str | None:
    """Why the config file cannot be loaded (missing, unreadable, a syntax error, text that is not UTF-8 or the
    encoding it declares), checked without running it: its bytes compiled as the loader compiles them."""
    try:
        with open(path, "rb") as f:
            source = f.read()
    except OSError as e:
        return f"config file {path}: {e.strerror}"
    try:
        compile(source, path, "exec")
    except SyntaxError as e:
        return f"config file {path}, line {e.lineno}: {e.msg}"
    except ValueError as e:  # null bytes (Python 3.11)
        return f"config file {path}: {e}"
    return None


def _unknown_key(error: BaseException, argv: list[str], path: str | None) -> str:
    """The message of an override that names no key (config_flags raises KeyError, or AttributeError around one)."""
    cause = error.args[0] if error.args and isinstance(error.args[0], BaseException) else error
    text = str(cause.args[0]) if cause.args else ""
    missing = text.splitlines()[0].strip("'\"") if text else ""
    keys = [a.split("=", 1)[0].split(".", 1)[1] for a in argv[1:] if re.match(r"--?(no)?config\.", a)]
    named = [k for k in keys if missing in k.split(".")]
    if not named:  # not an override's key: the config file itself failed (e.g. it has no get_config)
        return f"config file {path}: {text.splitlines()[0] if text else type(cause).__name__}"
    if named[0] in REMOVED_KEYS:
        return f"unknown config key {named[0]}: removed, {REMOVED_KEYS[named[0]]}"
    spec = config_spec(argv)
    near = nearest_keys(named[0], spec) if spec else []
    if not near:
        return f"unknown config key {named[0]}"
    return f"unknown config key {named[0]} (did you mean {' or '.join(near)}?)"


def parse_error(error: Exception, argv: list[str], path: str | None) -> str:
    """The one-line message of an exception of flag parsing: one the config file's code raised (any type), an
    override that names no key, or a flag's bad value (flags.Error); anything else is re-raised."""
    raised = _raised_in_config_file(error, path) if path else None
    if raised is not None:
        return _config_file_error(raised, path)
    if isinstance(error, (AttributeError, KeyError)):
        return _unknown_key(error, argv, path)
    if not isinstance(error, flags.Error):
        raise error
    if "\n" not in str(error):
        return str(error)
    while error.__context__ is not None:  # config_flags' traceback of get_config's call (e.g. `--config=FILE:ARG`)
        error = error.__context__
    return f"config file {path}: {_one_line(error)}"


def _one_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {' '.join(str(error).split())}"


def _raised_in_config_file(error: BaseException | None, path: str) -> BaseException | None:
    """The exception of `error`'s chain that the config file's own code raised, if any (config_flags re-raises a
    TypeError or ValueError of the file as another, absl that one as a flags.Error, and an OSError is deferred to
    the config's first use)."""
    while error is not None:
        if _lines_in(error, path):
            return error
        error = error.__cause__ or error.__context__
    return None


def _config_file_error(error: BaseException, path: str) -> str:
    """The one-line message of an exception the config file's code raised, at its line in the file; a value of the
    wrong type assigned to a key (ml_collections' ConfigDict.__setitem__ refuses it) names the key in full."""
    frames = list(traceback.walk_tb(error.__traceback__))
    innermost = frames[-1][0]
    section = innermost.f_locals.get("self")
    if (isinstance(error, TypeError) and innermost.f_code.co_name == "__setitem__"
            and isinstance(section, ml_collections.ConfigDict)):
        key, value = innermost.f_locals["key"], innermost.f_locals["value"]
        name = _key_prefix(section, [frame for frame, _ in frames]) + str(key)
        reason = f"{name} must be {type(section[key]).__name__}, got {type(value).__name__} {value!r}"
    else:
        reason = _one_line(error)
    return f"config file {path}, line {_lines_in(error, path)[-1]}: {reason}"


def _lines_in(error: BaseException, path: str) -> list[int]:
    """The lines of the file `path` that `error`'s traceback passes through, outermost first."""
    file = os.path.abspath(path)
    return [line for frame, line in traceback.walk_tb(error.__traceback__)
            if os.path.abspath(frame.f_code.co_filename) == file]


def _key_prefix(section: ml_collections.ConfigDict, frames: Sequence) -> str:
    """The dotted path of `section` ("optim.", "" for a whole config) in the largest config that a local variable
    of `frames` holds (the config file's `c`)."""
    found = (_path_to(local, section) for frame in frames for local in frame.f_locals.values()
             if isinstance(local, ml_collections.ConfigDict))
    return max((path for path in found if path is not None), key=len, default="")


def _path_to(cfg: ml_collections.ConfigDict, section: ml_collections.ConfigDict, prefix: str = "") -> str | None:
    """The dotted path of `section` in `cfg` (ending in "."; `prefix` for `cfg` itself), None when not in it."""
    if cfg is section:
        return prefix
    for key, value in cfg.items():
        if isinstance(value, ml_collections.ConfigDict):
            path = _path_to(value, section, f"{prefix}{key}.")
            if path is not None:
                return path
    return None


def unexpected_arguments(args: Sequence[str]) -> str:
    """The message of command-line arguments that are not flags (each shown as config.redacted_argument shows it)."""
    from llds_jax.config import redacted_argument

    shown = ", ".join(repr(redacted_argument(arg)) for arg in args)
    return f"unexpected argument{'s' if len(args) > 1 else ''} {shown} (every option is a flag: --NAME=VALUE)"


def loaded(config):
    """`config`, first used here: config_flags defers an OSError that the config file's code raised to this use."""
    config.get("app")
    return config


def import_config_package(path: str) -> None:
    """Makes the package a config file lives in importable (configs/ has an __init__.py), so that a config builds on
    another by importing it (`from configs import qwen7b_v4 as base`) from any working directory. The package is
    taken from the config file's own folder; one already imported (e.g. `configs` from the repo root, on sys.path
    when run there) is left as it is."""
    folder = os.path.dirname(os.path.abspath(path))
    name = os.path.basename(folder)
    init = os.path.join(folder, "__init__.py")
    if not name.isidentifier() or name in sys.modules or not os.path.isfile(init):
        return
    spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[folder])
    package = importlib.util.module_from_spec(spec)
    sys.modules[name] = package
    spec.loader.exec_module(package)


def load_config(spec: str, overrides: Sequence[str] = ()) -> ml_collections.ConfigDict:
    """The run config of a config file (`PATH[:ARGS]`) with `KEY=VALUE` overrides, read as `--config=PATH[:ARGS]
    --config.KEY=VALUE ...` is read on this command's line (the same parsers: a value takes the type of its key, a
    file list takes comma-separated paths), for tools that load a run config without running it (bench/step_profile.py). An unknown
    key raises KeyError, a value of the wrong type or an error of the config file's code ValueError, each with
    the one-line message of `parse_error`."""
    path = file_of(spec)
    import_config_package(path)
    argv = ["load_config", f"--config={spec}", *(f"--config.{override}" for override in overrides)]
    flag_values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, flag_values=flag_values, lock_config=True, sys_argv=argv)
    try:
        flag_values(argv)
        return loaded(flag_values.config)
    except Exception as e:  # the config file's code may raise anything
        message = parse_error(e, argv, path)
        unknown_key = isinstance(e, (AttributeError, KeyError)) and _raised_in_config_file(e, path) is None
    raise (KeyError if unknown_key else ValueError)(message)


def show(args: list[str]) -> int:
    """Prints the resolved config of `args` (the config file's spec, then --config.KEY=VALUE overrides); returns
    the exit status (2: the config has an error, named in one line)."""
    from llds_jax import config

    if not args:
        print("usage: python -m llds_jax.config show CONFIG.py[:ARGS] [--config.KEY=VALUE ...]", file=sys.stderr)
        return 2
    others = [arg for arg in args[1:] if not arg.startswith("--config.")]
    try:
        if others:
            raise ValueError(unexpected_arguments(others))
        cfg = load_config(args[0], [arg[len("--config."):] for arg in args[1:]])
        config.typed(cfg)
    except (ConfigError, KeyError, ValueError) as e:
        print(f"llds_jax: error: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    print(config.redacted(cfg), end="")
    return 0
