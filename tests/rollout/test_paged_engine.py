"""The rollout engine on a tiny model against a full forward of the same model (no cache): every sampled token's
log-prob is the full forward's, greedy tokens are its argmax, across cut turns, observation extends, stop ids,
shared prompts and forks; each sequence samples from its own PRNG stream whatever shares its steps (policies,
token budgets, batch mates, a mesh); after the first rollout nothing compiles, and no step program sorts the
vocabulary."""
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from llds_jax import parallel
from llds_jax.model import ModelConfig, Transformer
from llds_jax.rollout import agent
from llds_jax.rollout.config import AgentConfig, SamplingConfig
from llds_jax.rollout.driver import sequence_keys
from llds_jax.rollout.engine import Engine, EngineConfig
from llds_jax.rollout.paged_sampler import token_budgets
from llds_jax.rollout.runner import DeviceRunner
from llds_jax.rollout.trajectory import em_score
from tests.rollout.test_agent import (ANSWER, CLOSE, GT, INVALID_END, LT, NEWLINE, OBS_END, PARIS, SEARCH, STEERING,
                                      THE, EchoRetriever, example, full_forward_logps, paged, steered_params)

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
    return steered_params(model, steering=GREEDY_STEERING), config


@pytest.fixture(scope="module")
def sampled(qwen_tokenizer, tiny):
    model, graphdef = tiny
    # Plain temperature sampling: nucleus sampling (top_p) sums over the 151,936-entry vocabulary 30 times a step.
    config = SamplingConfig(temperature=1.0, top_p=1.0, decode_chunk=4, stop_ids=agent.turn_stop_ids(qwen_tokenizer))
    return steered_params(model, steering=STEERING), config


def rollout(tokenizer, tiny, params, sampling, continuous, seed=0, examples=EXAMPLES, max_step_tokens=512,
            page_size=8, mesh=None):
    model, graphdef = tiny
    config = AgentConfig(**CONFIG, continuous_batching=continuous)
    sampler = paged(graphdef, model.cfg, sampling, config, CONFIG["max_batch_size"], max_step_tokens, page_size)
    if mesh is not None:
        sampler = type(sampler)(graphdef, model.cfg, sampling, sampler.engine_config, mesh)
    request = agent.RolloutRequest(examples, jax.random.key(seed), config, group_size=2)
    return agent.rollout(sampler, params, tokenizer, EchoRetriever(), request)


def assert_same_trajectories(first, second, atol=1e-5):
    """Token for token the same trajectories; sampler log-probs equal but for float rounding."""
    assert len(first) == len(second)
    for a, b in zip(first, second):
        for field in ("tokens", "loss_mask", "action_ids", "answer_mask"):
            np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
        np.testing.assert_allclose(a.sampler_logp, b.sampler_logp, atol=atol)
        no_logps = lambda turns: [dataclasses.replace(t, logps=()) for t in turns]  # noqa: E731
        assert no_logps(a.turns) == no_logps(b.turns)
        assert (a.end_reason, em_score(a), a.final_answer, a.lineage) == (b.end_reason, em_score(b), b.final_answer,
                                                                          b.lineage)


def assert_full_forward(graphdef, params, trajectories, temperature):
    """Every sampled token's log-prob is the full forward's at `temperature`, and not at another one."""
    packed, (ref_bt, other_bt) = full_forward_logps(graphdef, params, trajectories, (temperature, temperature + 0.5))
    model_bt = packed.loss_mask_bt[:, 1:] == 1
    np.testing.assert_allclose(packed.sampler_logp_bt[:, 1:][model_bt], ref_bt[model_bt], atol=1e-4)
    assert np.abs(packed.sampler_logp_bt[:, 1:][model_bt] - other_bt[model_bt]).max() > 1e-2


def full_forward_argmax(graphdef, params, tokens):
    """int [len(tokens) - 1]: the model's most likely next token after each prefix (one forward, no cache)."""
    logits_tv = nnx.merge(graphdef, params)(jnp.asarray(tokens, jnp.int32)[None])[0, :-1]
    return np.asarray(jnp.argmax(logits_tv, axis=-1))


def test_token_budgets_double_from_the_slots_to_the_step_maximum():
    assert token_budgets(8, 100) == (8, 16, 32, 64, 100)
    assert token_budgets(8, 64) == (8, 16, 32, 64)
    assert token_budgets(8, 8) == (8,)


@pytest.mark.parametrize("continuous", [False, True], ids=["barrier", "continuous"])
@pytest.mark.parametrize("max_step_tokens, page_size", [(512, 8), (16, 5)], ids=["whole-prompts", "chunked"])
def test_greedy_tokens_are_the_full_forwards_argmax_under_every_policy_and_budget(qwen_tokenizer, tiny, greedy,
                                                                                 continuous, max_step_tokens, page_size):
    _, graphdef = tiny
    params, sampling = greedy
    result = rollout(qwen_tokenizer, tiny, params, sampling, continuous, max_step_tokens=max_step_tokens,
                     page_size=page_size)
    trajs = result.trajectories
    # Trajectories of different numbers of turns and lengths, searches, invalid turns, answers and full contexts.
    assert len({t.num_turns for t in trajs}) > 1 and len({len(t.tokens) for t in trajs}) == len(trajs)
    assert {t.end_reason for t in trajs} == {"answer", "context_full"}
    assert any(t.num_valid_searches for t in trajs) and any(turn.action.kind is None for t in trajs for turn in t.turns)
    for t in trajs:
        model_t = np.flatnonzero(t.loss_mask[1:]) + 1
        np.testing.assert_array_equal(t.tokens[model_t], full_forward_argmax(graphdef, params, t.tokens)[model_t - 1])
    assert_full_forward(graphdef, params, trajs, 1.0)  # greedy reports temperature-1 log-probs
    m = result.metrics
    # What each step program ran: every ragged batch within its bucket; every prompt and observation token and
    # every sampled token but each turn's last (fed back by the decode loop, not the batch) went through a batch
    # once, except the prompt tokens a group's sample shared and the tokens rolled back after a turn's cut.
    buckets = token_budgets(CONFIG["max_batch_size"], max_step_tokens)
    assert sum(m[f"step_calls_{b}"] for b in buckets) >= 1
    assert all(m[f"step_tokens_{b}"] <= b * m[f"step_calls_{b}"] for b in buckets)
    assert sum(m[f"step_tokens_{b}"] for b in buckets) >= (m["prompt_tokens"] - m["shared_prompt_tokens"]
                                                          + m["observation_tokens"])
    assert 0 < m["decode_occupancy"] <= 1


@pytest.mark.slow
def test_sampled_streams_do_not_depend_on_the_policy_or_the_budget_and_groups_share_their_prompt(qwen_tokenizer,
                                                                                                tiny, sampled):
    """Two samples of each of four questions: the same tokens under barrier and continuous scheduling and in
    chunked prompts, each sample from its own stream, log-probs a full forward's; a group's second sample takes its
    prompt's pages from the first."""
    _, graphdef = tiny
    params, sampling = sampled
    examples = [ex for ex in EXAMPLES[:4] for _ in range(2)]
    barrier = rollout(qwen_tokenizer, tiny, params, sampling, False, seed=5, examples=examples)
    trajs = barrier.trajectories
    assert len({t.num_turns for t in trajs}) > 1
    # A group's samples draw from streams of their own (the steered model makes some pairs agree all the same).
    assert len({t.lineage.key_data for t in trajs}) == len(trajs)
    assert any(a.tokens.shape != b.tokens.shape or (a.tokens != b.tokens).any() for a, b in zip(trajs[::2],
                                                                                                trajs[1::2]))
    assert barrier.metrics["shared_prompt_tokens"] > 0
    for continuous, max_step_tokens in ((True, 512), (True, 16), (False, 16)):
        other = rollout(qwen_tokenizer, tiny, params, sampling, continuous, seed=5, examples=examples,
                        max_step_tokens=max_step_tokens)
        assert_same_trajectories(trajs, other.trajectories)
    assert_full_forward(graphdef, params, trajs, 1.0)
    reseeded = rollout(qwen_tokenizer, tiny, params, sampling, False, seed=6, examples=examples).trajectories
    assert any(a.tokens.shape != b.tokens.shape or (a.tokens != b.tokens).any() for a, b in zip(trajs, reseeded))


@pytest.mark.slow
def test_a_rollout_on_a_mesh_samples_what_one_device_does(qwen_tokenizer, tiny, greedy):
    _, graphdef = tiny
    params, sampling = greedy
    mesh = parallel.make_mesh(data=2, fsdp=1, tensor=2, devices=jax.devices()[:4])
    sharded_params = jax.device_put(params, parallel.param_shardings(params, mesh))
    one = rollout(qwen_tokenizer, tiny, params, sampling, True)
    assert_same_trajectories(one.trajectories, rollout(qwen_tokenizer, tiny, sharded_params, sampling, True,
                                                       mesh=mesh).trajectories, atol=1e-4)


# -- the engine's calls on the device, without the agent loop ------------------------------------------------------

SMALL = ModelConfig.tiny()  # a 256-token vocabulary


@pytest.fixture(scope="module")
def small():
    model = Transformer(SMALL, rngs=nnx.Rngs(0))
    return nnx.split(model)


class RunnerSource:
    """A rollout's engines (`interfaces.EngineSource`) over `sampler`'s runner: overlapping (the runner's split API,
    counting in `sourced` the batch tokens it takes on the device from the call before) or one call at a time
    (`overlap` False)."""

    def __init__(self, sampler, overlap: bool):
        self.sampler, self.overlap, self.token_budgets = sampler, overlap, sampler.token_budgets
        self.sourced, self.engines = 0, []

    def dispatch(self, params, batch, previous):
        self.sourced += int(np.sum(batch.source_s >= 0))
        return self.sampler.runner.dispatch(params, batch, previous)

    def fetch(self, handle):
        return self.sampler.runner.fetch(handle)

    def engine(self, params, stop_matcher=None):
        runner = self if self.overlap else self.sampler.runner
        self.engines.append(Engine(runner, params, self.sampler.engine_config, stop_matcher, overlap=self.overlap))
        return self.engines[-1]


@pytest.mark.parametrize("continuous", [False, True], ids=["barrier", "continuous"])
def test_overlapping_calls_sample_the_tokens_of_one_call_at_a_time(qwen_tokenizer, tiny, sampled, continuous):
    """Each call dispatched before the one in flight is absorbed (a decoding sequence's batch token taken on the
    device from that call's samples; the row of a turn that ended there dropped, its samples discarded) samples,
    token for token, the trajectories of one call at a time; log-probs a full forward's."""
    model, graphdef = tiny
    params, sampling = sampled
    config = AgentConfig(**CONFIG, continuous_batching=continuous)
    sampler = paged(graphdef, model.cfg, sampling, config, CONFIG["max_batch_size"])
    runs = {}
    for overlap in (False, True):
        source = RunnerSource(sampler, overlap)
        request = agent.RolloutRequest(EXAMPLES, jax.random.key(5), config, group_size=2)
        runs[overlap] = agent.rollout(source, params, qwen_tokenizer, EchoRetriever(), request)
        assert (source.sourced > 0) == overlap
        assert (source.engines[-1].counts.dropped_rows > 0) == overlap
    assert len({t.num_turns for t in runs[True].trajectories}) > 1
    assert_same_trajectories(runs[False].trajectories, runs[True].trajectories)
    assert_full_forward(graphdef, params, runs[True].trajectories, 1.0)


def device_engine(small, sampling, max_seqs=4, max_context=96, page_size=4):
    graphdef, params = small
    cfg = EngineConfig(max_seqs=max_seqs, token_budgets=(4, 8, 16, 32), decode_chunk=sampling.decode_chunk,
                       page_size=page_size, num_pages=2 * max_seqs * -(-max_context // page_size) + 1,
                       max_context=max_context, stop_ids=sampling.stop_ids)
    return Engine(DeviceRunner(graphdef, SMALL, sampling, cfg), params, cfg)


def run_turns(engine):
    """Steps until no sequence runs; the turns that ended, by sequence."""
    turns = {}
    while engine.running:
        turns.update(engine.step())
    return turns


def prompts_of(lengths, seed=0):
    rs = np.random.RandomState(seed)
    return [rs.randint(10, 250, size=n).tolist() for n in lengths]


def assert_context_logps(small, context, turn_logps, temperature):
    """The log-probs of a sequence's sampled tokens (`turn_logps`: position -> log-prob) are a full forward's."""
    graphdef, params = small
    logits_tv = nnx.merge(graphdef, params)(jnp.asarray(context, jnp.int32)[None])[0]
    logp_tv = np.asarray(jax.nn.log_softmax(logits_tv / temperature, axis=-1))
    positions = sorted(turn_logps)
    np.testing.assert_allclose([turn_logps[p] for p in positions],
                               [logp_tv[p - 1, context[p]] for p in positions], atol=1e-4)


def test_stop_ids_cut_turns_and_extends_keep_the_full_forwards_log_probs(small):
    """Turns end at a stop id (returned last) or their budget; each is cut (1, 4 or 7 tokens rolled back) and an
    observation appended; the kept tokens' log-probs are a full forward's of the final context."""
    stop_ids = tuple(range(0, 256, 5))
    engine = device_engine(small, SamplingConfig(temperature=1.5, decode_chunk=8, stop_ids=stop_ids))
    prompts = prompts_of([4, 9, 6])
    keys = sequence_keys(jax.random.key(3), range(3))
    contexts, logps = {seq: list(p) for seq, p in enumerate(prompts)}, {seq: {} for seq in range(3)}
    for seq, prompt in enumerate(prompts):
        engine.add_request(seq, prompt, keys[seq], 20)
    hits = 0
    for turn_index in range(3):
        for seq, turn in sorted(run_turns(engine).items()):
            stops = [k for k, token in enumerate(turn.token_ids) if token in stop_ids]
            assert turn.hit_stop == bool(stops)
            if stops:
                assert stops == [len(turn.token_ids) - 1]
                hits += 1
            else:
                assert len(turn.token_ids) == 20
            keep = max(0, len(turn.token_ids) - 1 - 3 * ((seq + turn_index) % 3))
            logps[seq].update({len(contexts[seq]) + k: turn.logps[k] for k in range(keep)})
            contexts[seq] += turn.token_ids[:keep]
            if turn_index < 2:
                observation = [11 + seq, 12, 13]
                contexts[seq] += observation
                engine.extend(seq, keep, observation, 20)
            else:
                engine.finish(seq)
    assert hits >= 3 and engine.pages.free_pages == engine.config.num_pages - 1
    for seq in range(3):
        assert_context_logps(small, contexts[seq], logps[seq], 1.5)


def test_a_sequence_samples_the_same_whatever_its_batch_mates(small):
    sampling = SamplingConfig(temperature=1.0, top_p=1.0, decode_chunk=4)
    prompts = prompts_of([5, 11, 3])

    def first_turns(n, rng):
        engine = device_engine(small, sampling)
        keys = sequence_keys(rng, range(n))
        for seq in range(n):
            engine.add_request(seq, prompts[seq], keys[seq], 12)
        return run_turns(engine)

    three, two = first_turns(3, jax.random.key(7)), first_turns(2, jax.random.key(7))
    for seq in range(2):
        assert two[seq].token_ids == three[seq].token_ids
        np.testing.assert_allclose(two[seq].logps, three[seq].logps, atol=1e-5)
    other = first_turns(3, jax.random.key(8))
    assert [other[s].token_ids for s in range(3)] != [three[s].token_ids for s in range(3)]


def test_a_greedy_fork_samples_what_its_parent_sampled_from_the_same_context_and_a_sampled_one_its_own(small):
    """Forked at the start of the parent's second turn (a page table and at most one page copied), a greedy fork
    samples the parent's second turn again; its log-probs are a full forward's. A sampled fork draws from its own
    key: a different turn, at a full forward's log-probs too."""
    greedy = SamplingConfig(greedy=True, decode_chunk=3)
    engine = device_engine(small, greedy)
    prompt = prompts_of([10], seed=4)[0]
    keys = sequence_keys(jax.random.key(0), range(3))
    engine.add_request(0, prompt, keys[0], 7)
    first = run_turns(engine)[0]
    engine.extend(0, 5, [21, 22], 9)
    second = run_turns(engine)[0]
    engine.fork(1, 0, 1, keys[1], 9)
    assert run_turns(engine)[1].token_ids == second.token_ids
    context = prompt + first.token_ids[:5] + [21, 22] + second.token_ids
    assert_context_logps(small, context, {len(context) - 9 + k: lp for k, lp in enumerate(second.logps)}, 1.0)

    sampled = device_engine(small, SamplingConfig(temperature=1.0, top_p=1.0, decode_chunk=3))
    sampled.add_request(0, prompt, keys[0], 7)
    parent = run_turns(sampled)[0]
    sampled.fork(2, 0, 0, keys[2], 7)  # at the root: the prompt's pages shared
    fork = run_turns(sampled)[2]
    assert fork.token_ids != parent.token_ids
    assert_context_logps(small, prompt + fork.token_ids,
                         {len(prompt) + k: lp for k, lp in enumerate(fork.logps)}, 1.0)


def test_after_the_first_rollout_no_step_compiles_and_no_program_sorts_the_vocabulary(qwen_tokenizer, tiny,
                                                                                     backend_compiles):
    """Nucleus sampling (top_p 0.9, no top_k) runs without a sort of the vocabulary; the same search finds the
    sort that top_k over the whole vocabulary compiles (the check can bite)."""
    model, graphdef = tiny
    params = nnx.split(model)[1]
    sampling = SamplingConfig(temperature=1.0, top_p=0.9, decode_chunk=4,
                              stop_ids=agent.turn_stop_ids(qwen_tokenizer))
    config = AgentConfig(**CONFIG, continuous_batching=True)
    new = paged(graphdef, model.cfg, sampling, config, CONFIG["max_batch_size"], max_step_tokens=64)
    agent.rollout(new, params, qwen_tokenizer, EchoRetriever(), agent.RolloutRequest(EXAMPLES, jax.random.key(1),
                                                                                     config))
    assert new.freeze_shapes() > 0  # the buckets the first rollout did not run
    with backend_compiles() as compiles:
        agent.rollout(new, params, qwen_tokenizer, EchoRetriever(), agent.RolloutRequest(EXAMPLES,
                                                                                         jax.random.key(2), config))
        assert new.freeze_shapes() == 0
    assert compiles == []

    def sorts(sampler, bucket):
        hlo = sampler.runner.step(bucket).lower(params, *sampler.runner.abstract_args(bucket)).compile().as_text()
        return len(re.findall(r"\bsort\(", hlo))

    assert all(sorts(new, bucket) == 0 for bucket in new.engine_config.token_budgets)
    top_k = paged(graphdef, model.cfg, dataclasses.replace(sampling, top_k=model.cfg.vocab_size), config,
                  CONFIG["max_batch_size"], max_step_tokens=64)
    assert sorts(top_k, CONFIG["max_batch_size"]) > 0
