"""Expected lengths of a step (llds_jax.aot.step_lengths): the defaults, the worst case, a run's logged metrics and step
counts, and what they change in the estimate's updates."""
import dataclasses
import json
import math

import pytest

from llds_jax import config as config_lib
from llds_jax.aot import step_lengths
from tests.configs import load


def test_defaults_are_capped_by_the_config_and_say_they_are_assumed():
    cfg = load("qwen7b_v4")  # 3 search turns, 500-token turns and observations, 4096-token trajectories
    lengths = step_lengths.defaults(config_lib.typed(cfg))
    assert (lengths.prompt_tokens, lengths.turns, lengths.sampled_tokens, lengths.observation_tokens) == (
        250, 2.5, 2.5 * 150, 400)
    assert (lengths.trajectory_tokens, lengths.searches) == (250 + 375 + 600, 1.5)
    assert lengths.padding == 0 and "assumed, not measured" in lengths.source
    # The turns' sampled tokens spread over 75 to 225 (a uniform's standard deviation), nothing else spread.
    assert (lengths.prompt_tokens_std, lengths.turns_std, lengths.observation_tokens_std) == (0, 0, 0)
    assert lengths.turn_tokens_std == pytest.approx(75 / math.sqrt(3))
    cfg.rollout.max_turns, cfg.rollout.max_turn_tokens, cfg.rollout.max_observation_tokens = 1, 100, 300
    cfg.rollout.max_context_tokens, cfg.rollout.max_prompt_tokens = 500, 200
    short = step_lengths.defaults(config_lib.typed(cfg))
    assert (short.prompt_tokens, short.sampled_tokens, short.trajectory_tokens, short.searches) == (200, 200, 500, 1)


def test_the_worst_case_takes_every_turn_and_token_cap():
    worst = step_lengths.worst_case(config_lib.typed(load("qwen7b_v4")))
    assert (worst.prompt_tokens, worst.turns, worst.sampled_tokens, worst.observation_tokens) == (2048, 4, 2000, 500)
    assert (worst.trajectory_tokens, worst.searches) == (4096, 3)


def records():
    # Two steps of 64 trajectories: 6400 and 9600 real tokens trained (tokens/s x seconds); the paged engine's calls
    # of its 16- and 32-token buckets.
    return [{"step": 0, "eval/em_mean": 0.1},
            {"step": 1, "rollout/prompt_tokens": 6400.0, "rollout/turns": 2.0, "rollout/sampled_tokens": 1280.0,
             "rollout/observation_tokens": 3200.0, "rollout/searches": 32.0, "rollout/prompt_tokens_std": 10.0,
             "rollout/turns_std": 0.5, "rollout/turn_tokens_std": 4.0, "rollout/observation_tokens_std": 6.0,
             "rollout/decode_occupancy": 0.5, "perf/tokens_per_s": 640.0,
             "perf/step_s": 10.0, "rollout/trajectories": 64, "perf/padding": 0.1, "rollout/step_calls_16": 10.0,
             "rollout/step_tokens_16": 100.0, "rollout/step_calls_32": 4.0, "rollout/step_tokens_32": 120.0},
            {"step": 2, "rollout/prompt_tokens": 6400.0, "rollout/turns": 3.0, "rollout/sampled_tokens": 2560.0,
             "rollout/observation_tokens": 6400.0, "rollout/searches": 96.0, "rollout/prompt_tokens_std": 20.0,
             "rollout/turns_std": 0.7, "rollout/turn_tokens_std": 8.0, "rollout/observation_tokens_std": 2.0,
             "rollout/decode_occupancy": 0.3, "perf/tokens_per_s": 960.0,
             "perf/step_s": 10.0, "rollout/trajectories": 64, "perf/padding": 0.3, "rollout/step_calls_16": 20.0,
             "rollout/step_tokens_16": 200.0, "rollout/step_calls_32": 0.0, "rollout/step_tokens_32": 0.0}]


def test_a_runs_logged_metrics_give_mean_lengths_and_step_counts(tmp_path):
    """Per trajectory: prompts of 100, 2.5 turns, (20 + 40) / 2 sampled tokens, (50 + 100) / 2 observation tokens
    over 1.5 observations, (0.5 + 1.5) / 2 searches, (100 + 150) / 2 tokens trained; the spreads' means."""
    lengths = step_lengths.from_metrics(records(), "the run r")
    assert lengths == step_lengths.Lengths(100.0, 2.5, 30.0, 50.0, 125.0, 1.0, 15.0, 0.6, 6.0, 4.0,
                                           pytest.approx(0.2), "the run r: means over its 2 steps")
    assert step_lengths.logged_step_counts(records(), "r") == {16: (15.0, 150.0), 32: (2.0, 60.0)}
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records()))
    assert step_lengths.read_records(str(tmp_path)) == records()
    old = [{k: v for k, v in r.items() if k not in ("rollout/turns", "rollout/turns_std")} for r in records()]
    with pytest.raises(ValueError, match="the run r: steps without rollout/turns, rollout/turns_std"):
        step_lengths.from_metrics(old, "the run r")
    with pytest.raises(ValueError, match="no step logged rollout/trajectories"):
        step_lengths.from_metrics(records()[:1], "the run r")
    dense = [{k: v for k, v in r.items() if "step_" not in k} for r in records()]
    with pytest.raises(ValueError, match="no rollout/step_calls_T logged"):
        step_lengths.logged_step_counts(dense, "r")
    (tmp_path / "metrics.jsonl").write_text(json.dumps(records()[1]) + "\n{oops\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl, line 2: not JSON"):
        step_lengths.read_records(str(tmp_path))


def test_packed_updates_follow_the_trained_tokens():
    """Packed updates follow 1225 tokens (+ padding) of 4096; unpacked ones the worst case."""
    run = config_lib.typed(load("qwen7b_v4"))
    lengths = dataclasses.replace(step_lengths.defaults(run), padding=0.125)
    assert step_lengths.update_share(run, lengths) == 1225 / 0.875 / 4096
    unpacked = run.replaced(optim=dataclasses.replace(run.optim, pack_trajectories=False))
    assert step_lengths.update_share(unpacked, lengths) == 1.0
