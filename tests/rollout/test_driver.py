"""The agent loop's scheduling policies over a scripted engine (no model): the same trajectories under barrier and
continuous scheduling, what each policy waits for, searches batched as they become ready, tree forks."""
import asyncio
import concurrent.futures
import re

import jax
import numpy as np

from llds_jax.rollout import driver as driver_lib
from llds_jax.rollout.config import AgentConfig
from llds_jax.rollout.stats import RolloutStats
from llds_jax.rollout.steps import AgentSteps
from llds_jax.rollout.trajectory import END_ANSWER, END_CONTEXT_FULL
from tests.rollout.scripted_engine import ScriptedEngine
from tests.rollout.test_agent import EchoRetriever, example

def policy(text: str, seq: int, turn: int) -> str:
    """Searches its question's word once (after 'think' x (seq % 3 + 1): turns of different lengths), then answers
    (whatever the turn)."""
    del turn
    question = re.findall(r"question (\w+)", text)[-1]
    if f"about {question}" not in text:  # the echo retriever's passage has not come back yet
        return "think " * (seq % 3 + 1) + f"<search> {question} </search>"
    return f"<answer> {question} </answer>"


class CountingRetriever(EchoRetriever):
    def __init__(self, delay_s=0.0):
        super().__init__()
        self.calls, self.delay_s = [], delay_s

    async def search(self, queries, k):
        self.calls.append(list(queries))
        await asyncio.sleep(self.delay_s)
        return await super().search(queries, k)


def run(tokenizer, policy_name, n=6, slots=64, retriever=None, examples=None, first_sequence=0, group_size=1,
        **config):
    """The driver's trajectories of `examples` (default: n questions), its engine and the rollout's stats."""
    config = AgentConfig(**{"max_turns": 2, "max_turn_tokens": 40, "max_prompt_tokens": 200,
                            "max_context_tokens": 400, **config})
    examples = examples or [example(i, f"question w{i}", (f"w{i}",)) for i in range(n)]
    engine = ScriptedEngine(tokenizer, policy, slots=slots)
    stats = RolloutStats(forked_prefix_tokens=0 if config.trees else None)
    agent_steps = AgentSteps(tokenizer, retriever or CountingRetriever(), config, stats)

    async def go():
        with concurrent.futures.ThreadPoolExecutor(1) as thread:
            return await driver_lib.Driver(engine, agent_steps, examples, thread, group_size).run(
                policy_name, jax.random.key(0), first_sequence)

    return asyncio.run(go()), engine, stats


def same(a, b):
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x.tokens, y.tokens)
        np.testing.assert_array_equal(x.loss_mask, y.loss_mask)
        assert (x.end_reason, x.final_answer) == (y.end_reason, y.final_answer)


def test_barrier_and_continuous_give_the_same_trajectories(qwen_tokenizer):
    barrier, _, _ = run(qwen_tokenizer, "barrier")
    continuous, _, _ = run(qwen_tokenizer, "continuous", slots=2)
    same(barrier, continuous)
    assert [t.end_reason for t in barrier] == [END_ANSWER] * 6
    assert [t.final_answer for t in barrier] == [f"w{i}" for i in range(6)]
    assert [len(t.turns) for t in barrier] == [2] * 6  # a search, then the answer


def test_barrier_extends_only_once_every_turn_of_its_session_has_ended(qwen_tokenizer):
    _, engine, _ = run(qwen_tokenizer, "barrier", max_batch_size=3)
    extends = [step for step, call, _ in engine.events if call == "extend"]
    adds = [(step, seq) for step, call, seq in engine.events if call == "add"]
    # Session 1 (sequences 0-2) ends before session 2 (3-5) is added; its extends all come at one step.
    assert len(set(extends[:3])) == 1 and len(set(extends[3:])) == 1
    last_finish_of_first = max(step for step, call, seq in engine.events if call == "finish" and seq < 3)
    assert all(step >= last_finish_of_first for step, seq in adds if seq >= 3)
    assert engine.most_in_flight == 3


def test_continuous_admits_into_freed_slots_and_extends_each_turn_as_its_search_returns(qwen_tokenizer):
    _, engine, _ = run(qwen_tokenizer, "continuous", slots=2)
    assert engine.most_in_flight == 2
    adds = {seq: step for step, call, seq in engine.events if call == "add"}
    finishes = {seq: step for step, call, seq in engine.events if call == "finish"}
    assert adds[2] == min(finishes.values())  # the third conversation takes the first freed slot at once
    extends = sorted(step for step, call, _ in engine.events if call == "extend")
    assert extends[0] < max(adds.values())  # turns are extended while conversations still arrive


def test_searches_that_are_ready_go_out_together_while_a_call_is_in_flight(qwen_tokenizer):
    retriever = CountingRetriever(delay_s=0.05)
    _, _, stats = run(qwen_tokenizer, "continuous", n=9, retriever=retriever)
    assert sorted(q for call in retriever.calls for q in call) == sorted(f"w{i}" for i in range(9))
    assert len(retriever.calls) < 9 and max(len(call) for call in retriever.calls) > 1
    assert stats.searches == 9


def test_a_conversation_at_the_context_cap_gets_a_short_turn_then_ends_context_full(qwen_tokenizer):
    # Its prompt is cut to max_prompt_tokens (200) from the question's start, which keeps "question w0".
    long = example(0, "pad " * 150 + "question w0", ("w0",))
    trajectories, engine, _ = run(qwen_tokenizer, "barrier", examples=[long, example(1, "question w1", ("w1",))],
                                  max_context_tokens=205)
    assert trajectories[0].end_reason == END_CONTEXT_FULL and trajectories[1].end_reason == END_ANSWER
    assert [len(t.token_ids) for t in trajectories[0].turns] == [5]  # the 205 - 200 tokens left
    assert [seq for _, call, seq in engine.events if call == "extend"] == [1]


def test_trees_fork_from_the_chains_turn_starts_and_keep_every_leaf_until_the_last_round(qwen_tokenizer):
    examples = [example(0, "question w0", ("w0",))] * 4 + [example(1, "question w1", ("w1",))] * 4
    trajectories, engine, stats = run(qwen_tokenizer, "tree", examples=examples, trees=2, tree_forks=1,
                                      group_size=4)
    assert len(trajectories) == 8
    forks = [seq for _, call, seq in engine.events if call == "fork"]
    assert sorted(forks) == [1, 3, 5, 7]  # leaf 0 of each tree is its chain, leaf 1 its fork
    assert all(t.final_answer == ("w0" if i < 4 else "w1") for i, t in enumerate(trajectories))
    shared_tokens = 0
    for chain, fork in ((0, 1), (2, 3), (4, 5), (6, 7)):
        # Every chain has two turns (search, answer): its only node after an agent step is turn 1's start.
        first = trajectories[chain].turns[0]
        assert trajectories[fork].turns[0] == first and len(trajectories[fork].turns) == 2
        shared = len(trajectories[chain].prompt_ids) + len(first.token_ids) + len(first.observation_ids)
        np.testing.assert_array_equal(trajectories[fork].tokens[:shared], trajectories[chain].tokens[:shared])
        shared_tokens += len(first.token_ids) + len(first.observation_ids)
    assert stats.forked_prefix_tokens == shared_tokens
    # Lineage: a question's 4 leaves are one group, a chain and its fork one tree; a fork samples from the stream
    # of its own position.
    assert [t.lineage.group for t in trajectories] == [0] * 4 + [1] * 4
    assert [t.lineage.tree for t in trajectories] == [0, 0, 1, 1, 2, 2, 3, 3]
    keys = driver_lib.sequence_keys(jax.random.key(0), range(8))
    assert [t.lineage.key_data for t in trajectories] == [tuple(int(x) for x in k) for k in keys]
    assert {seq for _, call, seq in engine.events if call == "finish"} == set(range(8))
    assert engine.seqs == {}


def test_a_stop_request_abandons_the_rollout(qwen_tokenizer):
    config = AgentConfig(max_turns=2, max_turn_tokens=40, max_prompt_tokens=200, max_context_tokens=400)
    engine = ScriptedEngine(qwen_tokenizer, policy, slots=4)
    agent_steps = AgentSteps(qwen_tokenizer, CountingRetriever(), config, RolloutStats(),
                       stopping=lambda: engine.steps >= 2)

    async def go():
        with concurrent.futures.ThreadPoolExecutor(1) as thread:
            return await driver_lib.Driver(engine, agent_steps, [example(i, f"question w{i}") for i in range(4)],
                                           thread).run("continuous", jax.random.key(0))

    assert asyncio.run(go()) == [] and engine.steps == 2


def test_sequence_keys_are_the_fold_ins_of_the_session_stream():
    rng = jax.random.key(3)
    keys = driver_lib.sequence_keys(rng, [0, 5])
    np.testing.assert_array_equal(keys[1], jax.random.key_data(jax.random.fold_in(rng, 5)))
    session_rng, row = driver_lib.session_stream(rng, 10, 4)
    assert row == 2
    np.testing.assert_array_equal(jax.random.key_data(session_rng), jax.random.key_data(jax.random.fold_in(rng, 2)))


def test_chains_carry_their_group_their_own_tree_and_the_key_of_their_session_stream(qwen_tokenizer):
    """Six samples (groups of 2) from global sequence 8 on (a host's share: a multiple of the sessions' 4), in
    sessions of 4: sequence p is in group p // 2, is its own tree and samples from fold_in(fold_in(rng, p // 4),
    p % 4) (`session_stream`), under either policy."""
    rng = jax.random.key(0)
    ids = range(8, 14)
    expected = [tuple(int(x) for x in driver_lib.sequence_keys(jax.random.fold_in(rng, p // 4), [p % 4])[0])
                for p in ids]
    for policy_name in ("barrier", "continuous"):
        trajectories, _, _ = run(qwen_tokenizer, policy_name, first_sequence=8, group_size=2, max_batch_size=4)
        assert [t.lineage.group for t in trajectories] == [p // 2 for p in ids]
        assert [t.lineage.tree for t in trajectories] == list(ids)
        assert [t.lineage.key_data for t in trajectories] == expected
