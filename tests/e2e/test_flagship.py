"""The flagship config rehearsed: `python -m llds_jax.launch --config=configs/qwen7b_v4.py` itself, as the two hosts
of a pod (jax.distributed over loopback, 2 fake CPU devices each; the config's mesh fsdp=-1 spans all 4), searching
an Elasticsearch index (noida-db, or the cluster at env LLDS_ES_URL) built with `python -m index_builder`.

Only what shrinks the run is overridden (SHRINK, plus the paths and the retriever's address): a tiny Qwen2 policy,
4 prompts x 2 samples per step in sampler sessions of 2 sequences, 5 steps, short turns, LLD measured every step.
Model, data, run folder and export folder live on gs://, in a bucket of a GCS emulator (fake-gcs-server), as on a
pod. Everything else is the config's: bfloat16 compute with remat and scanned layers, its named `bm25_es`
retriever (Elasticsearch; the default e5 retriever needs an e5 model and faiss index) and its request policy, GRPO + LLDS, the checkpoint policy, the final evaluation.

The policy (`searching_policy`) makes the run checkable: greedy decoding searches in every turn; sampling searches,
answers or mixes the tags; so training and evaluation both query Elasticsearch.
"""
import asyncio
import json
import re
import signal
import subprocess
import sys
import uuid

import numpy as np
import pytest
import torch
from etils import epath
from flax import nnx
from transformers import AutoModelForCausalLM, AutoTokenizer

from llds_jax.data.iterator import PromptIterator
from llds_jax.model import hf_io
from llds_jax import protocol
from llds_jax.search import make_retriever
from llds_jax.train.trainer import read_examples
from tests.e2e.runs import (ROOT, finish, latest_checkpoint, read_metrics, start_hosts, steps_saved,
                           wait_for_text)
from tests.servers import delete_es_index, free_port

QWEN7B = f"{ROOT}/configs/qwen7b_v4.py:bm25_es"  # its named Elasticsearch (BM25) retriever: no e5 model here
DEVICES = 2  # fake CPU devices per host
TOTAL_STEPS = 5
PROMPTS_PER_STEP = 4
EVAL_EXAMPLES = 4
SHRINK = (
    "--config.model.preset=",  # the tiny policy is not Qwen2.5-7B (a run checks the checkpoint against the preset)
    f"--config.data.prompts_per_step={PROMPTS_PER_STEP}", "--config.data.samples_per_prompt=2",
    "--config.rollout.max_batch_size=2",  # each host's 4 sequences in 2 sessions (the config: 2560 in 5 sessions)
    "--config.rollout.num_pages=0", "--config.rollout.max_step_tokens=2048",  # the pool for the 2 slots
    "--config.optim.mini_batch_size=4",  # 2 updates per step
    "--config.optim.micro_batch_size=4",  # the 4 devices of the fsdp axis
    "--config.rollout.max_turn_tokens=10", "--config.rollout.max_observation_tokens=64",
    "--config.rollout.max_prompt_tokens=256", "--config.rollout.max_context_tokens=512",
    "--config.optim.logp_time_chunk=64", "--config.train.sequence_bucket=64",
    f"--config.train.total_steps={TOTAL_STEPS}", "--config.train.lld_every=1",
    f"--config.eval.max_examples={EVAL_EXAMPLES}",
)
TIMEOUT_S = 300  # per launch


def copy_tree(source, target) -> None:
    """Copies the file or folder `source` to `target` (each local or gs://)."""
    source, target = epath.Path(source), epath.Path(target)
    if source.is_dir():
        target.mkdir(parents=True, exist_ok=True)
        for child in source.iterdir():
            copy_tree(child, target / child.name)
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(source.read_bytes())


@pytest.fixture
def storage_root(gcs_dir) -> str:
    """Where model, data, run folder and export live: a gs:// folder of the emulator's bucket."""
    return gcs_dir


@pytest.fixture(scope="module")
def es_index(es_url, world):
    """An index of the world's corpus on `es_url`, built with the real command; deleted afterwards."""
    name = f"llds-flagship-{uuid.uuid4().hex[:8]}"
    built = subprocess.run([sys.executable, "-m", "index_builder", world[1]["corpus.jsonl"], "--to", "elasticsearch",
                            "--es-hosts", es_url, "--es-index", name, "--no-progress"], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
    assert built.returncode == 0 and "index now holds 50 documents" in built.stdout, built.stdout + built.stderr
    yield name
    delete_es_index(es_url, name)


def put_assets(root: str, world_files: dict[str, str], policy_dir: str) -> dict[str, str]:
    """Copies the policy and the QA files under `root`; returns the paths of model, train, test, run and export."""
    base = epath.Path(root)
    paths = {"model": base / "models" / "tiny_qwen2", "train": base / "data" / "train.parquet",
             "test": base / "data" / "test.parquet", "run": base / "runs" / "flagship", "export": base / "export"}
    copy_tree(policy_dir, paths["model"])
    copy_tree(world_files["train.parquet"], paths["train"])
    copy_tree(world_files["test.parquet"], paths["test"])
    return {name: str(path) for name, path in paths.items()}


def flagship_args(paths: dict[str, str], es_url: str, index: str) -> tuple[str, ...]:
    """The command-line overrides of every launch: paths, retriever address and SHRINK."""
    return (f"--config.run_dir={paths['run']}", f"--config.model.path={paths['model']}",
            f"--config.data.train_files={paths['train']}", f"--config.data.eval_files={paths['test']}",
            f"--config.retriever.hosts={es_url}", f"--config.retriever.index={index}", *SHRINK)


def launch_pod(args: tuple[str, ...], log_prefix: str, env: dict[str, str]) -> list[str]:
    """Both hosts of one launch, run to the end; their outputs."""
    return finish(start_hosts(QWEN7B, DEVICES, log_prefix, free_port(), *args, env=env), TIMEOUT_S)


def search_observation(es_url: str, index: str, query: str, k: int) -> str:
    """The observation the agent builds from Elasticsearch's top-`k` documents for `query`."""
    async def search():
        async with make_retriever({"backend": "elasticsearch", "hosts": es_url, "index": index}) as retriever:
            return await retriever.search([query], k)

    (result,) = asyncio.run(search())
    assert result.error is None
    return protocol.format_observation([doc.contents for doc in result.docs])


def assert_clean(outputs: list[str]) -> None:
    """No traceback and no collective (gloo) message other than its connection notes in any host's output."""
    for out in outputs:
        assert "Traceback" not in out, out[-4000:]
        assert [line for line in out.splitlines() if "gloo" in line.lower() and "is connected to" not in line] == []


@pytest.mark.slow
def test_flagship_config_on_two_hosts(tmp_path, storage_root, gcs_env, es_url, es_index, world, policy):
    paths = put_assets(storage_root, world[1], policy[0])
    args = flagship_args(paths, es_url, es_index)
    run_dir = paths["run"]
    # Later launches reuse what earlier ones compiled; the hosts' GCS clients reach the emulator.
    env = {"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax_cache"), **gcs_env}

    # SIGTERM to host 1 once host 0 printed step 1, so during step 2 or a later one (compiled, a step takes a
    # second or two): both hosts agree on the stop between two sessions or updates of that step (then they save the
    # step before it) or at its end (then they save it), and exit 0.
    hosts = start_hosts(QWEN7B, DEVICES, str(tmp_path / "train"), free_port(), *args, env=env)
    wait_for_text(hosts, f"step 1/{TOTAL_STEPS}", TIMEOUT_S)
    hosts[1].process.send_signal(signal.SIGTERM)
    outputs = finish(hosts, TIMEOUT_S)
    assert_clean(outputs)
    stopped = int(re.search(r"training stopped after step (\d+) of", outputs[0]).group(1))
    assert 1 <= stopped < TOTAL_STEPS and "training stopped" not in outputs[1]
    assert "received SIGTERM" in outputs[1] and "received SIGTERM" not in outputs[0]
    stops = (f"stop requested during the rollout of step {stopped + 1}: saved the state before it, exiting",
             f"stop requested during the updates of step {stopped + 1}: saved the state before it, exiting",
             f"stop requested: saved step {stopped}, exiting")
    assert all(sum(stop in out for stop in stops) == 1 for out in outputs)
    assert steps_saved(run_dir) == [stopped]

    # The same command resumes after that step and ends with the final evaluation.
    outputs = launch_pod(args, str(tmp_path / "resume"), env)
    assert_clean(outputs)
    assert all(f"resumed from step {stopped} of" in out for out in outputs)
    assert f"training stopped after step {TOTAL_STEPS} of {TOTAL_STEPS}" in outputs[0] and "exact match" in outputs[0]
    assert steps_saved(run_dir) == [stopped, TOTAL_STEPS]
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, TOTAL_STEPS + 1))
    assert all("lld/rate" in r for r in records)
    assert sum(r["rollout/valid_searches"] for r in records) > 0
    cfg = json.loads((epath.Path(run_dir) / "config.json").read_text())  # the config as the run resolved it
    examples = read_examples([paths["train"]], "train_files", cfg["reward"]["empty_answer"],
                             cfg["rollout"]["max_prompt_tokens"])
    expected = PromptIterator(examples, PROMPTS_PER_STEP, cfg["seed"])
    for _ in range(TOTAL_STEPS):
        next(expected)
    final, initial = latest_checkpoint(run_dir, paths["model"])
    assert final.step == TOTAL_STEPS and final.meta["data"] == expected.state()

    # --mode=eval on both hosts. Greedy, the policy searches `city` in every turn: eval.max_turns searches answered
    # by Elasticsearch, then the final turn's search, which is not run but counted (as Search-R1 counts).
    outputs = launch_pod((*args, "--mode=eval"), str(tmp_path / "eval"), env)
    assert_clean(outputs)
    assert "exact match" in outputs[0] and "exact match" not in outputs[1]  # the tables: process 0 only
    eval_dir = epath.Path(run_dir) / "eval" / f"final_step_{TOTAL_STEPS}"
    results = json.loads((eval_dir / "results.json").read_text())
    max_turns = cfg["eval"]["max_turns"]
    assert results["em"]["mean"] == 0.0 and results["searches"]["mean"] == max_turns + 1
    assert sum(results["counts"].values()) == EVAL_EXAMPLES
    observation = search_observation(es_url, es_index, policy[1], cfg["rollout"]["retrieval_top_k"])
    for line in (eval_dir / "transcripts.jsonl").read_text().splitlines():
        turns = [(t["action"], t["content"], t["observation"]) for t in json.loads(line)["turns"]]
        assert turns == [("search", policy[1], observation)] * max_turns + [("search", policy[1], None)]

    # --mode=export on both hosts: the checkpoint's weights (trained: they moved) in a folder transformers reads and
    # computes our model's logits with.
    outputs = launch_pod((*args, "--mode=export", f"--export_dir={paths['export']}"), str(tmp_path / "export"), env)
    assert_clean(outputs)
    assert f"exported step {TOTAL_STEPS} to {paths['export']}" in outputs[0]
    local_export = tmp_path / "export_copy"
    copy_tree(paths["export"], local_export)
    exported = AutoModelForCausalLM.from_pretrained(str(local_export))
    assert AutoTokenizer.from_pretrained(str(local_export)).get_vocab() == policy[2].get_vocab()
    ours = hf_io.load_model(paths["model"], dtype="float32", param_dtype="float32")
    nnx.update(ours, final.params)
    tokens = policy[2].encode(f"<answer>{policy[1]}</answer> Where was Tuso born?", add_special_tokens=False)
    with torch.no_grad():
        theirs = exported(torch.tensor([tokens])).logits.numpy()
    np.testing.assert_allclose(theirs, np.asarray(ours(np.asarray([tokens]))), atol=1e-5)
    trained = np.asarray(final.params["lm_head"].get_value())
    assert not np.array_equal(trained, np.asarray(initial["lm_head"].get_value()))
    np.testing.assert_array_equal(exported.lm_head.weight.detach().numpy().T, trained)
