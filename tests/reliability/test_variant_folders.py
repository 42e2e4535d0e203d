"""A variant of a run never writes into the folders of a finished run of other settings (issue 66 item "the
documented e5 demo overwrites the finished demo's result"), with the real commands: after the README's demo (small
sizes, as .ci/run), docs/demo.md's e5 variant with the assets folder the demo's message asks for trains in folders
of its own and leaves every file of the BM25 demo byte-identical (before, 0e0871a: it retrained the warm start into
the BM25 demo's cache, which configs/demo_cpu.py pinned, then "resumed" the finished runs/demo_cpu with changed keys
and wrote over its evaluation); naming the finished run's folder is refused in one line naming the settings that
differ, while a resume with another train.total_steps still trains on. A finished warm start of another
fingerprint is refused, not trained over; configs/demo_cpu.py names a variant's folders after its retriever."""
import hashlib
import os
import subprocess
import sys

import pytest

from tests.configs import CONFIGS, load

ROOT = os.path.dirname(CONFIGS)
ERROR = "llds_jax: error: "
# .ci/run's sizes, and a smaller policy: the folders are what is tested.
SMALL = ("--config.demo.num_people=20", "--config.demo.vocab_size=512", "--config.demo.hidden_size=32",
         "--config.demo.num_layers=1", "--config.demo.intermediate_size=64", "--config.sft.steps=4",
         "--config.sft.curriculum_steps=2", "--config.sft.warmup_steps=1", "--config.sft.log_every=2",
         "--config.data.prompts_per_step=2", "--config.data.samples_per_prompt=2",
         "--config.optim.mini_batch_size=2", "--config.optim.micro_batch_size=2", "--config.train.total_steps=1",
         "--config.eval.max_examples=4")
TINY_WORLD = ("--config.demo.tokenizer=world", "--config.demo.vocab_size=512", "--config.demo.num_people=12",
              "--config.sft.enabled=True", "--config.sft.batch_size=8", "--config.sft.warmup_steps=1")


def launch(cwd, config: str, *args: str, launcher: str = "llds_jax.launch") -> subprocess.CompletedProcess:
    """The launch command (or `launcher`, which runs it) in `cwd`, whose relative paths are the config's."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    env.pop("XLA_FLAGS", None)
    return subprocess.run([sys.executable, "-m", launcher, f"--config={os.path.join(CONFIGS, config)}", *args],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


def digests(folder) -> dict[str, str]:
    """sha256 of every file under `folder`, by path."""
    found = {}
    for parent, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(parent, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, folder)] = hashlib.sha256(f.read()).hexdigest()
    return found


def test_a_variant_of_the_demo_gets_folders_of_its_own_unless_they_are_named():
    cfg = load("demo_cpu")
    assert (cfg.run_dir, cfg.demo.assets_dir, cfg.sft.output_dir) == (
        "runs/demo_cpu", "runs/demo_world", "runs/demo_world/warm_start")
    cfg.demo.retriever = "e5_device"  # as --config.demo.retriever=e5_device sets it
    assert (cfg.run_dir, cfg.demo.assets_dir, cfg.sft.output_dir) == (
        "runs/demo_cpu_e5_device", "runs/demo_world_e5_device", "runs/demo_world_e5_device/warm_start")
    named = load("demo_cpu")
    named.demo.retriever, named.demo.assets_dir, named.run_dir = "e5_device", "runs/demo_world_e5", "runs/mine"
    assert (named.run_dir, named.demo.assets_dir, named.sft.output_dir) == (
        "runs/mine", "runs/demo_world_e5", "runs/demo_world_e5/warm_start")  # the warm start follows its assets
    grpo = load("demo_cpu_grpo")
    grpo.demo.retriever = "e5_device"
    assert (grpo.run_dir, grpo.demo.assets_dir) == ("runs/demo_cpu_grpo", "runs/demo_world_e5_device")


@pytest.mark.slow
def test_the_e5_demo_after_the_bm25_demo_leaves_its_results_byte_identical(tmp_path):
    first = launch(tmp_path, "demo_cpu.py", *SMALL)
    assert first.returncode == 0, first.stderr[-4000:]
    bm25 = digests(tmp_path / "runs")
    assert "demo_cpu/eval/final_step_1/results.json" in bm25 and "demo_world/warm_start/warm_start.json" in bm25
    e5 = launch(tmp_path, "demo_cpu.py", *SMALL, "--config.demo.retriever=e5_device",
                "--config.demo.assets_dir=runs/demo_world_e5", launcher="tests.reliability.without_torch")
    assert e5.returncode == 0, e5.stderr[-4000:]
    after = digests(tmp_path / "runs")
    assert {path: digest for path, digest in after.items() if path in bm25} == bm25
    assert "warm start: done in" in e5.stdout and "run folder runs/demo_cpu_e5_device" in e5.stdout
    assert sorted({path.split("/")[0] for path in after}) == ["demo_cpu", "demo_cpu_e5_device", "demo_world",
                                                              "demo_world_e5"]
    assert os.path.exists(tmp_path / "runs" / "demo_world_e5" / "warm_start" / "warm_start.json")
    named = launch(tmp_path, "demo_cpu.py", *SMALL, "--config.demo.retriever=e5_device",
                   "--config.demo.assets_dir=runs/demo_world_e5", "--config.run_dir=runs/demo_cpu")
    assert (named.returncode, named.stderr) == (2, (
        f"{ERROR}run_dir runs/demo_cpu was written for other settings (demo.retriever 'bm25' there, 'e5_device' "
        "here): nothing was written or deleted; set run_dir to another folder (or delete that one)\n"))
    assert digests(tmp_path / "runs") == after
    resumed = launch(tmp_path, "demo_cpu.py", *SMALL, "--config.train.total_steps=2")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert ("resuming runs/demo_cpu from step 1 with 1 changed config key(s): train.total_steps: 1 -> 2"
            in resumed.stderr)
    assert "training stopped after step 2 of 2" in resumed.stdout


@pytest.mark.slow
def test_a_finished_warm_start_of_another_fingerprint_is_refused_not_trained_over(tmp_path):
    args = ("--mode=sft", f"--config.run_dir={tmp_path / 'run'}", f"--config.demo.assets_dir={tmp_path / 'assets'}",
            *TINY_WORLD, "--config.sft.log_every=1")
    first = launch(tmp_path, "tiny_test.py", *args, "--config.sft.steps=2")
    assert first.returncode == 0, first.stderr[-4000:]
    warm = tmp_path / "run" / "warm_start"
    before = digests(warm)
    again = launch(tmp_path, "tiny_test.py", *args, "--config.sft.steps=3")
    assert again.returncode == 2 and again.stderr.startswith(
        f"{ERROR}sft.output_dir {warm} was written for other settings (fingerprint '"), again.stderr[-4000:]
    assert again.stderr.endswith("here): nothing was written or deleted; set sft.output_dir to another folder (or "
                                 "delete that one)\n") and again.stderr.count("\n") == 1
    assert digests(warm) == before
    reused = launch(tmp_path, "tiny_test.py", *args, "--config.sft.steps=2")
    assert reused.returncode == 0 and f"warm start: reusing {warm}" in reused.stdout
