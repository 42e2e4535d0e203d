"""Long-horizon limits of the agent loop on a scripted engine: rollout.max_trajectory_tokens, and the context policy
drop_observations (its edits, the re-admitted contexts and the segments a trajectory is trained as)."""
import numpy as np
import pytest

from llds_jax import config as config_lib
from llds_jax.bounds import ConfigError
from llds_jax.config.sections import RolloutConfig
from llds_jax.rollout import context
from llds_jax.rollout.trajectory import END_ANSWER, END_TRAJECTORY_BUDGET
from tests.rollout.scripted_engine import ScriptedEngine
from tests.rollout.test_agent import ANSWER_TURN, INVALID, PARIS_DOCS, SEARCH_TURN, calls, example, kept_tokens, run

OBSERVATION = '\n\n<information>Doc 1(Title: "Paris") Paris is the capital of France.</information>\n\n'
DROPPED = "\n\n<information>[observation dropped]</information>\n\n"  # written out by hand
LONG = dict(max_context_tokens=8192, max_response_tokens=8192)


def encode(tok, text):
    return tok.encode(text, add_special_tokens=False)


def recording(engine):
    """Records every add_request's (context ids, sampled) in `engine.admitted[seq]`."""
    engine.admitted = {}
    add = engine.add_request

    def add_request(seq, prompt_ids, key_data, budget, sampled=0):
        engine.admitted.setdefault(seq, []).append((list(prompt_ids), sampled))
        add(seq, prompt_ids, key_data, budget, sampled)

    engine.add_request = add_request
    return engine


def test_dropped_text_replaces_only_the_information_body():
    assert context.dropped_text(OBSERVATION) == DROPPED
    assert context.dropped_text("\n\n<information>Search failed: boom</information>\n\n") == DROPPED
    assert context.dropped_text("\n\n<information>cut short by the token limit") == \
        "\n\n<information>[observation dropped]</information>"
    assert context.dropped_text(INVALID) == INVALID


def test_the_trajectory_budget_ends_a_conversation_once_its_tokens_reach_it(qwen_tokenizer, doubles):
    tok = qwen_tokenizer
    kept, obs = kept_tokens(tok, SEARCH_TURN), encode(tok, OBSERVATION)
    budget = 2 * (len(kept) + len(obs)) + len(kept) + 5  # turn 2 fits, its observation does not
    engine = ScriptedEngine.from_scripts(tok, [[SEARCH_TURN] * 41, [ANSWER_TURN]])
    retriever = doubles.FakeRetriever({"capital of france": PARIS_DOCS[:1]})
    result = run(tok, engine, retriever, [example(0), example(1)], max_turns=40, max_trajectory_tokens=budget,
                 **LONG)
    long, short = result.trajectories
    assert (long.end_reason, long.num_turns, short.end_reason) == (END_TRAJECTORY_BUDGET, 3, END_ANSWER)
    assert long.response_length == 3 * len(kept) + 2 * len(obs)
    assert engine.budgets[0] == [budget - n * (len(kept) + len(obs)) for n in range(3)]  # below max_turn_tokens
    assert (result.metrics["end/trajectory_budget"], result.metrics["end/answer"]) == (0.5, 0.5)


def test_the_trajectory_budget_cuts_the_turn_that_reaches_it(qwen_tokenizer, doubles):
    tok = qwen_tokenizer
    kept, obs = kept_tokens(tok, SEARCH_TURN), encode(tok, OBSERVATION)
    engine = ScriptedEngine.from_scripts(tok, [[SEARCH_TURN] * 41])
    retriever = doubles.FakeRetriever({"capital of france": PARIS_DOCS[:1]})
    result = run(tok, engine, retriever, [example(0)], max_turns=40, max_trajectory_tokens=len(kept) + len(obs) + 3,
                 **LONG)
    (traj,) = result.trajectories
    assert traj.end_reason == END_TRAJECTORY_BUDGET and [len(t.token_ids) for t in traj.turns] == [len(kept), 3]
    assert traj.response_length == len(kept) + len(obs) + 3


def drop_rollout(tok, doubles, policy="barrier", **config):
    """One conversation of four executed searches and a final turn under drop_observations with K = 2: edits after
    the third and the fourth observation."""
    engine = recording(ScriptedEngine.from_scripts(tok, [[SEARCH_TURN] * 5]))
    retriever = doubles.FakeRetriever({"capital of france": PARIS_DOCS[:1]})
    result = run(tok, engine, retriever, [example(0)], max_turns=4, context_policy="drop_observations",
                 keep_observations=2, continuous_batching=policy == "continuous", **{**LONG, **config})
    return result, engine


def test_drop_observations_readmits_the_edited_context_and_trains_each_segment(qwen_tokenizer, doubles):
    tok = qwen_tokenizer
    result, engine = drop_rollout(tok, doubles)
    (traj,) = result.trajectories
    kept, obs, dropped = kept_tokens(tok, SEARCH_TURN), encode(tok, OBSERVATION), encode(tok, DROPPED)
    prompt = list(traj.prompt_ids)
    assert calls(engine, "add", "extend", "finish") == [("add", 0), ("extend", 0), ("extend", 0), ("finish", 0),
                                                        ("add", 0), ("finish", 0), ("add", 0), ("finish", 0)]
    context_3 = prompt + kept + dropped + kept + obs + kept + obs
    context_4 = prompt + kept + dropped + kept + dropped + kept + obs + kept + obs
    sampled = np.cumsum([t.num_sampled for t in traj.turns]).tolist()
    assert engine.admitted[0] == [(prompt, 0), (context_3, sampled[2]), (context_4, sampled[3])]
    assert traj.tokens.tolist() == prompt + (kept + obs) * 4 + kept  # the trajectory itself is unedited
    assert [s.tokens.tolist() for s in traj.segments] == [prompt + (kept + obs) * 3, context_3 + kept + obs,
                                                          context_4 + kept]
    assert [s.loss_mask.tolist() for s in traj.segments] == [
        [0] * len(prompt) + ([1] * len(kept) + [0] * len(obs)) * 3,
        [0] * len(context_3) + [1] * len(kept) + [0] * len(obs), [0] * len(context_4) + [1] * len(kept)]
    assert [sorted(set(s.action_ids[s.loss_mask == 1].tolist())) for s in traj.segments] == [[0, 1, 2], [3], [4]]
    trained = np.concatenate([s.sampler_logp[s.loss_mask == 1] for s in traj.segments])
    np.testing.assert_array_equal(trained, traj.sampler_logp[traj.loss_mask == 1])  # each sampled token once
    assert (result.metrics["context_edits"], result.metrics["context_reencoded_tokens"]) == (
        2.0, float(len(context_3) + len(context_4)))


def test_drop_observations_gives_the_same_trajectories_under_continuous_batching(qwen_tokenizer, doubles):
    barrier, _ = drop_rollout(qwen_tokenizer, doubles)
    continuous, _ = drop_rollout(qwen_tokenizer, doubles, "continuous")
    for a, b in zip(barrier.trajectories[0].segments, continuous.trajectories[0].segments, strict=True):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.sampler_logp, b.sampler_logp)


def test_the_context_caps_count_the_edited_context(qwen_tokenizer, doubles):
    tok = qwen_tokenizer
    kept, obs, dropped = kept_tokens(tok, SEARCH_TURN), encode(tok, OBSERVATION), encode(tok, DROPPED)
    # The fourth observation fits the unedited context with 5 tokens to spare; the edit after it frees len(obs) -
    # len(dropped) more for the final turn.
    cap = 4 * len(kept) + len(dropped) + 3 * len(obs) + 5
    result, engine = drop_rollout(tok, doubles, max_response_tokens=cap)
    (traj,) = result.trajectories
    assert traj.num_turns == 5 and engine.budgets[0][-1] == len(obs) - len(dropped) + 5


@pytest.mark.parametrize("policy", ["none", "drop_observations"])
def test_one_segment_is_the_trajectory_itself(qwen_tokenizer, doubles, policy):
    tok = qwen_tokenizer
    engine = ScriptedEngine.from_scripts(tok, [[SEARCH_TURN] * 3])
    result = run(tok, engine, doubles.FakeRetriever({"capital of france": PARIS_DOCS[:1]}), [example(0)],
                 max_turns=2, context_policy=policy, keep_observations=2)
    (traj,) = result.trajectories
    (segment,) = traj.segments
    assert segment.tokens is traj.tokens and segment.sampler_logp is traj.sampler_logp
    assert calls(engine, "add", "finish") == [("add", 0), ("finish", 0)] and result.metrics["context_edits"] == 0


def test_a_context_policy_is_refused_where_its_edits_could_not_be_carried_or_trained():
    with pytest.raises(ConfigError, match=r"rollout.context_policy 'drop_observations' edits a conversation's "
                                          r"context, which rollout.partial and rollout.trees do not carry"):
        RolloutConfig(context_policy="drop_observations", partial=True)
    with pytest.raises(ConfigError, match=r"rollout.context_policy must be one of"):
        RolloutConfig(context_policy="summarize")
    cfg = config_lib.default_config()
    cfg.data.prompts_per_step, cfg.optim.mini_batch_size, cfg.optim.micro_batch_size = 8, 8, 4
    cfg.rollout.context_policy, cfg.optim.pack_trajectories = "drop_observations", False
    with pytest.raises(ConfigError, match=r"trains each segment as a sequence of its own in packed rows: set "
                                          r"optim.pack_trajectories true"):
        config_lib.typed(cfg)
    cfg.optim.pack_trajectories = True
    assert config_lib.typed(cfg).rollout.context_policy == "drop_observations"
