"""Fixtures of the tests that launch runs (tests/e2e, tests/reliability): the tiny demo world, index and policy,
run-config files and the launch command. tests/conftest.py imports them."""
import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

from llds_jax.apps import demo
from llds_jax.data import synthetic
from llds_jax.data.qa import read_qa
from llds_jax.data.synthetic import CITIES
from llds_jax.model import hf_io
from llds_jax.model.tokenizer import load_tokenizer, train_tokenizer, write_qwen25_tokenizer
from tests.e2e.policies import chain_policy, searching_policy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny_test.py")


def tiny_config():
    """configs/tiny_test.py's config."""
    spec = importlib.util.spec_from_file_location("tiny_test", TINY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def tiny_trainer_config(assets, run_dir: str):
    """The tiny config over `assets` (`tiny_assets`) for a Trainer built in the test's process: no demo, the run
    folder `run_dir`, every device on fsdp, 4 samples per prompt and updates of 8 (a multiple of the 8 batch shards,
    as validation asks)."""
    cfg = tiny_config()
    cfg.demo.enabled = False
    cfg.model.path = assets["model"]
    cfg.data.train_files, cfg.data.eval_files = [assets["train"]], [assets["test"]]
    cfg.retriever.index_dir = assets["index"]
    cfg.run_dir = run_dir
    cfg.mesh.fsdp = -1
    cfg.data.samples_per_prompt = 4
    cfg.optim.mini_batch_size = cfg.optim.micro_batch_size = 8
    return cfg


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory):
    """World files, BM25 index and a random 1-layer policy at the tiny config's sizes, built once before any run
    (so no two processes write them)."""
    return demo.assets_for(tiny_config(), str(tmp_path_factory.mktemp("assets")))


@pytest.fixture(scope="session")
def answer_policy(tmp_path_factory, tiny_assets, qwen_tokenizer):
    """(HF folder, city): a greedy policy that answers "<answer>{city}</answer>" right after any prompt, the city
    being the most common answer of the tiny test set among those whose answer fits in one turn
    (rollout.max_turn_tokens). A chain policy (tests/e2e/policies.py) of "\n<answer>{city}</answer>" (the turn is
    cut after the first </answer>, so the chain may loop)."""
    max_turn_tokens = tiny_config().rollout.max_turn_tokens
    fits = {c for c in CITIES if len(qwen_tokenizer.encode("<answer>" + c + "</answer>")) <= max_turn_tokens}
    answers = [ex.golden_answers[0] for ex in read_qa(tiny_assets["test"]) if ex.golden_answers[0] in fits]
    city = max(sorted(set(answers)), key=answers.count)
    model = chain_policy(qwen_tokenizer, [("\n<answer>" + city + "</answer>", 0.0)], demo.QWEN25_VOCAB_ROWS,
                         hidden_size=64)
    folder = str(tmp_path_factory.mktemp("answer_policy"))
    hf_io.save_model(model, folder)
    write_qwen25_tokenizer(folder, "base")
    return folder, city


def write_config(path, assets, model_path=None, **settings) -> str:
    """A config file: the tiny test config pointed at prebuilt `assets`, plus `settings` ("a.b": value; a dict
    value replaces a whole section)."""
    lines = [f"c.{key} = ml_collections.ConfigDict({value!r})" if isinstance(value, dict) else f"c.{key} = {value!r}"
             for key, value in settings.items()]
    text = textwrap.dedent(f"""\
        import importlib.util

        import ml_collections
        _spec = importlib.util.spec_from_file_location("tiny_test", {TINY!r})
        _tiny = importlib.util.module_from_spec(_spec)
        _spec.loader.exec_module(_tiny)


        def get_config():
            c = _tiny.get_config()
            c.demo.enabled = False
            c.model.path = {model_path or assets["model"]!r}
            c.data.train_files = [{assets["train"]!r}]
            c.data.eval_files = [{assets["test"]!r}]
            c.retriever.index_dir = {assets["index"]!r}
        """)
    text += "".join(f"    {line}\n" for line in lines) + "    return c\n"
    with open(path, "w") as f:
        f.write(text)
    return str(path)


@pytest.fixture(scope="session")
def config_writer():
    """`write_config` (see above) for the tests."""
    return write_config


@pytest.fixture(scope="session")
def repo_root():
    return ROOT


@pytest.fixture
def launch(repo_root):
    """`launch(config_path, *args, env=None)` runs `python -m llds_jax.launch --config=PATH ARGS...` on one CPU
    device, with `env` added to this process's environment: (exit code, stdout, stderr)."""
    def run(config_path, *args, env=None):
        full_env = {**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})}
        full_env.pop("XLA_FLAGS", None)
        proc = subprocess.run([sys.executable, "-m", "llds_jax.launch", f"--config={config_path}", *args],
                              cwd=repo_root, env=full_env, capture_output=True, text=True, timeout=600)
        return proc.returncode, proc.stdout, proc.stderr

    return run


@pytest.fixture(scope="session")
def world(tmp_path_factory):
    """(world, files): the demo's generated world of 40 people (50 passages) as corpus.jsonl and QA parquet files."""
    world = synthetic.make_world(num_people=40, seed=0)
    return world, synthetic.write_world(world, str(tmp_path_factory.mktemp("world")))


@pytest.fixture(scope="session")
def policy(tmp_path_factory, world):
    """(HF folder, city, tokenizer): `searching_policy` for the most common answer city of the training questions,
    with a tokenizer trained on the world (the demo's "world" tokenizer: a few hundred entries, so that the output
    layer does not dominate the run on CPU as Qwen2.5's 151,936 rows would)."""
    answers = [ex.golden_answers[0] for ex in world[0].train if ex.golden_answers[0] in synthetic.CITIES]
    city = max(sorted(set(answers)), key=answers.count)
    folder = str(tmp_path_factory.mktemp("policy"))
    tokenizer = load_tokenizer(train_tokenizer(synthetic.tokenizer_texts(world[0]), folder, vocab_size=512,
                                               phrases=synthetic.tokenizer_phrases()))
    hf_io.save_model(searching_policy(tokenizer, city), folder)
    return folder, city, tokenizer
