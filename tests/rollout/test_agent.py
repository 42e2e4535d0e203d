"""The multi-turn agent loop: scripted turns through the real loop, then a tiny random model end to end on the
rollout engine."""
import asyncio
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from llds_jax.data.qa import QAExample
from llds_jax.model import ModelConfig, Transformer
from llds_jax import protocol
from llds_jax.rollout import agent
from llds_jax.config.sections import RolloutConfig
from llds_jax.rollout.config import AgentConfig, SamplingConfig
from llds_jax.rollout.paged_sampler import PagedSampler, engine_config
from llds_jax.rollout.trajectory import em_rewards, em_score
from llds_jax.search.types import Document, Retriever, SearchResult
from llds_jax.train.batching import padded_batch, round_up
from llds_jax.config.sections import RolloutConfig
from tests.rollout.scripted_engine import ScriptedEngine

PROMPT_TOKENS = RolloutConfig.max_prompt_tokens  # the run's default prompt cut

PARIS_DOCS = ['"Paris"\nParis is the capital of France.', '"France"\nFrance is a country.\nIt is in Europe.',
              '"Lyon"\nLyon is a city.', '"Extra"\nNot returned with k = 3.']
# Written out by hand from the protocol page.
PARIS_OBSERVATION = ('\n\n<information>Doc 1(Title: "Paris") Paris is the capital of France.\n'
                     'Doc 2(Title: "France") France is a country.\nIt is in Europe.\n'
                     'Doc 3(Title: "Lyon") Lyon is a city.</information>\n\n')
INVALID = ("\nMy previous action is invalid. If I want to search, I should put the query between <search> and "
           "</search>. If I want to give the final answer, I should put the answer between <answer> and "
           "</answer>. Let me try again.\n")

SEARCH_TURN = "<think>I need to search.</think>\n<search> capital of france </search>\n\nI will wait for it"
ANSWER_TURN = "<think>Paris.</think>\n<answer> Paris </answer> trailing words here"
INVALID_TURN = "I think I know it already."


def example(i=0, question="what is the capital of france", answers=("Paris",)):
    return QAExample(uid=f"nq-{i}", question=question, golden_answers=tuple(answers), data_source="nq")


def run(tokenizer, engine, retriever, examples, **config):
    """The rollout of `examples` on a scripted `engine` (its own engine source)."""
    cfg = AgentConfig(**{"max_turns": 3, **config})
    return agent.rollout(engine, None, tokenizer, retriever, agent.RolloutRequest(examples, jax.random.key(0), cfg))


def calls(engine, *kinds):
    """The (call, seq) of the scripted engine's calls of `kinds`, in the order the driver made them."""
    return [(call, seq) for _, call, seq in engine.events if call in kinds]


def kept_tokens(tokenizer, text, stop="</search>"):
    """Independent oracle: the script's tokens up to the first one whose prefix decodes to contain `stop`."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if stop is None:
        return ids
    n = next(n for n in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:n]))
    return ids[:n]


def check_segments(traj, segments):
    """Token-by-token check of tokens, loss mask and action ids against (kind, ids) segments."""
    tokens, mask, actions = list(traj.prompt_ids), [0] * len(traj.prompt_ids), [-1] * len(traj.prompt_ids)
    turn = 0
    for kind, ids in segments:
        tokens += ids
        mask += [1 if kind == "model" else 0] * len(ids)
        actions += [turn if kind == "model" else -1] * len(ids)
        turn += kind == "model"
    assert traj.tokens.tolist() == tokens
    assert traj.loss_mask.tolist() == mask
    assert traj.action_ids.tolist() == actions


def check_answer_span(tokenizer, traj, span_text):
    """The answer mask covers the span, and dropping its first or last token loses part of it."""
    ids = traj.tokens[traj.answer_mask == 1].tolist()
    assert np.all(np.diff(np.flatnonzero(traj.answer_mask)) == 1)
    assert span_text in tokenizer.decode(ids)
    assert span_text not in tokenizer.decode(ids[1:]) and span_text not in tokenizer.decode(ids[:-1])
    assert np.all(traj.loss_mask[traj.answer_mask == 1] == 1)


def test_search_then_answer(qwen_tokenizer, doubles):
    tok = qwen_tokenizer
    engine = ScriptedEngine.from_scripts(tok, [[SEARCH_TURN, ANSWER_TURN]])
    retriever = doubles.FakeRetriever({"capital of france": PARIS_DOCS})
    result = run(tok, engine, retriever, [example()])
    (traj,) = result.trajectories
    kept0, kept1 = kept_tokens(tok, SEARCH_TURN), kept_tokens(tok, ANSWER_TURN, "</answer>")
    obs = tok.encode(PARIS_OBSERVATION, add_special_tokens=False)
    assert tok.decode(kept0[-1:]) == ">\n\n"  # the token straddling the cut is kept
    check_segments(traj, [("model", kept0), ("obs", obs), ("model", kept1)])
    assert traj.prompt_ids == tuple(protocol.chat_prompt_ids(tok, "what is the capital of france", PROMPT_TOKENS))
    assert tok.decode(traj.tokens[len(traj.prompt_ids) + len(kept0):][:len(obs)].tolist()) == PARIS_OBSERVATION
    assert traj.turns[0].observation == PARIS_OBSERVATION
    assert retriever.calls == [(["capital of france"], 3)]
    # Sampled tokens past the cut were emitted and rolled back: the engine kept only the cut prefix.
    assert engine.extends[0] == [(len(kept0), obs)]
    assert traj.turns[0].num_sampled > len(kept0)
    # The stop string ended the turn in the step that sampled it (chunks of 4; the engine fed the stop matcher),
    # before the script's last token.
    sampled = len(tok.encode(SEARCH_TURN, add_special_tokens=False))
    assert traj.turns[0].num_sampled == -(-len(kept0) // 4) * 4 < sampled
    assert calls(engine, "add", "extend", "finish") == [("add", 0), ("extend", 0), ("finish", 0)]
    # Sampler log-probs line up with the kept tokens; zero elsewhere.
    expected_logp = np.zeros(len(traj.tokens), np.float32)
    p = len(traj.prompt_ids)
    expected_logp[p:p + len(kept0)] = [-0.001 * (k + 1) for k in range(len(kept0))]
    expected_logp[p + len(kept0) + len(obs):] = [-0.001 * (k + 1) - 0.1 for k in range(len(kept1))]
    np.testing.assert_allclose(traj.sampler_logp, expected_logp, rtol=1e-6)
    check_answer_span(tok, traj, "<answer> Paris </answer>")
    assert (traj.final_answer, em_score(traj), traj.end_reason) == ("Paris", 1.0, "answer")
    assert (traj.num_turns, traj.num_valid_actions, traj.num_valid_searches, traj.num_truncated_observations) == \
        (2, 2, 1, 0)
    assert result.metrics["valid_searches"] == 1.0
    # The budget: the prompt, the one observation appended, the one query, every sampled token (cut ones too).
    budget = {k: result.metrics[k] for k in ("prompt_tokens", "observation_tokens", "searches", "trajectories",
                                             "sampled_tokens", "prompts_cut")}
    assert budget == {"prompt_tokens": len(traj.prompt_ids), "observation_tokens": len(obs), "searches": 1,
                      "trajectories": 1, "sampled_tokens": sum(t.num_sampled for t in traj.turns), "prompts_cut": 0}


def test_invalid_then_search_then_answer(qwen_tokenizer, doubles):
    tok = qwen_tokenizer
    engine = ScriptedEngine.from_scripts(tok, [[INVALID_TURN, SEARCH_TURN, ANSWER_TURN],
                                               [SEARCH_TURN, ANSWER_TURN]])
    retriever = doubles.FakeRetriever({"capital of france": PARIS_DOCS})
    result = run(tok, engine, retriever, [example(0), example(1, "what is the capital city of france")])
    a, b = result.trajectories
    invalid = tok.encode(INVALID, add_special_tokens=False)
    obs = tok.encode(PARIS_OBSERVATION, add_special_tokens=False)
    check_segments(a, [("model", kept_tokens(tok, INVALID_TURN, None)), ("obs", invalid),
                       ("model", kept_tokens(tok, SEARCH_TURN)), ("obs", obs),
                       ("model", kept_tokens(tok, ANSWER_TURN, "</answer>"))])
    assert a.turns[0].observation == INVALID and a.turns[0].action == protocol.Action(None, "")
    assert tok.decode(list(a.turns[0].observation_ids)) == INVALID
    check_segments(b, [("model", kept_tokens(tok, SEARCH_TURN)), ("obs", obs),
                       ("model", kept_tokens(tok, ANSWER_TURN, "</answer>"))])
    assert (a.num_turns, a.num_valid_actions, a.num_valid_searches) == (3, 2, 1)
    assert em_score(a) == em_score(b) == 1.0
    # Turn 1: only b searches; turn 2: only a. One call per turn.
    assert retriever.calls == [(["capital of france"], 3), (["capital of france"], 3)]
    assert len(engine.budgets[0]) == 3 and len(engine.budgets[1]) == 2  # b answered in turn 2 and left
    # The spreads the step estimate's schedule takes: of the prompts, the turns per trajectory, the turns' sampled
    # tokens and the observations' tokens.
    spreads = {k: result.metrics[k] for k in ("prompt_tokens_std", "turns_std", "turn_tokens_std",
                                              "observation_tokens_std")}
    assert len(a.prompt_ids) != len(b.prompt_ids)
    assert spreads == pytest.approx({
        "prompt_tokens_std": abs(len(a.prompt_ids) - len(b.prompt_ids)) / 2, "turns_std": 0.5,
        "turn_tokens_std": np.std([t.num_sampled for t in a.turns + b.turns]),
        "observation_tokens_std": np.std([len(invalid), len(obs), len(obs)])})
    # Per trajectory: a took 3 turns and 1 search, b 2 and 1; a context is the prompt, the kept model tokens and
    # the observations, counted segment by segment.
    search_kept, answer_kept = kept_tokens(tok, SEARCH_TURN), kept_tokens(tok, ANSWER_TURN, "</answer>")
    contexts = [len(a.prompt_ids) + len(kept_tokens(tok, INVALID_TURN, None)) + len(invalid) + len(search_kept)
                + len(obs) + len(answer_kept), len(b.prompt_ids) + len(search_kept) + len(obs) + len(answer_kept)]
    horizon = {k: result.metrics[k] for k in ("turns", "turns_max", "valid_searches", "valid_searches_max",
                                              "context_tokens", "context_tokens_max")}
    assert horizon == {"turns": 2.5, "turns_max": 3.0, "valid_searches": 1.0, "valid_searches_max": 1.0,
                       "context_tokens": sum(contexts) / 2, "context_tokens_max": max(contexts)}


def test_long_horizon(qwen_tokenizer, doubles):
    """rollout.max_turns 40: forty executed searches, then the final turn (the issue 69 horizon); one short
    trajectory beside it for the maxima."""
    tok = qwen_tokenizer
    engine = ScriptedEngine.from_scripts(tok, [[SEARCH_TURN] * 41, [ANSWER_TURN]])
    retriever = doubles.FakeRetriever({"capital of france": PARIS_DOCS[:1]})
    result = run(tok, engine, retriever, [example(0), example(1)], max_turns=40, max_context_tokens=8192,
                 max_response_tokens=8192)
    long, short = result.trajectories
    kept, answer_kept = kept_tokens(tok, SEARCH_TURN), kept_tokens(tok, ANSWER_TURN, "</answer>")
    obs = tok.encode('\n\n<information>Doc 1(Title: "Paris") Paris is the capital of France.</information>\n\n',
                     add_special_tokens=False)
    check_segments(long, [("model", kept), ("obs", obs)] * 40 + [("model", kept)])
    assert (long.end_reason, long.num_turns, long.num_valid_searches, len(retriever.calls)) == ("max_turns", 41, 41, 40)
    assert (short.end_reason, short.num_turns, em_score(short)) == ("answer", 1, 1.0)
    contexts = (len(long.prompt_ids) + 41 * len(kept) + 40 * len(obs), len(short.prompt_ids) + len(answer_kept))
    assert {k: result.metrics[k] for k in ("turns", "turns_max", "valid_searches_max", "searches",
                                           "context_tokens", "context_tokens_max")} == {
        "turns": 21.0, "turns_max": 41.0, "valid_searches_max": 41.0, "searches": 40.0,
        "context_tokens": sum(contexts) / 2, "context_tokens_max": contexts[0]}


def test_running_out_of_turns(qwen_tokenizer, doubles):
    tok = qwen_tokenizer
    engine = ScriptedEngine.from_scripts(tok, [[SEARCH_TURN] * 3])
    retriever = doubles.FakeRetriever({"capital of france": PARIS_DOCS})
    (traj,) = run(tok, engine, retriever, [example()], max_turns=2).trajectories
    kept, obs = kept_tokens(tok, SEARCH_TURN), tok.encode(PARIS_OBSERVATION, add_special_tokens=False)
    # Two executed searches, then a final turn whose search is not executed and which ends the trajectory.
    check_segments(traj, [("model", kept), ("obs", obs), ("model", kept), ("obs", obs), ("model", kept)])
    assert len(retriever.calls) == 2
    assert traj.turns[-1].observation is None
    assert (traj.end_reason, em_score(traj), traj.final_answer) == ("max_turns", 0.0, None)
    assert traj.num_valid_searches == 3 and traj.answer_mask.sum() == 0
    assert [keep for keep, _ in engine.extends[0]] == [len(kept)] * 2 and engine.events[-1][1:] == ("finish", 0)


def test_observation_truncation(qwen_tokenizer, doubles, caplog):
    tok = qwen_tokenizer
    engine = ScriptedEngine.from_scripts(tok, [[SEARCH_TURN, ANSWER_TURN]])
    retriever = doubles.FakeRetriever({"capital of france": PARIS_DOCS})
    result = run(tok, engine, retriever, [example()], max_observation_tokens=12)
    (traj,) = result.trajectories
    full = tok.encode(PARIS_OBSERVATION, add_special_tokens=False)
    assert len(full) > 12
    check_segments(traj, [("model", kept_tokens(tok, SEARCH_TURN)), ("obs", full[:12]),
                          ("model", kept_tokens(tok, ANSWER_TURN, "</answer>"))])
    assert PARIS_OBSERVATION.startswith(tok.decode(full[:12]))
    assert traj.turns[0].observation_truncated and traj.num_truncated_observations == 1
    assert result.metrics["truncated_observations"] == 1.0
    # The warning names the run-config key a user raises.
    assert "1 observation(s) cut to rollout.max_observation_tokens=12 tokens" in caplog.text


def test_retriever_errors_only_affect_their_sequences(qwen_tokenizer, doubles):
    tok = qwen_tokenizer
    turns = [[SEARCH_TURN.replace("capital of france", q), ANSWER_TURN] for q in ("good", "bad", "slow")]
    engine = ScriptedEngine.from_scripts(tok, turns + [[ANSWER_TURN]])
    retriever = doubles.FakeRetriever({"good": PARIS_DOCS},
                                      errors={"bad": "HTTP 500: internal error\ntraceback...",
                                              "slow": "timed out after 5 s"})
    good, bad, slow, answered = run(tok, engine, retriever, [example(i) for i in range(4)]).trajectories
    assert sorted(q for queries, _ in retriever.calls for q in queries) == ["bad", "good", "slow"]
    assert good.turns[0].observation == PARIS_OBSERVATION and good.retriever_errors == []
    assert bad.turns[0].observation == "\n\n<information>Search failed: HTTP 500: internal error</information>\n\n"
    assert slow.turns[0].observation == "\n\n<information>Search failed: timed out after 5 s</information>\n\n"
    assert bad.retriever_errors == ["HTTP 500: internal error\ntraceback..."]
    for traj in (good, bad, slow):
        obs_ids = list(traj.turns[0].observation_ids)
        assert tok.decode(obs_ids) == traj.turns[0].observation
        assert traj.end_reason == "answer" and em_score(traj) == 1.0
    assert answered.num_turns == 1 and em_score(answered) == 1.0


@pytest.mark.parametrize("failure", ["timeout", "exception"])
def test_whole_search_call_failure_gives_error_observations(qwen_tokenizer, doubles, failure):
    tok = qwen_tokenizer
    engine = ScriptedEngine.from_scripts(tok, [[SEARCH_TURN, ANSWER_TURN], [ANSWER_TURN]])
    if failure == "timeout":
        retriever = doubles.FakeRetriever({}, delay_s=2.0)
        expected = "timed out after 0.05 s"
    else:
        retriever = doubles.FakeRetriever({}, raises=ConnectionError("connection refused"))
        expected = "ConnectionError: connection refused"
    searched, answered = run(tok, engine, retriever, [example(0), example(1)], search_timeout_s=0.05).trajectories
    assert searched.turns[0].observation == f"\n\n<information>Search failed: {expected}</information>\n\n"
    assert searched.retriever_errors == [expected] and em_score(searched) == 1.0
    assert answered.retriever_errors == [] and em_score(answered) == 1.0 and answered.num_turns == 1


def test_end_of_turn_token_is_not_trained(qwen_tokenizer, doubles):
    tok = qwen_tokenizer
    eos = tok.eos_token_id
    before = tok.encode("<think>hmm</think> no action", add_special_tokens=False)
    after = tok.encode(" sampled after eos", add_special_tokens=False)
    engine = ScriptedEngine.from_scripts(tok, [[before + [eos] + after, ANSWER_TURN]], stop_ids=[eos])
    (traj,) = run(tok, engine, doubles.FakeRetriever({}), [example()]).trajectories
    invalid = tok.encode(INVALID, add_special_tokens=False)
    check_segments(traj, [("model", before), ("obs", invalid), ("model", kept_tokens(tok, ANSWER_TURN, "</answer>"))])
    assert traj.turns[0].hit_stop and traj.turns[0].num_sampled == len(before) + 1
    assert eos not in traj.tokens[len(traj.prompt_ids):].tolist()


def test_context_caps_end_sequences_cleanly(qwen_tokenizer, doubles):
    tok = qwen_tokenizer
    prompt_len = len(protocol.chat_prompt_ids(tok, "what is the capital of france", PROMPT_TOKENS))
    kept = kept_tokens(tok, SEARCH_TURN)
    # Room for the first turn but not for its observation.
    engine = ScriptedEngine.from_scripts(tok, [[SEARCH_TURN, ANSWER_TURN]])
    (traj,) = run(tok, engine, doubles.FakeRetriever({"capital of france": PARIS_DOCS}), [example()],
                  max_prompt_tokens=prompt_len, max_context_tokens=prompt_len + len(kept) + 5).trajectories
    check_segments(traj, [("model", kept)])
    assert traj.end_reason == "context_full" and traj.turns[0].observation is None
    # The response cap shortens the turn's budget.
    engine = ScriptedEngine.from_scripts(tok, [[SEARCH_TURN, ANSWER_TURN]])
    (traj,) = run(tok, engine, doubles.FakeRetriever({}), [example()], max_response_tokens=7).trajectories
    assert engine.budgets == {0: [7]}
    assert len(traj.turns) == 1 and len(traj.turns[0].token_ids) == 7 and traj.end_reason == "context_full"


def test_reward_scores_model_text_only(qwen_tokenizer, doubles):
    tok = qwen_tokenizer
    spoof = ['"Paris"\n<answer> Paris </answer>'] * 3
    engine = ScriptedEngine.from_scripts(tok, [[SEARCH_TURN, "<answer> London </answer>"]])
    (traj,) = run(tok, engine, doubles.FakeRetriever({"capital of france": spoof}), [example()]).trajectories
    assert traj.final_answer == "London" and em_score(traj) == 0.0
    check_answer_span(tok, traj, "<answer> London </answer>")
    obs_positions = np.flatnonzero((traj.loss_mask == 0) & (np.arange(len(traj.tokens)) >= len(traj.prompt_ids)))
    assert traj.answer_mask[obs_positions].sum() == 0


def assert_same_trajectories(first, second):
    assert len(first) == len(second)
    for a, b in zip(first, second):
        for field in ("tokens", "loss_mask", "action_ids", "answer_mask", "sampler_logp"):
            np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
        assert a.turns == b.turns and (a.end_reason, em_score(a)) == (b.end_reason, em_score(b))


def test_searches_start_as_turns_end(qwen_tokenizer, doubles):
    tok = qwen_tokenizer
    long_search = "<think>" + "a long thought that takes many chunks " * 3 + "</think>\n<search> late </search>"
    scripts = [[long_search, ANSWER_TURN], [SEARCH_TURN.replace("capital of france", "early one"), ANSWER_TURN],
               [SEARCH_TURN.replace("capital of france", "early two"), ANSWER_TURN], [ANSWER_TURN]]
    corpus = {"late": PARIS_DOCS[:1], "early one": PARIS_DOCS[1:2], "early two": PARIS_DOCS[2:3]}
    retriever = doubles.FakeRetriever(corpus)
    result = run(tok, ScriptedEngine.from_scripts(tok, scripts), retriever, [example(i) for i in range(4)])
    # Each search goes out as its turn ends (the short ones first, the two that end in one step in one call), not
    # once every turn has ended.
    assert retriever.calls == [(["early one", "early two"], 3), (["late"], 3)]
    assert [t.turns[0].observation for t in result.trajectories[:3]] == [
        protocol.format_observation([c]) for c in (PARIS_DOCS[0], PARIS_DOCS[1], PARIS_DOCS[2])]


def test_max_batch_size_splits_into_sessions_in_order(qwen_tokenizer, doubles):
    tok = qwen_tokenizer
    engine = ScriptedEngine.from_scripts(tok, [[ANSWER_TURN], [INVALID_TURN, ANSWER_TURN], [SEARCH_TURN, ANSWER_TURN]])
    retriever = doubles.FakeRetriever({"capital of france": PARIS_DOCS})
    trajs = run(tok, engine, retriever, [example(i) for i in range(3)], max_batch_size=2).trajectories
    # The second session starts once the first's sequences have left.
    assert calls(engine, "add", "finish") == [("add", 0), ("add", 1), ("finish", 0), ("finish", 1), ("add", 2),
                                             ("finish", 2)]
    assert [t.uid for t in trajs] == ["nq-0", "nq-1", "nq-2"]
    assert [t.num_turns for t in trajs] == [1, 2, 2]


def test_agent_config_errors_name_the_key():
    with pytest.raises(ValueError, match="rollout.max_turn_tokens"):
        AgentConfig(max_turn_tokens=0)
    with pytest.raises(ValueError, match="rollout.max_prompt_tokens"):
        RolloutConfig(max_prompt_tokens=4096, max_context_tokens=4096)


def test_turn_stop_ids(qwen_tokenizer, qwen_instruct_tokenizer):
    assert agent.turn_stop_ids(qwen_tokenizer) == agent.turn_stop_ids(qwen_instruct_tokenizer) == (151643, 151645)


def test_rollout_batch_and_rewards_of_trajectories(qwen_tokenizer, doubles):
    tok = qwen_tokenizer
    engine = ScriptedEngine.from_scripts(tok, [[SEARCH_TURN, ANSWER_TURN], [ANSWER_TURN]])
    trajs = run(tok, engine, doubles.FakeRetriever({"capital of france": PARIS_DOCS}),
                [example(0), example(1, answers=("Lyon",))]).trajectories
    longest = max(len(t.tokens) for t in trajs)
    packed = padded_batch(trajs, tok.pad_token_id, round_up(longest, 64))
    assert packed.tokens_bt.shape == (2, 256) and 192 < longest < 256
    for row, t in enumerate(trajs):
        n = len(t.tokens)
        np.testing.assert_array_equal(packed.tokens_bt[row, :n], t.tokens)
        assert (packed.tokens_bt[row, n:] == tok.pad_token_id).all()
        np.testing.assert_array_equal(packed.mask_bt[row], np.arange(packed.tokens_bt.shape[1]) < n)
        for name in ("loss_mask", "action_ids", "answer_mask", "sampler_logp"):
            np.testing.assert_array_equal(getattr(packed, f"{name}_bt")[row, :n], getattr(t, name))
        assert (packed.action_ids_bt[row, n:] == -1).all() and (packed.loss_mask_bt[row, n:] == 0).all()
    np.testing.assert_array_equal(packed.group_b, [t.lineage.group for t in trajs])
    np.testing.assert_array_equal(packed.search_count_b, [1.0, 0.0])
    assert packed.rewards_b is None and packed.advantages_b is None
    np.testing.assert_array_equal(em_rewards(trajs), [1.0, 0.0])
    with pytest.raises(ValueError, match="more than length"):
        padded_batch(trajs, tok.pad_token_id, longest - 1)


# -- a tiny random model through the rollout engine ---------------------------------------------------------------

# Token ids of the Qwen2.5 vocabulary.
NEWLINE, OBS_END, INVALID_END = 198, 1339, 624        # "\n" (ends the prompt), ">\n\n", ".\n"
LT, SEARCH, ANSWER, GT, PARIS, CLOSE = 27, 1836, 9217, 29, 40858, 690  # "<" "search" "answer" ">" " paris" " </"
# A bigram program written into the unembedding: after "<" or " </" comes "search" or "answer" (even odds), so
# turns read "<search> paris </search>", "<answer> paris </answer>" or mismatched (invalid) tags, and run on
# past the cut point ("... paris </search> paris </...") so the loop must roll tokens back.
STEERING = {NEWLINE: [LT], OBS_END: [LT], INVALID_END: [LT], LT: [SEARCH, ANSWER], SEARCH: [GT], ANSWER: [GT],
            GT: [PARIS], PARIS: [CLOSE], CLOSE: [SEARCH, ANSWER]}
REAL_TEMPERATURE = 0.9
REAL_CONFIG = dict(max_turns=2, max_turn_tokens=24, max_observation_tokens=40, max_prompt_tokens=256,
                   max_context_tokens=512)
REAL_SLOTS = 16  # sequence slots of the engine: every test's rollout fits at once


def paged(graphdef, model_cfg, sampling, agent_config, max_seqs, max_step_tokens=512, page_size=8):
    """The rollout engine's source over `graphdef`: `max_seqs` slots, token buckets up to `max_step_tokens`."""
    return PagedSampler(graphdef, model_cfg, sampling,
                        engine_config(agent_config, sampling, max_seqs, page_size, max_step_tokens))


def steered_params(model, layer_scale=0.1, logit=30.0, steering=None):
    """Params whose next-token logits follow `steering` (default STEERING; logit ~30 against ~0 for the rest of
    the vocabulary).

    The layers are scaled down, not removed: attention over the KV cache still moves every logit, so a wrong cache
    shows up in the log-prob check.
    """
    graphdef, params = nnx.split(model)
    steered = nnx.merge(graphdef, jax.tree.map(jnp.copy, params))
    cfg = model.cfg
    embed = np.asarray(steered.embed.get_value())
    w_dv = np.zeros((cfg.hidden_size, cfg.vocab_size), np.float32)
    for current, successors in (steering or STEERING).items():
        h_d = embed[current] / np.sqrt(np.mean(embed[current] ** 2))  # the final RMSNorm of this embedding
        for successor in successors:
            w_dv[:, successor] += logit * h_d / cfg.hidden_size
    steered.lm_head.set_value(jnp.asarray(w_dv))
    for name in ("o_proj", "down_proj"):
        var = getattr(steered.layers, name)
        var.set_value(var.get_value() * layer_scale)
    return nnx.split(steered)[1]


@pytest.fixture(scope="module")
def real(qwen_tokenizer):
    model = Transformer(ModelConfig.tiny(vocab_size=151936), rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    # Plain temperature sampling (top_p 1): the steered rollout reaches every path of the protocol.
    sampling = SamplingConfig(temperature=REAL_TEMPERATURE, top_p=1.0, decode_chunk=8,
                              stop_ids=agent.turn_stop_ids(qwen_tokenizer))
    sampler = paged(graphdef, model.cfg, sampling, AgentConfig(**REAL_CONFIG), REAL_SLOTS)
    return graphdef, params, steered_params(model), sampler


class EchoRetriever(Retriever):
    """Answers every query with k copies of a passage about the query; `suffix(j)` tells copy j apart."""

    backend = "echo"

    def __init__(self, suffix=lambda j: ""):
        self.suffix = suffix

    async def search(self, queries, k):
        return [SearchResult([Document(str(j), f'"{q}"\nabout {q}{self.suffix(j)}', 0.0) for j in range(k)])
                for q in queries]

    async def check(self):
        pass

    async def close(self):
        pass


def full_forward_logps(graphdef, params, trajectories, temperatures):
    """For each temperature T, log_softmax(logits / T) at each token from a full forward of each packed row
    (rows one at a time, so only one row's [L, V] logits exist at once)."""
    packed = padded_batch(trajectories, 0, round_up(max(len(t.tokens) for t in trajectories), 128))

    @jax.jit
    def logps(params, tokens_bt, mask_bt):
        model = nnx.merge(graphdef, params)

        def row(args):
            tokens_t, mask_t = args
            logits_tv = model(tokens_t[None], mask_t[None])[0, :-1]
            return jnp.stack([jnp.take_along_axis(jax.nn.log_softmax(logits_tv / t, axis=-1), tokens_t[1:, None],
                                                  axis=1)[:, 0] for t in temperatures])
        return jax.lax.map(row, (tokens_bt, mask_bt))

    out = np.asarray(logps(params, packed.tokens_bt, packed.mask_bt.astype(np.int32)))
    return packed, [out[:, k] for k in range(len(temperatures))]


REAL_EXAMPLES = [example(i, f"question number {i}", ("paris",)) for i in range(6)]


def steered_rollout(tokenizer, real, seed):
    _, _, params, sampler = real
    request = agent.RolloutRequest(REAL_EXAMPLES, jax.random.key(seed), AgentConfig(**REAL_CONFIG))
    return agent.rollout(sampler, params, tokenizer, EchoRetriever(), request).trajectories


@pytest.fixture(scope="module")
def steered_trajectories(qwen_tokenizer, real):
    return steered_rollout(qwen_tokenizer, real, seed=0)


@pytest.mark.slow
def test_real_model_rollout_logps_match_full_forward(qwen_tokenizer, real, steered_trajectories):
    graphdef, _, params, _ = real
    trajs = steered_trajectories
    turns = [t for traj in trajs for t in traj.turns]
    # The rollout exercised every path: executed searches, answers, invalid turns, and cuts with roll back.
    assert any(t.action.kind == "search" and t.observation is not None for t in turns)
    assert any(traj.end_reason == "answer" and em_score(traj) == 1.0 for traj in trajs)
    assert any(t.action.kind is None and t.observation == INVALID for t in turns)
    assert any(t.num_sampled > len(t.token_ids) + t.hit_stop for t in turns)
    assert sum(len(traj.turns) for traj in trajs) > len(trajs)
    for t in turns:
        assert qwen_tokenizer.decode(list(t.token_ids)).startswith(t.text) and protocol.cut_turn(t.text) == t.text
    packed, (ref_bt, other_bt) = full_forward_logps(graphdef, params, trajs, (REAL_TEMPERATURE, 1.0))
    model_bt = packed.loss_mask_bt[:, 1:] == 1
    np.testing.assert_allclose(packed.sampler_logp_bt[:, 1:][model_bt], ref_bt[model_bt], atol=1e-4)
    # The check is sharp: the same tokens scored at another temperature disagree.
    assert np.abs(packed.sampler_logp_bt[:, 1:][model_bt] - other_bt[model_bt]).max() > 1e-2


def test_real_model_rollout_is_deterministic_per_seed(qwen_tokenizer, real, steered_trajectories):
    first, again, other = steered_trajectories, steered_rollout(qwen_tokenizer, real, 0), \
        steered_rollout(qwen_tokenizer, real, 1)
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.sampler_logp, b.sampler_logp)
    assert any(len(a.tokens) != len(c.tokens) or (a.tokens != c.tokens).any() for a, c in zip(first, other))


def test_after_the_first_rollout_and_its_grid_the_next_compiles_nothing(qwen_tokenizer, real, backend_compiles):
    _, random_params, _, sampler = real  # the random model never closes a tag
    cfg = AgentConfig(**REAL_CONFIG)
    batch = lambda offset: [example(i, f"which city is number {offset + i}", ("paris",)) for i in range(5)]
    warm = agent.rollout(sampler, random_params, qwen_tokenizer, EchoRetriever(),
                         agent.RolloutRequest(batch(0), jax.random.key(3), cfg))
    sampler.freeze_shapes()  # the trainer's: every token bucket the first rollout did not run
    with backend_compiles() as compiles:
        second = agent.rollout(sampler, random_params, qwen_tokenizer, EchoRetriever(),
                               agent.RolloutRequest(batch(100), jax.random.key(4), cfg))
    assert compiles == []
    assert [t.tokens.tolist() for t in second.trajectories] != [t.tokens.tolist() for t in warm.trajectories]
    assert second.metrics["turns"] == REAL_CONFIG["max_turns"] + 1


# Every turn searches, with turns of varying length: after ">" comes " paris" or " the" (repeated), so rows end
# their turns in different decode chunks and search different queries ("paris", "the paris", "the the paris", ...).
THE = 279  # " the"
VARYING = {**STEERING, LT: [SEARCH], CLOSE: [SEARCH], GT: [PARIS, THE], THE: [PARIS, THE]}


class RecordingRetriever(EchoRetriever):
    """Echo documents per query after `delay_s`; records each call's queries and (start, end) seconds."""

    def __init__(self, delay_s=0.0):
        super().__init__(suffix=lambda j: f" {j}")
        self.delay_s, self.calls = delay_s, []

    async def search(self, queries, k):
        start = time.perf_counter()
        await asyncio.sleep(self.delay_s)
        self.calls.append((list(queries), (start, time.perf_counter())))
        return await super().search(queries, k)


class DecodeClock:
    """An engine source recording when each of its engines' steps runs (`spans`: (start, end) seconds)."""

    def __init__(self, source):
        self.source, self.spans = source, []
        self.token_budgets = source.token_budgets

    def engine(self, params, stop_matcher=None):
        return ClockedEngine(self, self.source.engine(params, stop_matcher))


class ClockedEngine:
    """An engine of DecodeClock: the inner engine, its steps timed."""

    def __init__(self, clock, inner):
        self.clock, self.inner = clock, inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def step(self):
        start = time.perf_counter()
        out = self.inner.step()
        self.clock.spans.append((start, time.perf_counter()))
        return out


def test_real_model_searches_overlap_decoding_and_every_policy_samples_the_same(qwen_tokenizer):
    model = Transformer(ModelConfig.tiny(vocab_size=151936), rngs=nnx.Rngs(0))
    graphdef, _ = nnx.split(model)
    params = steered_params(model, steering=VARYING)
    sampling = SamplingConfig(temperature=REAL_TEMPERATURE, decode_chunk=2, stop_ids=agent.turn_stop_ids(qwen_tokenizer))
    examples = [example(i, f"question number {i}", ("paris",)) for i in range(8)]
    runs = {}
    for continuous in (False, True):
        cfg = AgentConfig(max_turns=2, max_turn_tokens=24, max_observation_tokens=100, max_prompt_tokens=256,
                          max_context_tokens=512, continuous_batching=continuous)
        clock, retriever = DecodeClock(paged(graphdef, model.cfg, sampling, cfg, 8)), RecordingRetriever(0.05)
        result = agent.rollout(clock, params, qwen_tokenizer, retriever,
                               agent.RolloutRequest(examples, jax.random.key(0), cfg))
        runs[continuous] = result, retriever.calls, clock.spans
    (barrier, barrier_calls, _), (overlapped, calls, spans) = runs[False], runs[True]
    assert_same_trajectories(barrier.trajectories, overlapped.trajectories)
    queries = sorted(q for qs, _ in calls for q in qs)
    assert queries == sorted(q for qs, _ in barrier_calls for q in qs) and len(set(queries)) > 1
    # Searches left in batches: fewer calls than queries, more than one per turn.
    assert 2 < len(calls) < len(queries)
    # Some calls were in flight while the engine decoded (intervals intersect: which of the call's task and the
    # decode thread starts first is up to the scheduler).
    assert any(start < step_end and step_start < end for _, (start, end) in calls for step_start, step_end in spans)
    m = overlapped.metrics
    assert m["search_calls_s"] > m["search_s"] and m["valid_searches"] > 0
    # The rollout's seconds: the host's wait for the device, for searches, and its own work; the device's seconds
    # overlap the host's work (the engine dispatches a call before it absorbs the one in flight).
    parts = overlapped.stats.counts.wait_s + m["search_s"] + m["host_s"]
    assert parts == pytest.approx(m["rollout_s"], rel=1e-6)
    assert overlapped.stats.decode_s == m["decode_s"] > 0
