"""Multi-host training on one machine: two `jax.distributed` processes on loopback (4 fake CPU devices each, gloo
collectives) train two steps of the tiny config and reach the parameters of one process with 8 devices.

Both runs use the same pre-built demo assets (written once here) and a global mesh fsdp=8; each host rolls out its
own half of the prompts on its 4 devices, the updates run on all 8.
"""
import jax
import numpy as np
import pytest

from tests.e2e.runs import finish, latest_checkpoint, read_metrics, start, start_hosts
from tests.servers import free_port

TOLERANCE = 1e-5
# 16 trajectories (4 prompts x 4 samples), 2 updates of 8 per step; micro 8 = the 8 devices of the fsdp axis.
# adam_eps 1 makes each update ~ learning_rate x gradient: with the default eps 1e-8 Adam turns the float noise of
# near-zero gradients (embedding rows of barely used tokens; the sum order differs between the two layouts) into
# steps of +-learning_rate, which would hide what this test measures (the gradients of both runs agreeing).
# top_k 1: each draw is the most likely token. XLA partitions the layers by mesh size, so a host's 4 devices and
# one process's 8 compute logits that differ in the last bits, and a categorical draw over the random policy's
# 151,936 near-equal probabilities (inverting their cumulative sum) then picks another token now and then (2 rows of
# 8 within 48 tokens in a one-process check); a near tie for the top token is far rarer.
OVERRIDES = ("--config.mesh.fsdp=-1", "--config.data.prompts_per_step=4", "--config.data.samples_per_prompt=4",
             "--config.optim.mini_batch_size=8", "--config.optim.micro_batch_size=8",
             "--config.optim.adam_eps=1.0", "--config.optim.learning_rate=1.0", "--config.rollout.top_k=1",
             "--config.train.eval_every=0", "--config.train.final_eval=False", "--config.train.transcripts_every=0",
             "--config.train.checkpoint_every=100")
# Wall-clock measurements differ between runs.
TIMING_KEYS = ("perf/", "rollout/decode_s", "rollout/search_s", "rollout/search_calls_s",
               "rollout/host_s", "rollout/rollout_s", "rollout/sampled_tokens_per_s",
               "time")


def max_abs_diff(a, b) -> float:
    diffs = jax.tree.map(lambda x, y: float(np.max(np.abs(np.asarray(x) - np.asarray(y)))), a, b)
    return max(jax.tree.leaves(diffs))


def assert_same_metrics(one: dict, two: dict) -> None:
    """The same keys; a value undefined in one run (null in metrics.jsonl, e.g. `lld/rate` of a step without a
    correct trajectory) is undefined in the other, and numbers agree within tolerance."""
    assert two.keys() == one.keys()
    for key, value in one.items():
        if value is None or two[key] is None:
            assert (key, two[key]) == (key, value)
        else:
            assert (key, two[key]) == (key, pytest.approx(value, rel=1e-4, abs=1e-5, nan_ok=True))


# How the engine scheduled the rollout: a host's sequence slots (its share of the batch) set the token buckets, so
# one process and two hosts run the same trajectories in other step calls.
SCHEDULE_KEYS = ("rollout/step_calls_", "rollout/step_tokens_", "rollout/decode_occupancy", "rollout/page_copies",
                 "rollout/shared_prompt_tokens", "rollout/preemptions")
# Spreads of a host's own batch (standard deviations, averaged over the hosts: what one host's schedule takes), not
# the whole batch's.
SPREAD_KEYS = ("rollout/prompt_tokens_std", "rollout/turns_std", "rollout/turn_tokens_std",
               "rollout/observation_tokens_std")


def comparable_metrics(run_dir: str) -> list[dict[str, float]]:
    return [{k: v for k, v in r.items() if not k.startswith(TIMING_KEYS + SCHEDULE_KEYS + SPREAD_KEYS)}
            for r in read_metrics(run_dir)]


@pytest.mark.slow
def test_two_hosts_reach_the_parameters_of_one_process(tmp_path, tiny_assets, config_writer):
    config = config_writer(tmp_path / "multihost_config.py", tiny_assets, **{"data.eval_files": []})
    model_dir = tiny_assets["model"]
    single_dir, multi_dir = str(tmp_path / "single"), str(tmp_path / "multi")
    hosts = start_hosts(config, 4, str(tmp_path / "host"), free_port(), f"--config.run_dir={multi_dir}", *OVERRIDES)
    single = start(config, 8, str(tmp_path / "single.log"), f"--config.run_dir={single_dir}", *OVERRIDES)
    outputs = finish([*hosts, single], timeout=600)
    assert "training stopped after step 2 of 2" in outputs[0]

    single_ckpt, initial = latest_checkpoint(single_dir, model_dir)
    multi_ckpt, _ = latest_checkpoint(multi_dir, model_dir)
    assert single_ckpt.step == multi_ckpt.step == 2
    assert max_abs_diff(single_ckpt.params, initial) > 100 * TOLERANCE  # the updates moved the params
    diff = max_abs_diff(single_ckpt.params, multi_ckpt.params)
    print(f"max |params(1 process, 8 devices) - params(2 processes, 4 devices each)| = {diff:.3g}")
    assert diff <= TOLERANCE
    single_metrics, multi_metrics = comparable_metrics(single_dir), comparable_metrics(multi_dir)
    assert [r["step"] for r in multi_metrics] == [1, 2]
    for one, two in zip(single_metrics, multi_metrics):
        assert_same_metrics(one, two)
