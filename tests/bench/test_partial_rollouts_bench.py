"""bench/partial_rollouts.py: its per-arm summary against a hand computation, and the whole bench at its smallest
settings (slow: three trainers compile)."""
import os
import pathlib
import subprocess
import sys

import pytest

from tests.bench.loading import load_bench

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_arms_differ_in_partial_and_over_sampling_alone():
    bench = load_bench("partial_rollouts")
    assert bench.arms([1.5, 2.0]) == {
        "sync": ["rollout.partial=False"],
        "partial x1.5": ["rollout.partial=True", "rollout.over_sampling=1.5"],
        "partial x2": ["rollout.partial=True", "rollout.over_sampling=2.0"]}


def test_summary_leaves_out_step_one_and_steps_that_compiled_and_weighs_tokens_per_s_by_seconds():
    bench = load_bench("partial_rollouts")
    step = {"perf/rollout_s": 1.0, "reward/mean": 0.5, "lld/is_ess": 1.0, "rollout/partial/staleness_mean": 0.0,
            "rollout/partial/stale_token_share": 0.0, "rollout/partial/resumed": 0.0, "rollout/partial/dropped": 0.0,
            "compile_s": 0.0}
    records = [{**step, "perf/step_s": 60.0, "compile_s": 50.0, "trained_tokens": 1.0,
                "rollout/partial/carried": 100.0},
               {**step, "perf/step_s": 2.0, "trained_tokens": 400.0, "rollout/partial/carried": 8.0,
                "lld/is_ess": 0.9, "rollout/partial/staleness_mean": 0.2},
               {**step, "perf/step_s": 55.0, "compile_s": 51.0, "trained_tokens": 500.0,
                "rollout/partial/carried": 16.0},
               {**step, "perf/step_s": 3.0, "trained_tokens": 600.0, "rollout/partial/carried": 4.0,
                "lld/is_ess": 0.8, "rollout/partial/staleness_mean": 0.4}]
    got = bench.summary(records)
    assert (got["first_step_s"], got["steps"], got["compiling_steps"], got["compiling_s"]) == (60.0, 2, 1, 55.0)
    assert got["perf/step_s"] == 2.5  # steps 2 and 4; step 3 compiled
    assert got["tokens_per_s"] == 1000.0 / 5.0  # steps 2 and 4: 1000 tokens in 5 s
    assert got["rollout/partial/carried"] == 12.0  # a sum over steps 2 and 4
    assert got["lld/is_ess"] == pytest.approx(0.85) and got["rollout/partial/staleness_mean"] == pytest.approx(0.3)
    sync = bench.summary([{k: v for k, v in r.items() if not k.startswith("rollout/partial/")} for r in records])
    assert sync["rollout/partial/carried"] == 0.0  # a synchronous step logs no partial metric: it carries nothing
    lines = bench.format_table({"sync": sync, "partial x2": got})
    assert "1 (55.0 s)" in lines[2] and lines[-1].startswith("partial x2 / sync: seconds per step 1.00x,")
    every = bench.summary([records[0], records[2]])  # every later step compiled: the means are over them
    assert (every["steps"], every["perf/step_s"]) == (1, 55.0)


@pytest.mark.slow
def test_the_bench_prints_each_arm_side_by_side_and_the_ratios():
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # one CPU device, like a plain user run (the demo config's mesh is one device)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    tiny = ["data.prompts_per_step=2", "data.samples_per_prompt=4", "optim.mini_batch_size=8",
            "optim.micro_batch_size=8"]
    cmd = [sys.executable, str(ROOT / "bench" / "partial_rollouts.py"), "--steps", "2", "--over-sampling", "2",
           *(a for o in tiny for a in ("--override", o))]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {line[:28].strip(): line[28:].split() for line in proc.stdout.splitlines()}
    assert rows[""] == ["sync", "partial", "x2"]
    bench = load_bench("partial_rollouts")
    for label, _, _ in bench.ROWS:
        assert len(rows[label.strip()]) == 2, proc.stdout
    # 4 groups of 4 started, 2 trained: the other 2 groups' 8 conversations are carried; sync carries none
    assert rows["conversations carried"] == ["0.000", "8.000"]
    assert rows["staleness mean (versions)"][0] == "0.000" and float(rows["lld/is_ess"][0]) > 0.99
    assert all(float(v) > 0 for v in rows["trained tokens per second"])
    assert "partial x2 / sync: seconds per step " in proc.stdout and "trained tokens per second " in proc.stdout
