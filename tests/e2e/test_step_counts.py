"""The step estimate's rollout against a run (issue 54 item 5): the paged engine's step calls per token bucket
predicted from a short run's logged lengths (`llds_jax.rollout_schedule`, what `--mode=compile
--estimate_from=RUN_DIR` prints) agree with the calls the run logged, under both policies."""
import json
import os
import subprocess
import sys

import ml_collections
import pytest

from llds_jax import config as config_lib
from llds_jax import rollout_schedule, step_lengths

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# configs/tiny_test.py (its random 1-layer policy over the demo world) with 32 trajectories of up to 3 turns in
# sessions of 8 slots, turns of up to 16 tokens sampled 4 per call, steps of up to 64 tokens in pages of 8.
SETTINGS = ("--config.data.prompts_per_step=8", "--config.data.samples_per_prompt=4",
            "--config.rollout.max_batch_size=8", "--config.rollout.max_turns=2", "--config.rollout.max_turn_tokens=16",
            "--config.rollout.decode_chunk=4", "--config.rollout.max_step_tokens=64", "--config.rollout.page_size=8",
            "--config.train.total_steps=1", "--config.train.eval_every=0", "--config.train.final_eval=False",
            "--config.optim.mini_batch_size=32", "--config.optim.micro_batch_size=8")


@pytest.mark.slow
@pytest.mark.parametrize("continuous", [False, True], ids=["barrier", "continuous"])
def test_predicted_step_calls_agree_with_a_runs_within_10_percent(tmp_path, continuous):
    run_dir = str(tmp_path / "run")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    result = subprocess.run([sys.executable, "-m", "llds_jax.launch", "--config=configs/tiny_test.py",
                             f"--config.run_dir={run_dir}", *SETTINGS,
                             f"--config.rollout.continuous_batching={continuous}"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    with open(os.path.join(run_dir, "config.json")) as f:
        cfg = ml_collections.ConfigDict(json.load(f))
    records = step_lengths.read_records(run_dir)
    logged = step_lengths.logged_step_counts(records, run_dir)
    lengths = step_lengths.from_metrics(records, run_dir)
    schedule = rollout_schedule.for_run(cfg, lengths, config_lib.rollout_batch_size(cfg))
    assert schedule.policy == ("continuous" if continuous else "barrier")
    total = sum(calls for calls, _ in logged.values())
    assert len(schedule.calls) == pytest.approx(total, rel=0.1)
    dominant = [b for b, (calls, _) in logged.items() if calls >= 0.2 * total]
    assert dominant
    for bucket in dominant:
        calls, tokens = logged[bucket]
        assert schedule.calls_per_bucket.get(bucket, 0) == pytest.approx(calls, rel=0.1), bucket
        assert schedule.tokens_per_bucket.get(bucket, 0) == pytest.approx(tokens, rel=0.1), bucket
