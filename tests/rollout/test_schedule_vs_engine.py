"""The step estimate's rollout against the engine's own. The estimate's rollout is the run's driver over the run's
engine with scripted answers (issue 68): fed a rollout's own trajectories it makes that rollout's calls and tokens,
bucket for bucket, under both policies (no tolerance).

From the logged lengths alone (issue 54 item 5): a rollout of a tiny steered model through
the paged engine, the agent loop and a retriever logs its step calls per token bucket; the calls predicted from its
logged lengths alone (`step_lengths.from_metrics`: the means and spreads of prompts, turns, sampled and observation
tokens; `rollout_schedule.for_run`: what `--mode=compile --estimate_from=RUN_DIR` prints) agree within 10%, in all
and in each bucket that ran 30% of the calls or more, under both policies, and the schedule feeds the engine the
tokens it logged.

What holds beyond that: the decode-only calls (the 6-token bucket, a quarter of the barrier's calls) are set by each
turn round's tail, the calls after its last input chunk, whose number follows where each round's prompts and
observations end against the 64-token steps; the schedule's spread lengths place them close to but not exactly as
this rollout's (15 predicted against 17 logged, 14 to 18 over the schedule's orders of the same spreads), so they
are not asserted.

Both overlap their calls, as the engine runs on a device (`rollout.engine`: a call is dispatched before the one in
flight is absorbed, so an extended or admitted sequence joins the call after next, and a turn that ends on a stop id
leaves a dropped row in the call after it; `rollout_schedule.run`'s `overlap`).

The demo app's shape (a random model: `python -m llds_jax.launch --config=configs/tiny_test.py` at 8 prompts x 4
samples, 3 turns of 16 tokens, 8 slots): every turn runs to its 16-token budget (no stop id: its last sampled token is
kept and written with the observation), no action is valid (the observation is the invalid-action message, cut to 48
tokens, appended as soon as the turn ends: no search to wait for), and a 4th turn answers after max_turns. The schedule
once waited a call for every observation as for a search's and dropped every turn's last token as a stop id:
8 + 9 + 3 + 20 + 6 = 46 calls predicted in buckets 8, 64, 128, 256 and 512 against that launch's logged 2 + 3 + 3 +
20 + 6 = 34; a steered model of that shape reproduces it, and the counts now agree call for call in every bucket."""
import dataclasses
import time

import jax
import pytest

from llds_jax.aot import rollout_schedule, step_lengths
from llds_jax.config.sections import DataConfig, RolloutConfig, RunConfig, UpdateConfig
from llds_jax.rollout import agent
from llds_jax.rollout import engine as engine_lib
from llds_jax.rollout.config import AgentConfig, PagingConfig
from llds_jax.rollout.paged_sampler import PagedSampler, engine_config
from tests.rollout.test_agent import NEWLINE, THE, EchoRetriever, example, steered_params
from tests.rollout.test_paged_engine import RunnerSource, sampled, tiny  # noqa: F401  (fixtures)

# 8 questions x 3 samples (prompts of 140 to 200 tokens), 3 search turns of up to 16 tokens, observations of up to
# 100; 6 sequence slots, 4 samples per call, steps of up to 64 tokens in pages of 8.
EXAMPLES = [example(i, "question " + "word " * (9 * i), ("paris",)) for i in range(8) for _ in range(3)]


def rollout_config(continuous, prompts, samples, **rollout):
    """The run config of `prompts` x `samples` trajectories (in one update, which the schedule does not read) with
    the `rollout` keys given, sampling at temperature 1 over the whole vocabulary under `continuous` or barrier
    scheduling."""
    batch = prompts * samples
    return RunConfig.of(data=DataConfig(prompts_per_step=prompts, samples_per_prompt=samples),
                        optim=UpdateConfig(mini_batch_size=batch, micro_batch_size=batch),
                        rollout=RolloutConfig(**{"temperature": 1.0, "top_p": 1.0, "continuous_batching": continuous,
                                                 **rollout}))


def engine_rollout(tokenizer, tiny, sampled, run):
    """The agent config, the engine's shapes (6 slots) and the Rollout of EXAMPLES through the paged engine under
    the rollout section of `run` (alone, as rollout_schedule reads it)."""
    model, graphdef = tiny
    params, sampling = sampled
    agent_cfg, paging = AgentConfig.of(run.rollout), PagingConfig.of(run.rollout)
    engine = engine_config(agent_cfg, sampling, 6, paging.page_size, paging.max_step_tokens)
    paged = RunnerSource(PagedSampler(graphdef, model.cfg, sampling, engine), overlap=True)
    return agent_cfg, engine, agent.rollout(paged, params, tokenizer, EchoRetriever(),
                                            agent.RolloutRequest(EXAMPLES, jax.random.key(3), agent_cfg))


def run_config(continuous):
    return rollout_config(continuous, 8, 3, max_turns=3, max_turn_tokens=16, max_observation_tokens=100,
                          max_prompt_tokens=200, max_context_tokens=290, max_response_tokens=290, max_batch_size=6,
                          decode_chunk=4, page_size=8, max_step_tokens=64)


@pytest.mark.slow
@pytest.mark.parametrize("continuous", [False, True], ids=["barrier", "continuous"])
def test_predicted_step_calls_agree_with_the_engines_within_10_percent(qwen_tokenizer, tiny, sampled, continuous):
    run = run_config(continuous)
    _, _, result = engine_rollout(qwen_tokenizer, tiny, sampled, run)
    # The record a run logs (`Trainer.step_metrics`); its seconds do not enter the schedule.
    records = [{**{f"rollout/{k}": v for k, v in result.metrics.items()}, "perf/tokens_per_s": 1.0, "perf/step_s": 1.0}]
    lengths = step_lengths.from_metrics(records, "the rollout")
    assert 1.5 < lengths.turns < 4 and lengths.searches > 0.2  # searches and several turns, not one shape
    logged = step_lengths.logged_step_counts(records, "the rollout")
    schedule = rollout_schedule.for_run(run, lengths, len(EXAMPLES))
    assert schedule.policy == ("continuous" if continuous else "barrier")
    # Every prompt, observation and sampled token the engine logged, the schedule writes too.
    assert sum(schedule.tokens_per_bucket.values()) == sum(tokens for _, tokens in logged.values())
    total = sum(calls for calls, _ in logged.values())
    assert len(schedule.calls) == pytest.approx(total, rel=0.1)
    dominant = [b for b, (calls, _) in logged.items() if calls >= 0.3 * total]
    assert dominant
    for bucket in dominant:
        assert schedule.calls_per_bucket.get(bucket, 0) == pytest.approx(logged[bucket][0], rel=0.1), (
            bucket, schedule.calls_per_bucket, logged)


# The demo launch's shape: 8 questions x 4 samples (prompts of 142 to 145 tokens), every turn " the" x 16 (its
# budget), the invalid-action message cut to 48 tokens (its 48th token ">." is followed by " the" too), 3 turns + the
# answer turn; 8 slots, 8 samples per call, steps of up to 512 tokens in pages of 16, a 512-token context.
CUT_MESSAGE_END = 14276  # ">." (the 48th token of protocol.INVALID_ACTION_MESSAGE)
RUN_ON = {NEWLINE: [THE], THE: [THE], CUT_MESSAGE_END: [THE]}
DEMO_EXAMPLES = [example(i, "question " + "word " * (6 + i % 4), ("paris",)) for i in range(8) for _ in range(4)]


def demo_config(continuous):
    return rollout_config(continuous, 8, 4, max_turns=3, max_turn_tokens=16, max_observation_tokens=48,
                          max_prompt_tokens=256, max_context_tokens=512, max_response_tokens=4096, max_batch_size=8,
                          decode_chunk=8, page_size=16, max_step_tokens=512)


@pytest.mark.slow
@pytest.mark.parametrize("continuous", [False, True], ids=["barrier", "continuous"])
def test_turns_at_their_budget_and_invalid_actions_as_the_demo_launch(qwen_tokenizer, tiny, sampled, continuous):
    model, graphdef = tiny
    sampling = dataclasses.replace(sampled[1], decode_chunk=8)
    params = steered_params(model, steering=RUN_ON)
    run = demo_config(continuous)  # its rollout section alone, as rollout_schedule reads it
    agent_cfg, paging = AgentConfig.of(run.rollout), PagingConfig.of(run.rollout)
    engine = engine_config(agent_cfg, sampling, 8, paging.page_size, paging.max_step_tokens)
    paged = RunnerSource(PagedSampler(graphdef, model.cfg, sampling, engine), overlap=True)
    result = agent.rollout(paged, params, qwen_tokenizer, EchoRetriever(),
                           agent.RolloutRequest(DEMO_EXAMPLES, jax.random.key(3), agent_cfg, group_size=4))
    metrics = result.metrics
    # The launch's shape: 4 turns of 16 tokens, no search, 3 observations of 48 tokens (cut), each trajectory.
    assert (metrics["turns"], metrics["turns_std"], metrics["searches"]) == (4.0, 0.0, 0.0)
    assert (metrics["sampled_tokens"], metrics["observation_tokens"]) == (32 * 64, 32 * 3 * 48)
    assert metrics["truncated_observations"] == 3.0
    records = [{**{f"rollout/{k}": v for k, v in metrics.items()}, "perf/tokens_per_s": 1.0, "perf/step_s": 1.0}]
    lengths = step_lengths.from_metrics(records, "the rollout")
    logged = step_lengths.logged_step_counts(records, "the rollout")
    schedule = rollout_schedule.for_run(run, lengths, len(DEMO_EXAMPLES))
    assert sum(schedule.tokens_per_bucket.values()) == sum(tokens for _, tokens in logged.values())
    assert schedule.search_waits == 0
    assert schedule.calls_per_bucket == {b: calls for b, (calls, _) in logged.items() if calls}, logged


STEP_S = 0.02  # the least seconds of a real engine step in the identity test (a device step's order)


@pytest.mark.slow
@pytest.mark.parametrize("continuous", [False, True], ids=["barrier", "continuous"])
def test_the_schedule_of_a_rollouts_own_lengths_is_its_calls(qwen_tokenizer, tiny, sampled, continuous, monkeypatch):
    """The estimate's rollout is the run's: the real driver over the real engine (`rollout_schedule.run`), fed each
    trajectory's own lengths, makes the engine's calls bucket for bucket and token for token.

    The estimate takes a search to be back by the engine's next step, as on a device, whose steps take milliseconds
    while the event loop answers the echo retriever. The tiny model's steps on the CPU take about as long as that
    answer, so on a loaded machine a search could come back a step later (once: 2 more calls of 48 tokens); each
    real step here takes at least STEP_S, a device's pace."""
    step = engine_lib.Engine.step
    monkeypatch.setattr(engine_lib.Engine, "step", lambda self: time.sleep(STEP_S) or step(self))
    agent_cfg, engine, result = engine_rollout(qwen_tokenizer, tiny, sampled, run_config(continuous))
    records = [{**{f"rollout/{k}": v for k, v in result.metrics.items()}, "perf/tokens_per_s": 1.0, "perf/step_s": 1.0}]
    logged = step_lengths.logged_step_counts(records, "the rollout")
    schedule = rollout_schedule.run(engine, [rollout_schedule.Conversation.of_trajectory(t) for t in result.trajectories], "continuous" if continuous else "barrier",
                                    agent_cfg)
    assert schedule.calls_per_bucket == {b: calls for b, (calls, _) in logged.items() if calls}
    assert schedule.tokens_per_bucket == {b: tokens for b, (calls, tokens) in logged.items() if calls}
