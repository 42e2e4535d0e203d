"""Continuous batching (`AgentConfig.continuous_batching`): the trajectories of the session path from the same
streams, higher decode occupancy, masked row extends and bounded compilation."""
import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from llds_jax import parallel
from llds_jax.model import ModelConfig, Transformer
from llds_jax.rollout import agent
from llds_jax.rollout.config import AgentConfig, SamplingConfig
from llds_jax.rollout.sampler import Sampler
from llds_jax.rollout.shape_plan import ExtendRowsShape
from llds_jax.rollout.trajectory import em_score
from tests.rollout.test_agent import (ANSWER, CLOSE, GT, INVALID_END, LT, NEWLINE, OBS_END, PARIS, SEARCH, STEERING,
                                      THE, EchoRetriever, example, steered_params)

SP_LT, GT_NL, CAP_PARIS, SLASH_LT = 366, 397, 59604, 522  # " <" ">\n" "Paris" "</"
# Greedy turns without near-ties: a search ("<search> paris </search> paris </..."), then " the the ..." to the
# budget after an observation (invalid), then "<answer>\nParis</answer>" after the invalid-action message.
GREEDY_STEERING = {NEWLINE: [LT], LT: [SEARCH], SEARCH: [GT], GT: [PARIS], PARIS: [CLOSE], CLOSE: [SEARCH],
                   OBS_END: [THE], THE: [THE], INVALID_END: [SP_LT], SP_LT: [ANSWER], ANSWER: [GT_NL],
                   GT_NL: [CAP_PARIS], CAP_PARIS: [SLASH_LT], SLASH_LT: [ANSWER]}
# Prompts of 136 to 199 tokens against a 290-token context: the longer ones end (context_full) after fewer turns.
EXAMPLES = [example(i, "question " + "word " * (9 * i), ("paris",)) for i in range(8)]
CONFIG = dict(max_turns=3, max_turn_tokens=16, max_observation_tokens=100, max_prompt_tokens=200,
              max_context_tokens=290, max_batch_size=3)


@pytest.fixture(scope="module")
def tiny():
    model = Transformer(ModelConfig.tiny(vocab_size=151936), rngs=nnx.Rngs(0))
    graphdef, _ = nnx.split(model)
    return model, graphdef


@pytest.fixture(scope="module")
def greedy(qwen_tokenizer, tiny):
    model, graphdef = tiny
    config = SamplingConfig(greedy=True, decode_chunk=4, stop_ids=agent.turn_stop_ids(qwen_tokenizer))
    return graphdef, steered_params(model, steering=GREEDY_STEERING), config, Sampler(graphdef, config)


@pytest.fixture(scope="module")
def sampled(qwen_tokenizer, tiny):
    model, graphdef = tiny
    # Plain temperature sampling: nucleus sampling (top_p) sums over the 151,936-entry vocabulary 30 times a step.
    config = SamplingConfig(temperature=1.0, top_p=1.0, decode_chunk=4, stop_ids=agent.turn_stop_ids(qwen_tokenizer))
    return steered_params(model, steering=STEERING), Sampler(graphdef, config)


def rollout(tokenizer, sampler, params, continuous, seed=0, examples=EXAMPLES):
    config = AgentConfig(**CONFIG, continuous_batching=continuous)
    return agent.rollout(sampler, params, tokenizer, EchoRetriever(), examples, jax.random.key(seed), config)


def assert_same_trajectories(sessions, continuous, atol=1e-5):
    """Token for token the same trajectories; sampler log-probs equal but for float rounding."""
    assert len(sessions) == len(continuous)
    for a, b in zip(sessions, continuous):
        for field in ("tokens", "loss_mask", "action_ids", "answer_mask"):
            np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
        np.testing.assert_allclose(a.sampler_logp, b.sampler_logp, atol=atol)
        no_logps = lambda turns: [dataclasses.replace(t, logps=()) for t in turns]  # noqa: E731
        assert no_logps(a.turns) == no_logps(b.turns)
        assert (a.end_reason, em_score(a), a.final_answer) == (b.end_reason, em_score(b), b.final_answer)


@pytest.mark.slow
def test_greedy_continuous_batching_matches_sessions_with_higher_occupancy(qwen_tokenizer, greedy):
    _, params, _, sampler = greedy
    sessions = rollout(qwen_tokenizer, sampler, params, continuous=False)
    continuous = rollout(qwen_tokenizer, sampler, params, continuous=True)
    trajs = sessions.trajectories
    # Trajectories of different numbers of turns and lengths, searches, invalid turns, answers and full contexts.
    assert len({t.num_turns for t in trajs}) > 1 and len({len(t.tokens) for t in trajs}) == len(trajs)
    assert {t.end_reason for t in trajs} == {"answer", "context_full"}
    assert any(t.num_valid_searches for t in trajs) and any(turn.action.kind is None for t in trajs for turn in t.turns)
    assert_same_trajectories(trajs, continuous.trajectories)
    np.testing.assert_array_equal([em_score(t) for t in trajs], [em_score(t) for t in continuous.trajectories])
    # Sequences took rows freed by others: more sequences than rows, extends of prompts into a running batch.
    assert any(isinstance(s, ExtendRowsShape) and s.rows == 4 for s in sampler.plan._run[ExtendRowsShape])
    before, after = sessions.metrics["decode_occupancy"], continuous.metrics["decode_occupancy"]
    assert 0 < before < after <= 1
    assert continuous.metrics["sampled_tokens"] == sessions.metrics["sampled_tokens"]


@pytest.mark.slow
def test_extends_of_at_most_max_extend_rows_rows_sample_the_same(qwen_tokenizer, greedy):
    """rollout.max_extend_rows = 1: every prompt and observation is appended by a call of its own (the 4-row batch
    starts with 3 prompts: 3 calls), the same greedy trajectories as the sessions."""
    graphdef, params, config, _ = greedy
    capped = Sampler(graphdef, dataclasses.replace(config, max_extend_rows=1))
    continuous = rollout(qwen_tokenizer, capped, params, continuous=True)
    assert_same_trajectories(rollout(qwen_tokenizer, Sampler(graphdef, config), params, continuous=False).trajectories,
                             continuous.trajectories)
    assert {s.rows_in for s in capped.plan._run[ExtendRowsShape]} == {1}
    with pytest.raises(ValueError, match=r"rollout\.max_extend_rows must be 0 \(any\) or a power of two, got 3"):
        dataclasses.replace(config, max_extend_rows=3)


@pytest.mark.slow
def test_greedy_continuous_batching_on_a_mesh_matches_sessions(qwen_tokenizer, greedy):
    graphdef, params, config, sampler = greedy
    mesh = parallel.make_mesh(data=2, fsdp=2, tensor=2)
    sharded = Sampler(graphdef, config, mesh=mesh)
    sharded_params = jax.device_put(params, parallel.param_shardings(params, mesh))
    continuous = rollout(qwen_tokenizer, sharded, sharded_params, continuous=True)
    assert_same_trajectories(rollout(qwen_tokenizer, sampler, params, continuous=False).trajectories,
                             continuous.trajectories, atol=1e-4)
    assert all(s.rows_in % 4 == 0 for s in sharded.plan._run[ExtendRowsShape])


@pytest.mark.slow
def test_sampled_continuous_batching_samples_the_same_tokens(qwen_tokenizer, sampled):
    params, sampler = sampled
    sessions = rollout(qwen_tokenizer, sampler, params, continuous=False, seed=5)
    continuous = rollout(qwen_tokenizer, sampler, params, continuous=True, seed=5)
    assert len({t.num_turns for t in sessions.trajectories}) > 1
    assert_same_trajectories(sessions.trajectories, continuous.trajectories)
    assert sessions.metrics["decode_occupancy"] < continuous.metrics["decode_occupancy"]


@pytest.mark.slow
@pytest.mark.parametrize("sharded", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["one-device", "mesh"])
def test_frozen_continuous_batching_compiles_nothing_for_another_batch(qwen_tokenizer, tiny, sampled, backend_compiles,
                                                                       sharded):
    """After freeze_shapes (which compiles the bucket grid, row extends included, ahead) another batch compiles
    nothing."""
    params, sampler = sampled
    if sharded:
        mesh = parallel.make_mesh(data=2, fsdp=1, tensor=2, devices=jax.devices()[:4])
        sampler = Sampler(tiny[1], sampler.config, mesh=mesh)
        params = jax.device_put(params, parallel.param_shardings(params, mesh))
    rollout(qwen_tokenizer, sampler, params, continuous=True, seed=0)
    sampler.freeze_shapes()
    with backend_compiles() as compiles:
        other = rollout(qwen_tokenizer, sampler, params, continuous=True, seed=1)
    assert compiles == []
    first = rollout(qwen_tokenizer, sampler, params, continuous=True, seed=0)
    assert [t.tokens.tolist() for t in other.trajectories] != [t.tokens.tolist() for t in first.trajectories]


def assert_row_untouched(state, before, row):
    """Every field of `row` in the decode state is bitwise what it was."""
    for a, b in zip(jax.tree.leaves(state.cache), jax.tree.leaves(before.cache)):
        np.testing.assert_array_equal(a[:, row] if a.ndim == 5 else a[row], b[:, row] if b.ndim == 5 else b[row])
    for field in ("logits_bv", "count_b"):
        np.testing.assert_array_equal(getattr(state, field)[row], getattr(before, field)[row])
    np.testing.assert_array_equal(jax.random.key_data(state.key_b)[row], jax.random.key_data(before.key_b)[row])


def test_row_extends_leave_the_other_rows_untouched(greedy):
    _, params, _, sampler = greedy
    keys_n = sampler.sequence_keys(jax.random.key(0), 0, 3)
    session = sampler.start_rows(params, [[11, 12, 13], [21, 22], [31, 32, 33, 34]], keys_n, rows=2, first_turn=8)
    never = lambda token_lists: [False] * len(token_lists)  # noqa: E731
    session.extend({}, [0, 1])
    session.begin_turn(0, 8)
    session.begin_turn(1, 2)
    assert [seq for seq, _ in session.decode_chunk(never)] == [1]  # chunks of 4: sequence 0 still samples
    # Sequence 1 leaves; sequence 2 takes its row (its prompt encoded there) while row 0 is in the middle of a turn.
    before = jax.device_get(session._state)
    session.finish(1)
    session.extend({}, [2])
    state = jax.device_get(session._state)
    assert_row_untouched(state, before, 0)
    assert (int(state.cache.end_b[1]), int(state.cache.next_pos_b[1]), int(state.count_b[1])) == (4, 4, 0)
    np.testing.assert_array_equal(state.cache.valid_bs[1], np.arange(state.cache.capacity) < 4)
    np.testing.assert_array_equal(jax.random.key_data(state.key_b)[1], jax.random.key_data(keys_n)[2])
    # Sequence 0 ends its turn; it keeps 3 of its 8 tokens and gets an observation: row 1 stays as it was.
    (seq, turn), = session.decode_chunk(never)
    assert seq == 0 and len(turn.token_ids) == 8
    before = jax.device_get(session._state)
    session.extend({0: (3, [41, 42])}, [])
    state = jax.device_get(session._state)
    assert_row_untouched(state, before, 1)
    assert (int(state.cache.end_b[0]), int(state.cache.next_pos_b[0])) == (3 + 3 + 2, 3 + 3 + 2)
    assert state.cache.valid_bs[0, :8].all() and not state.cache.valid_bs[0, 8:].any()
    assert int(state.count_b[0]) == 8 and not (state.logits_bv[0] == before.logits_bv[0]).all()


@pytest.mark.slow
def test_frozen_row_session_compacts_to_a_row_bucket_its_first_rollout_skipped(greedy):
    """A first session's 8 rows went straight to 2 (6 of 8 turns ended at once); frozen, a session with 5 live rows
    decodes in 6 rows (a 1.5x bucket), not 8 (every compacted row bucket below the batch is compiled ahead), and
    samples the same tokens."""
    graphdef, params, config, _ = greedy
    sampler = Sampler(graphdef, config)  # a plan of its own: this test freezes it
    prompts = [[11 + i, 12, 13] for i in range(8)]
    never = lambda token_lists: [False] * len(token_lists)  # noqa: E731

    def run(budgets):
        session = sampler.start_rows(params, prompts, sampler.sequence_keys(jax.random.key(0), 0, 8), rows=8,
                                     first_turn=8)
        session.extend({}, list(range(8)))
        for seq, budget in enumerate(budgets):
            session.begin_turn(seq, budget)
        rows, turns = [], {}
        while session.decoding:  # chunks of 4 steps: a turn of budget 4 ends after the first
            for seq, turn in session.decode_chunk(never):
                turns[seq] = turn.token_ids
                session.finish(seq)
            session.compact()
            rows.append(session.batch_rows)
        return rows, turns, session.decode_counts

    first_rows, first, _ = run([4] * 6 + [8] * 2)
    assert first_rows == [2, 2]
    sampler.freeze_shapes()
    rows, turns, counts = run([4] * 3 + [8] * 5)
    assert rows == [6, 6]
    # 8 rows x 4 steps, then 5 of 6 rows x 4 steps: 52 tokens in 56 row-steps (64 in 8 rows).
    assert counts == {"sampled_tokens": 52, "row_steps": 56}
    assert all(turns[seq][:4] == first[seq] for seq in (3, 4, 5)) and all(turns[seq] == first[seq] for seq in (0, 6, 7))


@pytest.mark.slow
def test_a_stop_request_ends_a_continuous_batch_between_decode_chunks(qwen_tokenizer, greedy):
    """The engine asks `stopping` before every decode chunk: a rollout whose stop comes at the 6th question ends
    there (stopped, no trajectories; asked twice more: the engine's loop, the rollout's end), where the whole
    rollout asks it more than twice as often."""
    _, params, _, sampler = greedy
    config = AgentConfig(**CONFIG, continuous_batching=True)
    asked = []

    def never():
        asked.append(None)
        return False

    agent.rollout(sampler, params, qwen_tokenizer, EchoRetriever(), EXAMPLES, jax.random.key(0), config, stopping=never)
    whole = len(asked)
    asked.clear()

    def at_the_sixth():
        asked.append(None)
        return len(asked) >= 6

    stopped = agent.rollout(sampler, params, qwen_tokenizer, EchoRetriever(), EXAMPLES, jax.random.key(0), config,
                            stopping=at_the_sixth)
    assert stopped.stopped and stopped.trajectories == []
    assert len(asked) <= 6 + 2 and whole > 2 * len(asked), (len(asked), whole)
