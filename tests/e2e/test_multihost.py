"""Multi-host training on one machine: two `jax.distributed` processes on loopback (4 fake CPU devices each, gloo
collectives) train two steps of the tiny config and reach the parameters of one process with 8 devices.

Both runs use the same pre-built demo assets (written once here) and a global mesh fsdp=8; each host rolls out its
own half of the prompts on its 4 devices, the updates run on all 8.
"""
import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from llds_jax.model import hf_io
from llds_jax.train.checkpoint import Checkpointer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOLERANCE = 1e-5
# 16 trajectories (4 prompts x 4 samples), 2 updates of 8 per step; micro 8 = the 8 devices of the fsdp axis.
# adam_eps 1 makes each update ~ learning_rate x gradient: with the default eps 1e-8 Adam turns the float noise of
# near-zero gradients (embedding rows of barely used tokens; the sum order differs between the two layouts) into
# steps of +-learning_rate, which would hide what this test measures (the gradients of both runs agreeing).
OVERRIDES = ("--config.mesh.fsdp=-1", "--config.data.prompts_per_step=4", "--config.data.samples_per_prompt=4",
             "--config.optim.mini_batch_size=8", "--config.optim.micro_batch_size=8",
             "--config.optim.adam_eps=1.0", "--config.optim.learning_rate=1.0",
             "--config.train.eval_every=0", "--config.train.final_eval=False", "--config.train.transcripts_every=0",
             "--config.train.checkpoint_every=100")
# Wall-clock measurements differ between runs.
TIMING_KEYS = ("perf/", "rollout/decode_s", "rollout/search_s", "rollout/search_calls_s", "rollout/prefill_s",
               "rollout/host_s", "rollout/rollout_s", "rollout/sampled_tokens_per_s",
               "time")

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(config: str, run_dir: str, devices: int, *extra: str) -> subprocess.Popen:
    """`python -m llds_jax.launch` on `devices` fake CPU devices."""
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, "-m", "llds_jax.launch", f"--config={config}", f"--config.run_dir={run_dir}",
           *OVERRIDES, *extra]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(procs: list[subprocess.Popen], timeout: float) -> list[str]:
    """Waits for every process; asserts exit status 0; returns their outputs."""
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-4000:]
    return outputs


def final_params(run_dir: str, model_dir: str):
    """(step, params) of the run's latest checkpoint, restored onto one device."""
    model = hf_io.load_model(model_dir, dtype="float32", param_dtype="float32")
    ckpt = Checkpointer(os.path.join(run_dir, "checkpoints"), save_every=1, keep=1 << 30)
    try:
        restored = ckpt.restore_latest(nnx.state(model, nnx.Param))
    finally:
        ckpt.close()
    return restored.step, restored.params, nnx.state(model, nnx.Param)


def max_abs_diff(a, b) -> float:
    diffs = jax.tree.map(lambda x, y: float(np.max(np.abs(np.asarray(x) - np.asarray(y)))), a, b)
    return max(jax.tree.leaves(diffs))


def comparable_metrics(run_dir: str) -> list[dict[str, float]]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return [{k: v for k, v in r.items() if not k.startswith(TIMING_KEYS)} for r in records]


@pytest.mark.slow
def test_two_hosts_reach_the_parameters_of_one_process(tmp_path, tiny_assets, config_writer):
    config = config_writer(tmp_path / "multihost_config.py", tiny_assets, **{"data.eval_files": []})
    model_dir = tiny_assets["model"]
    single_dir, multi_dir = str(tmp_path / "single"), str(tmp_path / "multi")
    port = free_port()
    hosts = [start(config, multi_dir, 4, f"--config.distributed.coordinator_address=127.0.0.1:{port}",
                   "--config.distributed.num_processes=2", f"--config.distributed.process_id={pid}")
             for pid in (0, 1)]
    single = start(config, single_dir, 8)
    outputs = finish([*hosts, single], timeout=600)
    assert "training stopped after step 2 of 2" in outputs[0]

    single_step, single_params, initial = final_params(single_dir, model_dir)
    multi_step, multi_params, _ = final_params(multi_dir, model_dir)
    assert single_step == multi_step == 2
    assert max_abs_diff(single_params, initial) > 100 * TOLERANCE  # the updates moved the params
    diff = max_abs_diff(single_params, multi_params)
    print(f"max |params(1 process, 8 devices) - params(2 processes, 4 devices each)| = {diff:.3g}")
    assert diff <= TOLERANCE
    single_metrics, multi_metrics = comparable_metrics(single_dir), comparable_metrics(multi_dir)
    assert [r["step"] for r in multi_metrics] == [1, 2]
    for one, two in zip(single_metrics, multi_metrics):
        assert two == pytest.approx(one, rel=1e-4, abs=1e-5, nan_ok=True)
