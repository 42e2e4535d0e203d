"""Expected lengths of a step (llds_jax.step_lengths): the defaults, a run's logged metrics, and what they change in
the estimate's decode and update calls."""
import dataclasses
import json

import pytest

from llds_jax import step_lengths
from tests.configs import load


def test_defaults_are_capped_by_the_config_and_say_they_are_assumed():
    cfg = load("qwen7b_v4")  # 3 search turns, 500-token turns and observations, 4096-token trajectories
    lengths = step_lengths.defaults(cfg)
    assert (lengths.sampled_tokens, lengths.trajectory_tokens, lengths.searches) == (2.5 * 150, 250 + 375 + 600, 1.5)
    assert lengths.decode_occupancy is None and lengths.padding == 0 and "assumed, not measured" in lengths.source
    cfg.rollout.max_turns, cfg.rollout.max_turn_tokens, cfg.rollout.max_observation_tokens = 1, 100, 300
    cfg.rollout.max_context_tokens = 500
    short = step_lengths.defaults(cfg)
    assert (short.sampled_tokens, short.trajectory_tokens, short.searches) == (200, 500, 1)


def records():
    # Two steps of 64 trajectories: 6400 and 9600 real tokens trained (tokens/s x seconds).
    return [{"step": 0, "eval/em_mean": 0.1},
            {"step": 1, "rollout/response_length": 30.0, "rollout/valid_searches": 0.5, "rollout/decode_occupancy": 0.5,
             "perf/tokens_per_s": 640.0, "perf/step_s": 10.0, "rollout/trajectories": 64, "perf/padding": 0.1},
            {"step": 2, "rollout/response_length": 50.0, "rollout/valid_searches": 1.5, "rollout/decode_occupancy": 0.3,
             "perf/tokens_per_s": 960.0, "perf/step_s": 10.0, "rollout/trajectories": 64, "perf/padding": 0.3}]


def test_a_runs_logged_metrics_give_mean_lengths(tmp_path):
    lengths = step_lengths.from_metrics(records(), "the run r")
    assert lengths == step_lengths.Lengths(40.0, 125.0, 1.0, 0.4, pytest.approx(0.2), "the run r: means over its 2 steps")
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records()))
    assert step_lengths.from_run(str(tmp_path)).sampled_tokens == 40.0
    old = [{k: v for k, v in r.items() if k != "rollout/trajectories"} for r in records()]
    with pytest.raises(ValueError, match="the run r: steps without rollout/trajectories"):
        step_lengths.from_metrics(old, "the run r")
    with pytest.raises(ValueError, match="no step logged rollout/response_length"):
        step_lengths.from_metrics(records()[:1], "the run r")
    (tmp_path / "metrics.jsonl").write_text(json.dumps(records()[1]) + "\n{oops\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl, line 2: not JSON"):
        step_lengths.from_run(str(tmp_path))


def test_the_decode_follows_the_occupancy_or_a_continuous_batchs_tokens_and_the_updates_the_packed_tokens():
    """Worst case 4 turns x 500 = 2000 decode steps per session. A session sampling 375 tokens per row at
    occupancy 0.25 runs 1500 of them; a continuous batch of 128 rows over 640 conversations (5 sessions' worth)
    runs 640 x 375 / 128 = 1875 steps, 375 per session's worth. Packed updates follow 1225 tokens (+ padding) of
    4096; unpacked ones the worst case."""
    cfg = load("qwen7b_v4")
    lengths = step_lengths.Lengths(375.0, 1225.0, 1.5, 0.25, 0.125, "test")
    assert step_lengths.decode_share(cfg, lengths, 640, 128) == 0.75
    assert step_lengths.decode_share(cfg, step_lengths.defaults(cfg), 640, 128) == 1.0
    busy = dataclasses.replace(lengths, decode_occupancy=0.1)  # 3750 steps: more than the worst case, capped
    assert step_lengths.decode_share(cfg, busy, 640, 128) == 1.0
    cfg.rollout.continuous_batching = True
    assert step_lengths.decode_share(cfg, lengths, 640, 128) == 375 / 2000
    assert step_lengths.update_share(cfg, lengths) == 1225 / 0.875 / 4096
    cfg.optim.pack_trajectories = False
    assert step_lengths.update_share(cfg, lengths) == 1.0
