"""The demo's e5 variant on the base install, where torch is absent (issue 66 item "the e5 demo on the base install
ends in a traceback"), with the real command under tests/reliability/without_torch.py: the assets' small random
encoder is written with numpy and safetensors, and a build killed half way (here right after the encoder is written)
leaves a folder that the same command finishes. Before (0e0871a), `write_random_bert` imported torch: a 34-line
traceback ending in `ModuleNotFoundError: No module named 'torch'`, and a half-built assets folder."""
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.configs import CONFIGS

ROOT = os.path.dirname(CONFIGS)
TIMEOUT_S = 300


def command(tmp_path) -> list[str]:
    return [sys.executable, "-m", "tests.reliability.without_torch",
            f"--config={os.path.join(CONFIGS, 'tiny_test.py')}", "--mode=eval", f"--config.run_dir={tmp_path / 'run'}", f"--config.demo.assets_dir={tmp_path / 'assets'}",
            "--config.demo.retriever=e5_device"]


def environment() -> dict[str, str]:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    return env


@pytest.mark.slow
def test_the_e5_demo_builds_its_encoder_without_torch_and_a_half_built_folder_is_finished(tmp_path):
    encoder = tmp_path / "assets" / "e5" / "model.safetensors"
    with open(tmp_path / "killed.log", "w") as log:
        process = subprocess.Popen(command(tmp_path), cwd=ROOT, env=environment(), stdout=log,
                                   stderr=subprocess.STDOUT)
        deadline = time.monotonic() + TIMEOUT_S
        while not encoder.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        process.send_signal(signal.SIGKILL)
        process.wait(TIMEOUT_S)
    assert encoder.exists(), (tmp_path / "killed.log").read_text()[-4000:]
    assert not (tmp_path / "assets" / "COMPLETE").exists()  # half built
    proc = subprocess.run(command(tmp_path), cwd=ROOT, env=environment(), capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr and "torch" not in proc.stderr
    assert f"retriever e5_device (encoder_path {tmp_path / 'assets' / 'e5'}" in proc.stdout
    assert "exact match" in proc.stdout
    assert sorted(os.listdir(tmp_path / "assets")) == [".llds_jax_output", "COMPLETE", "e5", "e5_index", "index",
                                                       "model", "world"]
