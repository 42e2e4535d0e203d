"""The product command.

    python -m llds_jax.launch --config=configs/qwen7b_v4.py [--config.objective.llds.lam=0.1 ...] [--mode=train]

Modes: `train` (default; resumes from the run folder's latest checkpoint), `eval` (greedy, eval.max_turns, over
data.eval_files with the latest checkpoint or the initial weights: EM per data_source), `export` (the latest
checkpoint's policy as a Hugging Face folder at --export_dir), `sft` (only the supervised warm start), `compile`
(every program of the run compiled for the TPU topology `--topology` or `mesh.topology` on this machine, with a
table of memory per chip; exit status 1 when one does not fit: llds_jax.compile_check).

With `sft.enabled`, every mode first runs the warm start (llds_jax.sft; reused when cached) and continues from its
output.

Every path may be local or gs:// (docs/gcs.md). A bad config, a missing file or bucket, GCS out of reach (or without
credentials) or an unreachable retriever ends the command with one line naming the problem and exit status 2. The
whole config is validated (llds_jax.checks.validate) before anything heavy runs: the application's preparation
(the run config's `app` key, llds_jax.application: e.g. the demo's assets), the warm start, model loading, rollouts.

A file-list key (a tuple: `data.train_files`, `data.eval_files`, `sft.data_files`, `sft.curriculum_files`) takes
comma-separated paths on the command line (`--config.data.train_files=a.parquet,gs://b/b.parquet`), repeated flags
(their paths add up) or a Python tuple (`"('a.parquet', 'b.parquet')"`, the way to give a path holding a comma).
"""
from __future__ import annotations

import importlib.util
import logging
import os
import re
import sys
from collections.abc import Sequence

import ml_collections
from absl import app, flags
from absl import logging as absl_logging
from absl.logging import converter as absl_converter
from ml_collections import config_flags
from ml_collections.config_flags import tuple_parser

from llds_jax import gcs


class _PathListParser(tuple_parser.TupleParser):
    """Command-line value of a tuple (file-list) key: comma-separated paths, or a Python tuple/list literal."""

    def parse(self, argument):
        if isinstance(argument, str) and not argument.lstrip().startswith(("(", "[")):
            return tuple(path.strip() for path in argument.split(",") if path.strip())
        return super().parse(argument)


config_flags.register_flag_parser_for_type(tuple, _PathListParser())

_CONFIG = config_flags.DEFINE_config_file("config", None, "Run config file (ml_collections).", lock_config=True)
_MODE = flags.DEFINE_enum("mode", "train", ["train", "eval", "export", "sft", "compile"], "What to run.")
_EXPORT_DIR = flags.DEFINE_string("export_dir", "", "Output folder of --mode=export (local or gs://).")
_TOPOLOGY = flags.DEFINE_string("topology", "", "TPU topology of --mode=compile (default: the config's "
                                "mesh.topology), e.g. v4:2x2x4 or v4-32.")

EXIT_BAD_INPUT = 2


def _known_errors() -> tuple[type[BaseException], ...]:
    from llds_jax.compile_check import CompilerUnavailableError
    from llds_jax.config import ConfigError
    from llds_jax.search.types import RetrieverUnavailableError
    from llds_jax.train.checkpoint import CheckpointMismatchError, CheckpointUnreadableError
    from llds_jax.train.watchdog import NonFiniteError
    return (ConfigError, FileNotFoundError, KeyError, ValueError, RetrieverUnavailableError,
            CheckpointMismatchError, CheckpointUnreadableError, gcs.GCSUnavailableError, CompilerUnavailableError,
            NonFiniteError)


def gcs_paths(cfg, export_dir: str = "") -> dict[str, str]:
    """The run's gs:// paths by config key (or flag), e.g. {"run_dir": "gs://b/runs/x", "data.train_files[0]": ...}."""
    from llds_jax import application

    named = {"run_dir": cfg.run_dir, "model.path": cfg.model.path, "model.tokenizer_path": cfg.model.tokenizer_path,
             "sft.output_dir": cfg.sft.output_dir, "--export_dir": export_dir}
    app = application.load(cfg)
    if app is not None:  # the application's own paths (the demo: demo.assets_dir)
        named.update(app.paths(cfg))
    for section, key in (("data", "train_files"), ("data", "eval_files"), ("sft", "data_files"),
                         ("sft", "curriculum_files")):
        named.update({f"{section}.{key}[{i}]": path for i, path in enumerate(cfg[section][key])})
    return {key: path for key, path in named.items() if gcs.is_gcs(path)}


def _params_for_eval(trainer):
    """The latest checkpoint's parameters, or the initial weights when the run folder has none."""
    from llds_jax.train.checkpoint import Checkpointer

    params = trainer.step_fn.init_state().params
    ckpt = Checkpointer(str(trainer.run_dir / "checkpoints"), save_every=1, keep=1 << 30)
    try:
        restored = ckpt.restore_latest(params)
    finally:
        ckpt.close()
    if restored is None:
        logging.warning("no checkpoint in %s: using the initial weights", trainer.run_dir)
        return params, 0
    return restored.params, restored.step


def run(cfg, mode: str, export_dir: str = "", topology: str = "") -> int:
    """Runs one mode; returns the process exit status."""
    from llds_jax import checks
    from llds_jax import config as config_lib

    if mode != "compile":  # compile_check validates against the topology's device count
        checks.validate(cfg)
    if mode == "compile":
        from llds_jax import compile_check

        if not (topology or cfg.mesh.topology):
            raise ValueError("--mode=compile needs a TPU topology: --topology=NAME or the config key mesh.topology")
        return compile_check.run(cfg, topology or cfg.mesh.topology)
    from llds_jax import distributed

    gcs.check_buckets(gcs_paths(cfg, export_dir))  # seconds, where the GCS clients would retry for minutes

    d = cfg.distributed
    distributed.maybe_initialize(d.coordinator_address or None, d.num_processes or None,
                                 d.process_id if d.process_id >= 0 else None)
    from llds_jax.train.trainer import Trainer

    from llds_jax import application

    app = application.load(cfg)
    if app is not None:  # e.g. the demo (llds_jax.apps.demo) builds its assets and points the config at them
        app.prepare_run(cfg)
    if cfg.sft.enabled or mode == "sft":
        from llds_jax.sft import stage

        cfg.model.path = stage.warm_start(cfg)
        if mode == "sft":
            return 0
    if distributed.is_main_process():
        print(config_lib.redacted(cfg), flush=True)
    trainer = Trainer(cfg, training=mode == "train")
    try:
        if mode == "train":
            step = trainer.run()
            if distributed.is_main_process():
                print(f"training stopped after step {step} of {cfg.train.total_steps}; run folder {cfg.run_dir}")
            if step == cfg.train.total_steps and cfg.train.final_eval and trainer.eval_examples:
                _print_eval(trainer, trainer.final_params, step)
        elif mode == "eval":
            params, step = _params_for_eval(trainer)
            _print_eval(trainer, params, step)
        else:
            _export(trainer, export_dir)
    finally:
        trainer.close()
    return 0


def _export(trainer, export_dir: str) -> None:
    """The latest checkpoint's policy (or the initial weights) as a Hugging Face folder; on several processes all
    of them gather the parameters and process 0 writes."""
    from llds_jax import distributed
    from llds_jax.model import hf_io
    from llds_jax.tokenizer import save_tokenizer

    if not export_dir:
        raise ValueError("--mode=export needs --export_dir")
    params, step = _params_for_eval(trainer)
    hf_io.save_model(trainer.step_fn.to_model(params), export_dir,
                     generation_config=hf_io.read_generation_config(trainer.cfg.model.path))
    if not distributed.is_main_process():
        return
    save_tokenizer(trainer.tokenizer, export_dir)
    print(f"exported step {step} to {export_dir}")


def _print_eval(trainer, params, step: int) -> None:
    """Evaluates `params` (every process) and prints the tables (process 0)."""
    from llds_jax import distributed
    from llds_jax.train import evaluation
    from llds_jax.train.trainer import START_EVAL

    out_dir = trainer.run_dir / "eval" / f"final_step_{step}"
    examples = trainer.eval_subset(trainer.cfg.eval.max_examples)
    metrics = trainer.evaluate(params, examples, out_dir, prefix="eval")
    if not distributed.is_main_process():
        return
    start = evaluation.read_results(trainer.run_dir / "eval" / START_EVAL)
    print(f"evaluation ({len(examples)} questions, greedy, max_turns {trainer.cfg.eval.max_turns}); "
          f"transcripts in {out_dir}")
    for title, key in (("exact match", "em"), ("searches per question", "searches")):
        columns = {f"step {step}": {name[len(f"eval/{key}_"):]: value for name, value in metrics.items()
                                    if name.startswith(f"eval/{key}_")}}
        if start is not None and key in start and step > 0:
            columns = {"start": start[key], **columns}
        print(title)
        print(evaluation.format_columns(columns, start["counts"] if start else None))


def main(argv) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    # Warnings and errors only (orbax logs every save step at INFO), unless --verbosity asks for more (0: INFO,
    # e.g. the trainer's progress within a step).
    verbosity = flags.FLAGS["verbosity"]
    level = absl_converter.absl_to_standard(verbosity.value) if verbosity.present else logging.WARNING
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    absl_logging.set_verbosity(absl_converter.standard_to_absl(level))
    # The Elasticsearch client warns of every failed request; the retriever reports failures (with retries) itself.
    logging.getLogger("elastic_transport.node_pool").setLevel(logging.ERROR)
    try:
        sys.exit(run(_CONFIG.value, _MODE.value, _EXPORT_DIR.value, _TOPOLOGY.value))
    except _known_errors() as e:
        message = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"llds_jax: error: {message}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)


def _config_file(argv: list[str]) -> str | None:
    """The file of `--config=PATH[:ARGS]` (or `--config PATH`) in argv, if given."""
    for i, arg in enumerate(argv):
        if arg.startswith(("--config=", "-config=")):
            return arg.split("=", 1)[1].split(":", 1)[0]
        if arg in ("--config", "-config") and i + 1 < len(argv):
            return argv[i + 1].split(":", 1)[0]
    return None


def _config_file_problem(path: str) -> str | None:
    """Why the config file cannot be loaded (missing, unreadable, a syntax error), checked without running it."""
    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
    except OSError as e:
        return f"config file {path}: {e.strerror}"
    try:
        compile(source, path, "exec")
    except SyntaxError as e:
        return f"config file {path}, line {e.lineno}: {e.msg}"
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
    hint = re.search(r'Did you mean "([^"]+)"', text)
    if not hint:
        return f"unknown config key {named[0]}"
    parent = named[0].rpartition(".")[0]
    return f"unknown config key {named[0]} (did you mean {parent + '.' if parent else ''}{hint[1]}?)"


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


def load_config(path: str, overrides: Sequence[str] = ()) -> ml_collections.ConfigDict:
    """The run config of a config file with `KEY=VALUE` overrides, read as `--config=PATH --config.KEY=VALUE ...`
    is read on this command's line (the same parsers: a value takes the type of its key, a file list takes
    comma-separated paths), for tools that load a run config without running it (bench/step_profile.py). An unknown
    key raises KeyError, a value of the wrong type ValueError, each with parse_flags' one-line message."""
    import_config_package(path)
    argv = ["load_config", f"--config={path}", *(f"--config.{override}" for override in overrides)]
    flag_values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, flag_values=flag_values, lock_config=True, sys_argv=argv)
    try:
        flag_values(argv)
    except flags.Error as e:
        raise ValueError(str(e)) from None
    except (AttributeError, KeyError) as e:
        raise KeyError(_unknown_key(e, argv, path)) from None
    return flag_values.config


def parse_flags(argv: list[str]) -> list[str]:
    """absl flag parsing with one-line errors: a missing config file or one with a syntax error, an override key
    that does not exist, or a value of the wrong type."""
    path = _config_file(argv)
    message = _config_file_problem(path) if path else None
    if message is None:
        if path:
            import_config_package(path)
        try:
            return flags.FLAGS(argv)
        except flags.Error as e:
            message = str(e)
        except (AttributeError, KeyError) as e:
            message = _unknown_key(e, argv, path)
    print(f"llds_jax: error: {message}", file=sys.stderr)
    sys.exit(EXIT_BAD_INPUT)


if __name__ == "__main__":
    flags.mark_flag_as_required("config")
    app.run(main, flags_parser=parse_flags)
