"""Bad run configs through the real command `python -m llds_jax.launch`: one stderr line naming the run-config key
or the config file, exit status 2, before anything heavy runs. The config's model.path names a folder that does not
exist, which the validation checks last ("model.path ...: no such folder"), so any other problem is named first."""
import os
import subprocess
import sys

import pytest

from tests.configs import CONFIGS

ROOT = os.path.dirname(CONFIGS)
MISSING_MODEL = "/nonexistent/llds-model"
CONFIG_TEXT = f"""\
import importlib.util

_spec = importlib.util.spec_from_file_location("tiny_test", {os.path.join(CONFIGS, "tiny_test.py")!r})
_tiny = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_tiny)


def get_config():
    c = _tiny.get_config()
    c.demo.enabled = False
    c.model.path = {MISSING_MODEL!r}
    return c
"""
LAST_LINE = CONFIG_TEXT.count("\n")  # get_config's `return c`


def config_text(statement: str) -> str:
    """CONFIG_TEXT with `statement` in get_config at LAST_LINE, before `return c`."""
    return CONFIG_TEXT.replace("    return c\n", f"    {statement}\n    return c\n")


@pytest.fixture
def config(tmp_path) -> str:
    """configs/tiny_test.py without the demo, its model.path a folder that does not exist."""
    path = tmp_path / "cfg.py"
    path.write_text(CONFIG_TEXT)
    return str(path)


def launch(config: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    return subprocess.run([sys.executable, "-m", "llds_jax.launch", f"--config={config}", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def assert_one_line(proc: subprocess.CompletedProcess, message: str) -> None:
    assert (proc.returncode, proc.stderr) == (2, f"llds_jax: error: {message}\n")


@pytest.mark.parametrize("override, message", [
    ("--config.optim.mini_batch_size=0", "optim.mini_batch_size must be >= 1, got 0"),
    ("--config.model.dtype=float8", "model.dtype must be one of 'float32', 'bfloat16', 'float16', got 'float8'"),
    ("--config.model.attention=flash",
     "model.attention must be one of 'auto', 'xla', 'blockwise', 'splash', 'cudnn', got 'flash'"),
    ("--config.model.attention_key_block=0", "model.attention_key_block must be >= 1, got 0"),
    ("--config.objective.llds.variant=bogus",
     "objective.llds.variant must be one of 'llds', 'policy', 'entropy', 'kl', got 'bogus'"),
    ("--config.eval.batch_size=0", "eval.batch_size must be >= 1, got 0"),
    ("--config.rollout.top_p=1.5", "rollout.top_p must be in (0, 1], got 1.5"),
    ("--config.rollout.top_k=-1", "rollout.top_k must be >= 0, got -1"),
    ("--config.rollout.temperature=0", "rollout.temperature must be > 0, got 0.0"),
    ("--config.rollout.retrieval_top_k=0", "rollout.retrieval_top_k must be >= 1, got 0"),
    ("--config.rollout.params_dtype=float16", "rollout.params_dtype must be one of 'float32', 'bfloat16', got "
                                              "'float16'"),
    ("--config.rollout.max_prompt_tokens=512",
     "rollout.max_prompt_tokens (512) must be below rollout.max_context_tokens (512)"),
    ("--config.train.checkpoint_every=0", "train.checkpoint_every must be >= 1, got 0"),
    ("--config.train.keep_checkpoints=0", "train.keep_checkpoints must be >= 1, got 0"),
    ("--config.train.lld_every=-1", "train.lld_every must be >= 0, got -1"),
    ("--config.objective.kl_estimator=k9",
     "objective.kl_estimator must be one of 'k1', 'abs', 'mse', 'low_var_kl', got 'k9'"),
    ("--config.sft.batch_size=0", "sft.batch_size must be >= 1, got 0"),
    ("--config.retriever.indexdir=/x", "unknown config key retriever.indexdir (did you mean retriever.index_dir?)"),
    ("--config.optim.lamda=1", "unknown config key optim.lamda"),
    # issue 58 item 17: a misspelt section was named with no suggestion
    ("--config.trian.total_steps=1", "unknown config key trian.total_steps (did you mean train.total_steps?)"),
    # issue 58 item 8: the seed passed, the demo assets were rebuilt, and after 72 s "expected non-negative integer"
    ("--config.seed=-1", "seed must be >= 0, got -1"),
    ("--config.data.train_files=[1,2]", "data.train_files must be a tuple of paths (str), got (1, 2)"),
    ("--config.optim.learning_rate=inf", "optim.learning_rate must be finite and > 0, got inf"),
    ("--config.objective.kl_coef=inf", "objective.kl_coef must be finite and >= 0, got inf"),
    ("--config.optim.learning_rate=0", "optim.learning_rate must be > 0, got 0.0"),
])
def test_bad_value_names_the_run_config_key(config, override, message):
    assert_one_line(launch(config, override), message)


def test_missing_config_file(tmp_path):
    path = str(tmp_path / "no_such_config.py")
    assert_one_line(launch(path), f"config file {path}: No such file or directory")


def test_syntax_error_in_config_file(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("def get_config():\n    return dict(a=1,,)\n")
    assert_one_line(launch(str(path)), f"config file {path}, line 2: invalid syntax")


@pytest.mark.parametrize("statement, message", [
    ('c.optim.mini_batch_size = "two"', "optim.mini_batch_size must be int, got str 'two'"),
    ("c.objective.llds.lam = [0.1]", "objective.llds.lam must be float, got list [0.1]"),
    ('raise RuntimeError("no cluster named prod")', "RuntimeError: no cluster named prod"),
    ('open("/nonexistent/llds-secrets.json")',
     "FileNotFoundError: [Errno 2] No such file or directory: '/nonexistent/llds-secrets.json'"),
])
def test_error_in_the_config_file_names_its_line_and_the_full_key(tmp_path, statement, message):
    """get_config() assigns a value of the wrong type (ml_collections refuses it there) or raises."""
    path = tmp_path / "cfg.py"
    path.write_text(config_text(statement))
    assert_one_line(launch(str(path)), f"config file {path}, line {LAST_LINE}: {message}")


def test_config_file_argument_that_get_config_does_not_take(config):
    assert_one_line(launch(f"{config}:e5"),
                    f"config file {config}: TypeError: get_config() takes 0 positional arguments but 1 was given")


def test_config_file_that_is_not_utf8(tmp_path):
    path = tmp_path / "latin1.py"
    path.write_bytes(config_text('c.run_dir = "runs/caf\xe9"').encode("latin-1"))
    assert_one_line(launch(str(path)), f"config file {path}, line {LAST_LINE}: (unicode error) 'utf-8' codec can't "
                                       "decode byte 0xe9 in position 8: unexpected end of data")


def test_stray_positional_argument(config):
    """An argument that is not a flag (here a forgotten `--config.`, its secret value hidden)."""
    assert_one_line(launch(config, "train", "retriever.password=hunter2"),
                    "unexpected arguments 'train', 'retriever.password=***' (every option is a flag: --NAME=VALUE)")


def test_missing_model_folders_name_the_key(config, tmp_path):
    assert_one_line(launch(config), f"model.path {MISSING_MODEL}: no such folder")
    assert_one_line(launch(config, f"--config.model.path={tmp_path}", f"--config.model.tokenizer_path={config}"),
                    f"model.tokenizer_path {config}: not a folder")


def test_a_run_dir_that_is_a_file_is_one_line_saying_so(config, tmp_path):
    """Issue 58 item 11: refused with "File exists" before. The model folder exists (empty): the run folder is
    claimed before anything is loaded. A file above the run folder is named too."""
    model, run_file = tmp_path / "model", tmp_path / "run_file"
    model.mkdir()
    run_file.write_text("notes\n")
    assert_one_line(launch(config, f"--config.model.path={model}", f"--config.run_dir={run_file}"),
                    f"run_dir {run_file} is a file, not a folder: name a folder (or move the file away)")
    assert_one_line(launch(config, f"--config.model.path={model}", f"--config.run_dir={run_file}/run"),
                    f"run_dir {run_file}/run: {run_file} is a file, not a folder: name a folder (or move the file "
                    "away)")
    assert run_file.read_text() == "notes\n"


def test_file_lists_take_comma_separated_paths(config, tmp_path):
    """The command gets as far as the model load (valid values fail only there: model.path is an empty folder) with
    the overridden lists, shown in the config it prints before loading."""
    empty = tmp_path / "model"
    empty.mkdir()
    proc = launch(config, "--config.data.train_files=/d/a.parquet,/d/b.parquet", "--config.data.eval_files=",
                  f"--config.model.path={empty}", "--print_config")
    assert_one_line(proc, f"tokenizer folder {empty}: no tokenizer files in it (tokenizer.json, "
                          "tokenizer_config.json, vocab.json, ...)")
    assert "  eval_files: !!python/tuple []\n" in proc.stdout
    assert "  train_files: !!python/tuple\n  - /d/a.parquet\n  - /d/b.parquet\n" in proc.stdout


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_exits_0_and_opens_with_what_the_command_does(flag):
    proc = subprocess.run([sys.executable, "-m", "llds_jax.launch", flag], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("Trains a search agent with GRPO + LLDS")
    assert [line.split()[:3] for line in lines[2:5]] == [["python", "-m", "llds_jax.launch"]] * 3
    assert "--mode: <train|eval|export|sft|compile>: What to run." in proc.stdout
