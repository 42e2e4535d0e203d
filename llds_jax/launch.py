"""Trains a search agent with GRPO + LLDS (or evaluates, exports or compiles one) from a run config.

    python -m llds_jax.launch --config=configs/demo_cpu.py                   # the whole pipeline on this CPU
    python -m llds_jax.launch --config=configs/qwen7b_v4.py                  # the paper's run, on a TPU pod
    python -m llds_jax.launch --config=configs/qwen7b_v4.py --mode=compile   # check it fits the pod, on this machine

Any config key can be set on the command line: `--config.objective.llds.lam=0.1`, `--config.run_dir=gs://b/run`.

Modes: `train` (default; resumes from the run folder's latest checkpoint), `eval` (greedy, eval.max_turns, over
data.eval_files with the latest checkpoint or the initial weights: EM per data_source), `export` (the latest
checkpoint's policy as a Hugging Face folder at --export_dir), `sft` (only the supervised warm start), `compile`
(every program of the run compiled for the TPU topology `--topology` or `mesh.topology` on this machine, with a
table of memory per chip; exit status 1 when one does not fit: llds_jax.aot.compile_check).

With `sft.enabled`, every mode first runs the warm start (llds_jax.sft; reused when cached) and continues from its
output.

Every path may be local or gs:// (docs/gcs.md). A bad config, a missing file or bucket, GCS out of reach (or without
credentials) or an unreachable retriever ends the command with one line naming the problem and exit status 2: a
key that does not exist or a value out of its bounds or choices within a second, before JAX and the other heavy
libraries are imported (the names of registered components, e.g. loss terms, are checked after them). The
whole config is validated (llds_jax.checks.validate) before anything heavy runs: the application's preparation
(the run config's `app` key, llds_jax.application: e.g. the demo's assets), the warm start, model loading, rollouts.

A file-list key (a tuple: `data.train_files`, `data.eval_files`, `sft.data_files`, `sft.curriculum_files`) takes
comma-separated paths on the command line (`--config.data.train_files=a.parquet,gs://b/b.parquet`), repeated flags
(their paths add up) or a Python tuple (`"('a.parquet', 'b.parquet')"`, the way to give a path holding a comma);
llds_jax.config.loader reads the config file and words what goes wrong in it.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys


def _stopped_before_the_handlers(signum: int, frame) -> None:
    """A stop signal in the command's first second, before `run` installs its PreemptionGuard: nothing is loaded,
    so the command ends at once, as a stop during start-up does (exit status 0, one line; before, SIGTERM killed it
    with status -15 and no output)."""
    print(f"llds_jax: stopped by {signal.Signals(signum).name} during start-up: nothing to save; the same command "
          "starts again", file=sys.stderr, flush=True)
    os._exit(0)


if __name__ == "__main__":  # the command, not an import of this module: before the heavy imports below
    for _signal in (signal.SIGTERM, signal.SIGINT):
        signal.signal(_signal, _stopped_before_the_handlers)

from absl import app, flags  # noqa: E402
from absl import logging as absl_logging  # noqa: E402
from absl.logging import converter as absl_converter  # noqa: E402
from etils import epath  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from llds_jax.config import loader  # noqa: E402 (first: it registers the file-list parser)
from llds_jax import application  # noqa: E402
from llds_jax import config as config_lib  # noqa: E402
from llds_jax.runtime import gcs, platforms  # noqa: E402
from llds_jax.errors import InputError

_CONFIG = config_flags.DEFINE_config_file("config", None, "Run config file (ml_collections).", lock_config=True)
_MODE = flags.DEFINE_enum("mode", "train", ["train", "eval", "export", "sft", "compile"], "What to run.")
_EXPORT_DIR = flags.DEFINE_string("export_dir", "", "Output folder of --mode=export (local or gs://).")
_PRINT_CONFIG = flags.DEFINE_bool("print_config", False, "Print the whole run config (secrets redacted) before the "
                                  "run; else a summary (the whole config is the run folder's config.json).")
_TOPOLOGY = flags.DEFINE_string("topology", "", "TPU topology of --mode=compile (default: the config's "
                                "mesh.topology), e.g. v4:2x2x4 or v4-32.")
_ESTIMATE_FROM = flags.DEFINE_string("estimate_from", "", "Run folder whose logged lengths (metrics.jsonl) the "
                                     "expected step of --mode=compile uses (default: stated defaults).")

EXIT_BAD_INPUT = 2
HELP_FLAGS = ("--help", "-help", "-h", "--helpshort", "--helpfull")
# absl's own flag, which `main` reads: its help in the words of this command (absl's says the default is INFO).
VERBOSITY_HELP = """absl.logging:
  --verbosity: Logging level of the run: 0 adds the INFO lines (e.g. the
    trainer's progress within a step), 1 the DEBUG ones.
    (default: warnings and errors only)"""
LEASE_FILE = "lease.json"  # in the run folder while a training run writes it (llds_jax.runtime.lease)
# What a run writes into its folder (with the default demo.assets_dir and sft.output_dir, and the report's folder).
RUN_FOLDER_ENTRIES = frozenset({"config.json", "checkpoints", "metrics.jsonl", "tensorboard", "eval", "assets",
                                "warm_start", "report", LEASE_FILE})


def _known_errors() -> tuple[type[BaseException], ...]:
    from llds_jax.aot.compile_check import CompilerUnavailableError
    from llds_jax.runtime.lease import FolderNotWritableError, LeaseHeldError
    from llds_jax.search.types import RetrieverUnavailableError
    from llds_jax.train.checkpoint import CheckpointMismatchError, CheckpointUnreadableError
    from llds_jax.train.watchdog import NonFiniteError
    return (InputError, FileNotFoundError, RetrieverUnavailableError,
            CheckpointMismatchError, CheckpointUnreadableError, gcs.GCSUnavailableError, CompilerUnavailableError,
            NonFiniteError, LeaseHeldError, FolderNotWritableError)


def gcs_paths(cfg, export_dir: str = "") -> dict[str, str]:
    """The run's gs:// paths by config key (or flag), e.g. {"run_dir": "gs://b/runs/x", "data.train_files[0]": ...}."""

    named = {"run_dir": cfg.run_dir, "model.path": cfg.model.path, "model.tokenizer_path": cfg.model.tokenizer_path,
             "sft.output_dir": cfg.sft.output_dir, "compilation_cache_dir": cfg.compilation_cache_dir,
             "--export_dir": export_dir}
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

    params = trainer.rl_train_step.init_state().params
    ckpt = Checkpointer(str(trainer.run_dir / "checkpoints"), save_every=1, keep=1 << 30)
    try:
        restored = ckpt.restore_latest(params)
    finally:
        ckpt.close()
    if restored is None:
        logging.warning("no checkpoint in %s: using the initial weights", trainer.run_dir)
        return params, 0
    return restored.params, restored.step


def run(cfg, mode: str, export_dir: str = "", topology: str = "", print_config: bool = False,
        estimate_from: str = "", typed=None) -> int:
    """Runs one mode; returns the process exit status. `print_config`: print the whole config (redacted) before
    the run, not its summary; `estimate_from`: --mode=compile's run folder of expected lengths. The typed run config
    (`llds_jax.config.sections.RunConfig`) is built once, here or (`typed`) by the caller's `config.check` of `cfg`,
    and is what every component takes."""
    from llds_jax import checks

    if estimate_from and mode != "compile":
        raise InputError(f"--estimate_from is a flag of --mode=compile, not of --mode={mode}")
    if mode == "compile":  # compile_check checks the mesh against the topology's device count
        from llds_jax.aot import compile_check

        run_cfg = checks.check_components(cfg, typed)
        if not (topology or run_cfg.mesh.topology):
            raise InputError("--mode=compile needs a TPU topology: --topology=NAME or the config key mesh.topology")
        return compile_check.run(run_cfg, topology or run_cfg.mesh.topology, estimate_from)
    run_cfg = checks.validate(cfg, typed=typed)
    from llds_jax.train.preemption import PreemptionGuard

    with PreemptionGuard() as guard:  # a stop before the training loop ends the command at once (status 0)
        return _run(cfg, run_cfg, mode, export_dir, guard, print_config)


def _run(cfg, run_cfg, mode: str, export_dir: str, guard, print_config: bool) -> int:
    """`run` for the modes that load the model, under the command's PreemptionGuard (`cfg`: the config as given,
    for its record and the application; `run_cfg`: the typed config)."""
    import jax

    from llds_jax import checks
    from llds_jax.runtime import distributed
    from llds_jax.train import run_builder

    gcs.check_buckets(gcs_paths(cfg, export_dir))  # seconds, where the GCS clients would retry for minutes

    d = run_cfg.distributed
    distributed.maybe_initialize(d.coordinator_address or None, d.num_processes or None,
                                 d.process_id if d.process_id >= 0 else None)
    guard.reinstall()  # over the SIGTERM handler of jax.distributed's preemption notifier
    if run_cfg.compilation_cache_dir:  # before the first program compiles
        _use_compilation_cache(run_cfg.compilation_cache_dir)
    checks.check_mesh(run_cfg, jax.device_count())  # with the devices known, before anything heavy
    run_builder.check_pool(run_cfg, jax.process_count())
    with contextlib.ExitStack() as stack:
        if distributed.is_main_process():  # before anything heavy: one writer per run folder, and writable
            _claim_outputs(stack, cfg, run_cfg, mode, export_dir)
        return _load_and_run(cfg, run_cfg, mode, export_dir, guard, print_config)


def _use_compilation_cache(path: str) -> None:
    """Makes JAX read and write compiled programs at `path` (local or gs://, through etils.epath; process 0 writes),
    in place of any cache set before. A program is kept when it took at least
    `jax_persistent_cache_min_compile_time_secs` (1 s by default) to compile."""
    from jax.experimental.compilation_cache import compilation_cache

    compilation_cache.reset_cache()
    compilation_cache.set_cache_dir(path)


def trained_on(recorded: dict, cfg) -> dict:
    """What a run of `cfg` trains on, of a config as JSON (`recorded`: a run folder's config.json, or
    `config.as_json(cfg)`): `llds_jax.train.run_config.trained_on` with the application's sections, output
    folders and provided keys, and model.path left out with a warm start."""
    from llds_jax.train import run_config

    app = application.load(cfg)
    if app is None:
        return run_config.trained_on(recorded, warm_start=bool(cfg.sft.enabled))
    return run_config.trained_on(recorded, sections=tuple(app.config_sections()),
                                 left_out=tuple(app.paths(cfg)) + tuple(app.provided_keys(cfg)),
                                 warm_start=bool(cfg.sft.enabled))


def _claim_outputs(stack: contextlib.ExitStack, cfg, run_cfg, mode: str, export_dir: str) -> None:
    """Training holds the run folder's lease (llds_jax.runtime.lease: a second run on it stops with one line naming the
    holder) until `stack` closes; eval checks that the run folder is writable, export that --export_dir is. First,
    before anything loads, a local run folder or --export_dir that is not provably the project's, or a run folder
    whose run trained on other settings (`trained_on`), is refused in one line with nothing in it written
    (llds_jax.runtime.output_folder)."""
    from llds_jax.runtime import lease, output_folder

    run_dir = run_cfg.run_dir
    if mode in ("train", "eval") and not gcs.is_gcs(run_dir):
        output_folder.claim(run_dir, "run_dir", _run_folder(cfg), trained_on(config_lib.as_json(cfg), cfg))
    if mode == "train":
        stack.enter_context(lease.Lease(epath.Path(run_dir) / LEASE_FILE, what=f"run_dir {run_dir}",
                                        timeout_s=run_cfg.train.storage_timeout_s))
    elif mode == "eval":
        lease.check_writable(run_dir, f"run_dir {run_dir}")
    elif mode == "export" and export_dir:  # none: _export says so
        if gcs.is_gcs(export_dir):
            lease.check_writable(export_dir, f"--export_dir {export_dir}")
        else:
            output_folder.claim(export_dir, "--export_dir", output_folder.Kind("export"))


def _run_folder(cfg):
    """The run folder's `output_folder.Kind` for a run of `cfg`: a folder of an older version (before the marker)
    is proven by its config.json, a run config of the project's, beside entries a run writes; the run it holds
    trained on what that config.json says."""
    from llds_jax.runtime import output_folder
    from llds_jax.train import run_config

    def recorded(run_dir: str) -> dict | None:
        config = run_config.recorded_config(run_dir)
        return None if config is None else trained_on(config, cfg)

    return output_folder.Kind(
        "run folder", recorded=recorded,
        strangers=output_folder.proven_by(
            lambda run_dir: run_config.recorded_config(run_dir) is not None,
            lambda entry: entry in RUN_FOLDER_ENTRIES or run_config.is_before_file(entry)))


def prepared(cfg, run_cfg, mode: str = "train", guard=None):
    """The typed config `run_cfg` of `cfg` as the trainer takes it: the application's preparation (e.g. the demo,
    llds_jax.apps.demo, builds its assets and points the config at them), then with sft.enabled (or in
    --mode=sft) the warm start, whose output becomes model.path. A `guard` (the command's PreemptionGuard) aborts
    the command at once on a stop during the warm start, which is not resumable."""

    app = application.load(cfg)
    if app is not None:
        run_cfg = config_lib.with_values(run_cfg, app.prepare_run(cfg))
    if run_cfg.sft.enabled or mode == "sft":
        from llds_jax.sft import stage

        if guard is not None:
            guard.abort_during("the warm start")  # a rerun trains it again
        run_cfg = config_lib.with_values(run_cfg, {"model.path": stage.warm_start(run_cfg)})
        if guard is not None and mode != "sft":
            guard.abort_during("start-up")
    return run_cfg


def _load_and_run(cfg, run_cfg, mode: str, export_dir: str, guard, print_config: bool) -> int:
    """Builds the trainer (after the application's preparation and the warm start, `prepared`) and runs `mode`."""
    from llds_jax.runtime import distributed
    from llds_jax.train.trainer import Trainer

    run_cfg = prepared(cfg, run_cfg, mode, guard)
    if mode == "sft":
        return 0
    if distributed.is_main_process():
        print(config_lib.redacted(config_lib.whole(run_cfg, cfg)) if print_config else config_lib.summary(run_cfg),
              flush=True)
    trainer = Trainer(run_cfg, config_lib.recorded(run_cfg, cfg), training=mode == "train")
    try:
        if mode == "train":
            step = trainer.run(guard)
            if distributed.is_main_process():
                print(f"training stopped after step {step} of {run_cfg.train.total_steps}; run folder "
                      f"{run_cfg.run_dir}")
            if step == run_cfg.train.total_steps and run_cfg.train.final_eval and trainer.eval_examples:
                _print_eval(trainer, trainer.final_params, step, guard)
        elif mode == "eval":
            params, step = _params_for_eval(trainer)
            _print_eval(trainer, params, step, guard)
        else:
            _export(trainer, export_dir)
    finally:
        trainer.close()
    return 0


def _export(trainer, export_dir: str) -> None:
    """The latest checkpoint's policy (or the initial weights) as a Hugging Face folder; on several processes all
    of them gather the parameters and process 0 writes."""
    from llds_jax.runtime import distributed
    from llds_jax.model import hf_io
    from llds_jax.model.tokenizer import save_tokenizer

    if not export_dir:
        raise InputError("--mode=export needs --export_dir")
    params, step = _params_for_eval(trainer)
    hf_io.save_model(trainer.rl_train_step.to_model(params), export_dir,
                     generation_config=hf_io.read_generation_config(trainer.config.model.path))
    if not distributed.is_main_process():
        return
    save_tokenizer(trainer.tokenizer, export_dir)
    print(f"exported step {step} to {export_dir}")


def _print_eval(trainer, params, step: int, guard) -> None:
    """Evaluates `params` (every process) and prints the tables (process 0). A stop request abandons the
    evaluation (its searches in flight too) and raises StopRequested."""
    from llds_jax.runtime import distributed
    from llds_jax.train import evaluation
    from llds_jax.train.preemption import ABANDON_EVALUATION, StopRequested
    from llds_jax.train.trainer import START_EVAL, StepInterrupted

    out_dir = trainer.run_dir / "eval" / f"final_step_{step}"
    examples = trainer.eval_subset(trainer.config.eval.max_examples)
    guard.defer(ABANDON_EVALUATION)
    try:
        metrics = trainer.evaluate(params, examples, out_dir, prefix="eval", stopping=lambda: guard.requested)
    except StepInterrupted:
        raise StopRequested(guard.signal_name, "the evaluation") from None
    if not distributed.is_main_process():
        return
    start = evaluation.read_results(trainer.run_dir / "eval" / START_EVAL)
    print(f"evaluation ({len(examples)} questions, greedy, max_turns {trainer.config.eval.max_turns}); "
          f"transcripts in {out_dir}")
    for title, key in (("exact match", "em"), ("searches per question", "searches")):
        columns = {f"step {step}": {name[len(f"eval/{key}_"):]: value for name, value in metrics.items()
                                    if name.startswith(f"eval/{key}_")}}
        if start is not None and key in start and step > 0:
            columns = {"start": start[key], **columns}
        print(title)
        print(evaluation.format_columns(columns, start["counts"] if start else None))


def main(argv) -> None:
    del argv  # parse_flags has refused any argument that is not a flag
    # Warnings and errors only (orbax logs every save step at INFO), unless --verbosity asks for more (0: INFO,
    # e.g. the trainer's progress within a step).
    verbosity = flags.FLAGS["verbosity"]
    level = absl_converter.absl_to_standard(verbosity.value) if verbosity.present else logging.WARNING
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    absl_logging.set_verbosity(absl_converter.standard_to_absl(level))
    # The Elasticsearch client warns of every failed request; the retriever reports failures (with retries) itself.
    logging.getLogger("elastic_transport.node_pool").setLevel(logging.ERROR)
    # transformers (imported later, for the tokenizer) advises installing PyTorch on every run of the base install,
    # which needs only its tokenizers; its errors still show.
    if not verbosity.present:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    try:  # the config's values (each section's bounds and choices), in a second, before the heavy imports below
        typed = config_lib.check(_CONFIG.value, application.load(_CONFIG.value))
    except InputError as e:
        print(f"llds_jax: error: {e}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    if _MODE.value != "compile":  # which compiles with libtpu for a TPU topology that is not attached
        platforms.use_cpu_without_accelerator()  # before JAX is imported: no libtpu lines on a CPU machine
    from llds_jax.runtime.storage import StorageError, error_line
    from llds_jax.train.preemption import StopRequested

    try:
        sys.exit(run(_CONFIG.value, _MODE.value, _EXPORT_DIR.value, _TOPOLOGY.value, _PRINT_CONFIG.value,
                     _ESTIMATE_FROM.value, typed))
    except StopRequested as e:  # every `with` of the run has exited: its lease released, its files closed
        print(f"llds_jax: {e}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        # At once: the interpreter's teardown garbage-collects every JAX array and program, 14 s after a stop in
        # the warm start on a loaded 2-core machine (issue 58), a third of a spot VM's notice.
        os._exit(0)
    except StorageError as e:  # at once: the interpreter's exit would wait for storage threads that may hang
        print(error_line(e), file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(EXIT_BAD_INPUT)
    except _known_errors() as e:
        print(f"llds_jax: error: {e}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)


def parse_flags(argv: list[str]) -> list[str]:
    """absl flag parsing with one-line errors (llds_jax.config.loader): a config file that is missing, has a syntax
    error or is not UTF-8, or whose code raises (a value of the wrong type assigned to a key names the key in full);
    an override key that does not exist or a value of the wrong type; an argument that is not a flag."""
    if any(arg in HELP_FLAGS for arg in argv[1:]):
        print(__doc__.strip())
        print(f"\nFlags:\n{flags.FLAGS.module_help(sys.modules[__name__])}\n\n{VERBOSITY_HELP}")
        sys.exit(0)
    path = loader.config_path(argv)
    message = loader.file_problem(path) if path else None
    if message is None:
        if path:
            loader.import_config_package(path)
        try:
            rest = flags.FLAGS(argv)
            if path:
                loader.loaded(_CONFIG.value)
        except Exception as e:  # the config file's code may raise anything
            message = loader.parse_error(e, argv, path)
        else:
            if len(rest) == 1:
                return rest
            message = loader.unexpected_arguments(rest[1:])
    print(f"llds_jax: error: {message}", file=sys.stderr)
    sys.exit(EXIT_BAD_INPUT)


if __name__ == "__main__":
    flags.mark_flag_as_required("config")
    app.run(main, flags_parser=parse_flags)
