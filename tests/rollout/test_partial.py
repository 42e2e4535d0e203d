"""Partial rollouts (rollout.partial, llds_jax/rollout/partial.py) on the tiny steered model: over-sampling 1 is the
synchronous rollout bit for bit; a carried conversation survives a checkpoint record and resumes where it stopped
(its tokens, log-probs and versions kept, its PRNG stream going on); stale groups are dropped and counted."""
import dataclasses
import json
import types

import jax
import numpy as np
import pytest

from llds_jax import config as config_lib
from llds_jax.bounds import ConfigError
from llds_jax.protocol import Action
from llds_jax.rollout import agent
from llds_jax.rollout.config import AgentConfig, PartialConfig
from llds_jax.rollout.partial import Carry, CarriedConversation, CarriedGroup, plan_step, staleness_metrics
from llds_jax.rollout.trajectory import Turn
from tests.rollout.test_agent import REAL_CONFIG, EchoRetriever, example, real  # noqa: F401  (the fixture)

N = 2  # samples per prompt
PROMPTS = 2  # groups a step trains on
QUESTIONS = [example(i, f"question number {i}", ("paris",)) for i in range(12)]


def draws():
    """The prompt iterator's batches: PROMPTS questions each, in order."""
    batches = iter(QUESTIONS[i:i + PROMPTS] for i in range(0, len(QUESTIONS), PROMPTS))
    return lambda: next(batches)


def run(tokenizer, real, examples, seed, plan=None, version=1, **config):
    _, _, params, sampler = real
    partial = agent.PartialRequest(plan, max_staleness=1) if plan is not None else None
    request = agent.RolloutRequest(examples, jax.random.key(seed), AgentConfig(**{**REAL_CONFIG, **config}),
                                   group_size=N, version=version, partial=partial)
    return agent.rollout(sampler, params, tokenizer, EchoRetriever(), request)


def assert_same(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        for name in ("tokens", "loss_mask", "action_ids", "answer_mask", "sampler_logp"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
        assert (a.lineage, a.end_reason, a.turns, a.uid) == (b.lineage, b.end_reason, b.turns, b.uid)


def test_a_partial_request_runs_its_plans_examples_group_size_and_version():
    plan = plan_step(Carry(), draws(), PartialConfig(True, 1.0, 0), PROMPTS, N, version=1)
    partial, key, config = agent.PartialRequest(plan), jax.random.key(0), AgentConfig(**REAL_CONFIG)
    agent.RolloutRequest(plan.examples, key, config, group_size=N, version=1, partial=partial)  # consistent
    for examples, group_size, version in ((plan.examples[1:], N, 1), (plan.examples, N + 1, 1),
                                          (plan.examples, N, 2)):
        with pytest.raises(ValueError, match=f"its plan's examples, group size \\({N}\\) and version \\(1\\)"):
            agent.RolloutRequest(examples, key, config, group_size=group_size, version=version, partial=partial)
    with pytest.raises(ValueError, match="^rollout: no examples$"):
        agent.RolloutRequest([], key, config)


@pytest.mark.parametrize("continuous", [False, True], ids=["barrier", "continuous"])
def test_over_sampling_1_is_the_synchronous_rollout_bit_for_bit(qwen_tokenizer, real, continuous):
    plan = plan_step(Carry(), draws(), PartialConfig(True, 1.0, 0), PROMPTS, N, version=1)
    assert [ex.uid for ex in plan.examples] == [ex.uid for ex in QUESTIONS[:PROMPTS] for _ in range(N)]
    partial = run(qwen_tokenizer, real, plan.examples, 0, plan, continuous_batching=continuous)
    sync = run(qwen_tokenizer, real, plan.examples, 0, continuous_batching=continuous)
    assert_same(partial.trajectories, sync.trajectories)
    assert partial.carry == Carry()
    assert {k: v for k, v in partial.metrics.items() if k.startswith("partial/")} == {
        "partial/dropped": 0.0, "partial/dropped_group_size": 0.0, "partial/resumed": 0.0,
        "partial/reprefill_tokens": 0.0, "partial/groups_started": 2.0, "partial/carried": 0.0,
        "partial/carried_groups": 0.0,
        "partial/staleness_mean": 0.0, "partial/staleness_max": 0.0, "partial/stale_token_share": 0.0,
        "partial/staleness_0": 1.0, "partial/staleness_1": 0.0}
    timing = {"rollout_s", "decode_s", "search_s", "search_calls_s", "host_s", "sampled_tokens_per_s"}
    assert ({k: v for k, v in partial.metrics.items() if k not in timing and not k.startswith("partial/")}
            == {k: v for k, v in sync.metrics.items() if k not in timing})


def conversations(rollout):
    """key data -> (turns, ended) of every conversation that started: trained, or carried."""
    out = {t.lineage.key_data: (t.turns, True) for t in rollout.trajectories}
    out.update({m.key_data: (m.turns, m.end_reason is not None) for g in rollout.carry.groups for m in g.members
                if m.started})
    return out


@pytest.mark.parametrize("continuous", [False, True], ids=["barrier", "continuous"])
def test_a_carried_conversation_survives_a_checkpoint_and_resumes_where_it_stopped(qwen_tokenizer, real,
                                                                                   continuous):
    """One prompt a step, 4 groups started (seed 2: group 1 answers in its first turn, the others take 3 turns):
    the cut comes after group 1's first turn; the step trains group 1 and carries the others mid-way. The next step
    (same params) resumes them first: each conversation ends as it does in one uninterrupted rollout."""
    cfg = PartialConfig(True, 4.0, 1)
    prompts, seed = 1, 2
    plan = plan_step(Carry(), draws(), cfg, prompts, N, version=1)
    assert len(plan.groups) == 4 and not plan.pending
    first = run(qwen_tokenizer, real, plan.examples, seed, plan, version=1, continuous_batching=continuous)
    # Every conversation of the step's 4 groups to its end, in one rollout: what the carried ones must become.
    reference = {t.lineage.key_data: t for t in run(qwen_tokenizer, real, plan.examples, seed).trajectories}

    assert len(first.trajectories) == prompts * N and first.metrics["partial/carried_groups"] == 3
    assert [t.lineage.group for t in first.trajectories] == [0, 0]  # the trained group, renumbered
    for trajectory in first.trajectories:
        assert_same([trajectory], [dataclasses.replace(reference[trajectory.lineage.key_data],
                                                       lineage=trajectory.lineage)])
    carried = {key: turns for key, (turns, ended) in conversations(first).items() if not ended}
    # The cut left 6 conversations mid-way (under continuous, some in their first turn: carried with none).
    assert len(carried) == 6 and any(carried.values())
    for key, turns in carried.items():  # the turns carried are the uninterrupted run's first ones, bit for bit
        assert turns == reference[key].turns[:len(turns)] and len(turns) < len(reference[key].turns)
        assert all(turn.version == 1 for turn in turns)

    record = json.loads(json.dumps(first.carry.to_json()))  # through the checkpoint's meta
    carry = Carry.from_json(record)
    assert carry == first.carry

    second_plan = plan_step(carry, draws(), cfg, prompts, N, version=2)
    assert second_plan.groups[:3] == carry.groups  # carried groups first, then a fresh one
    assert second_plan.metrics["partial/resumed"] == 6
    assert second_plan.metrics["partial/reprefill_tokens"] == sum(
        len(m.context_ids) for g in carry.groups for m in g.members if m.started)
    second = run(qwen_tokenizer, real, second_plan.examples, seed + 1, second_plan, version=2,
                 continuous_batching=continuous)
    after = conversations(second)
    assert any(len(after[key][0]) > len(turns) for key, turns in carried.items())  # resumed for real
    for key, turns in carried.items():
        got, want, k = after[key][0], reference[key].turns, len(turns)
        assert got[:k] == turns  # tokens, log-probs and version 1 kept
        assert [t.version for t in got] == [1] * k + [2] * (len(got) - k)
        # Resumed with the same params, its KV recomputed: the same tokens, log-probs up to float rounding.
        assert [t.token_ids for t in got] == [t.token_ids for t in want[:len(got)]]
        np.testing.assert_allclose(np.concatenate([t.logps for t in got]),
                                   np.concatenate([t.logps for t in want[:len(got)]]), atol=1e-5)
        if after[key][1]:
            assert len(got) == len(want)
    old_tokens = sum(len(t.token_ids) for traj in second.trajectories for t in traj.turns if t.version == 1)
    all_tokens = sum(len(t.token_ids) for traj in second.trajectories for t in traj.turns)
    assert old_tokens and second.metrics["partial/stale_token_share"] == pytest.approx(old_tokens / all_tokens)
    assert second.metrics["partial/staleness_1"] == second.metrics["partial/staleness_mean"] == \
        second.metrics["partial/stale_token_share"] and second.metrics["partial/staleness_max"] == 1.0


def test_the_staleness_histogram_counts_trained_tokens_by_the_version_that_sampled_them():
    def turn(version, tokens):
        return types.SimpleNamespace(version=version, token_ids=(0,) * tokens)

    trajectories = [types.SimpleNamespace(turns=[turn(3, 2), turn(2, 3)]), types.SimpleNamespace(turns=[turn(3, 5)])]
    assert staleness_metrics(trajectories, 3, 2) == {
        "partial/staleness_mean": pytest.approx(0.3), "partial/staleness_max": 1.0,
        "partial/stale_token_share": pytest.approx(0.3), "partial/staleness_0": pytest.approx(0.7),
        "partial/staleness_1": pytest.approx(0.3), "partial/staleness_2": 0.0}


def member(version, end_reason=None):
    turn = Turn(token_ids=(5, 6), logps=(-0.25, -1.5), text="x", action=Action(None), num_sampled=3,
                observation_ids=(7,), version=version)
    return CarriedConversation(example(version), (1, version), (1, 2, 3), (turn, turn), end_reason)


def test_a_group_past_the_staleness_bound_is_dropped_and_counted(caplog):
    stale = CarriedGroup((member(1), member(3, "answer")))  # oldest turn: version 1
    fresh_enough = CarriedGroup((member(2), CarriedConversation(example(9))))  # one sample never started
    not_started = CarriedGroup((CarriedConversation(example(8)),) * 2)
    plan = plan_step(Carry((stale, fresh_enough, not_started)), draws(), PartialConfig(True, 2.0, 1), PROMPTS, N,
                     version=3)
    assert plan.groups == (fresh_enough, not_started) + tuple(
        CarriedGroup((CarriedConversation(q),) * N) for q in QUESTIONS[:2])
    assert plan.pending == ()
    assert plan.metrics == {"partial/dropped": 2.0, "partial/dropped_group_size": 0.0, "partial/resumed": 1.0,
                            "partial/reprefill_tokens": 9.0, "partial/groups_started": 4.0}
    assert "dropped 2 carried conversation(s) older than rollout.max_staleness = 1" in caplog.text
    assert plan.carried == {0: fresh_enough.members[0]}
    assert plan.carried[0].sampled == 6 and plan.carried[0].context_ids == [1, 2, 3, 5, 6, 7, 5, 6, 7]
    # At staleness 0 every carried group with a sampled turn goes; over-sampling draws whole batches.
    plan = plan_step(Carry((stale, fresh_enough, not_started)), draws(), PartialConfig(True, 1.5, 0), 3, N, 4)
    assert plan.metrics["partial/dropped"] == 3.0 and len(plan.groups) == 5 and len(plan.pending) == 0


@pytest.mark.parametrize("group_size", [1, 3])
def test_carried_groups_of_another_group_size_are_dropped_and_counted_or_regrouped(caplog, group_size):
    """A run resumed with another data.samples_per_prompt (issue 66: 28 of 64 carried conversations vanished,
    counted nowhere): a started group of the old size (2) is dropped, its started conversations counted and warned
    of in one line; a group not started is its prompt only and is carried on at the new size."""
    finished = CarriedGroup((member(2, "answer"), member(2)))
    half_started = CarriedGroup((member(2), CarriedConversation(example(9))))
    not_started = CarriedGroup((CarriedConversation(example(8)),) * 2)
    plan = plan_step(Carry((finished, half_started, not_started)), draws(), PartialConfig(True, 2.0, 1), PROMPTS,
                     group_size, version=3)
    fresh = tuple(CarriedGroup((CarriedConversation(q),) * group_size) for q in QUESTIONS[:4])  # 2 draws
    assert plan.groups + plan.pending == (CarriedGroup((CarriedConversation(example(8)),) * group_size),) + fresh
    assert all(len(group.members) == group_size for group in plan.groups)
    assert (plan.metrics["partial/dropped_group_size"], plan.metrics["partial/dropped"],
            plan.metrics["partial/resumed"], plan.carried) == (3.0, 0.0, 0.0, {})
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == [f"step 3: dropped 3 carried conversation(s) of 2 group(s) sampled as groups of another "
                        f"size than data.samples_per_prompt = {group_size}"]


def test_the_carry_record_round_trips_exactly():
    carry = Carry((CarriedGroup((member(1), CarriedConversation(example(4)))),
                   CarriedGroup((member(2, "max_turns"), member(2)))))
    record = json.loads(json.dumps(carry.to_json()))
    assert Carry.from_json(record) == carry


def test_partial_config_errors_name_the_run_keys():
    cfg = config_lib.default_config()
    cfg.rollout.partial = True
    with pytest.raises(ConfigError, match=r"rollout.partial .* objective.tis_cap > 0"):
        config_lib.typed(cfg)
    cfg.objective.tis_cap = 2.0
    config_lib.typed(cfg)
    cfg.rollout.over_sampling = 0.5
    with pytest.raises(ConfigError, match=r"rollout.over_sampling must be >= 1, got 0.5"):
        config_lib.typed(cfg)
    cfg.rollout.over_sampling, cfg.rollout.max_staleness = 2.0, -1
    with pytest.raises(ConfigError, match=r"rollout.max_staleness must be >= 0, got -1"):
        config_lib.typed(cfg)
    cfg.rollout.max_staleness, cfg.rollout.trees = 1, 1
    with pytest.raises(ConfigError, match=r"rollout.partial carries chains, not trees: set rollout.trees 0"):
        config_lib.typed(cfg)


def test_the_engine_has_a_slot_for_every_conversation_a_partial_step_starts():
    cfg = config_lib.default_config()
    cfg.data.prompts_per_step, cfg.data.samples_per_prompt = 6, 5
    cfg.optim.mini_batch_size = cfg.optim.micro_batch_size = 30
    assert config_lib.typed(cfg).rollout_sequences(2) == 15
    cfg.rollout.partial, cfg.rollout.over_sampling, cfg.objective.tis_cap = True, 1.5, 2.0
    assert config_lib.typed(cfg).rollout_sequences(2) == 5 * 5  # ceil(1.5 x 3) groups of 5 on each of 2 hosts
