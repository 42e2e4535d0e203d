"""Segments trained exactly (rollout.context_policy): a tiny steered model's rollout with drop_observations, its
trajectories packed segment by segment, the trainer's log-probs of every segment against the sampler's; the batch of
policy none as before; the LLDS response gate over segments against NumPy."""
import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from llds_jax.config.sections import ObjectiveConfig, UpdateConfig
from llds_jax.model import ModelConfig, Transformer
from llds_jax.rl.llds import llds_gate
from llds_jax.rl.train_step import RLTrainStep
from llds_jax.rollout import agent
from llds_jax.rollout.config import AgentConfig, SamplingConfig
from llds_jax.train.batching import padded_batch, round_up
from tests.rollout.test_agent import REAL_TEMPERATURE, VARYING, EchoRetriever, example, paged, steered_params
from tests.rl.test_losses import np_gate

CONFIG = dict(max_turns=4, max_turn_tokens=24, max_observation_tokens=40, max_prompt_tokens=256,
              max_context_tokens=512, keep_observations=1)
UPDATE = UpdateConfig(mini_batch_size=2, micro_batch_size=2, logp_time_chunk=32, reference_dtype="float32",
                      pack_trajectories=True)


@pytest.fixture(scope="module")
def steered(qwen_tokenizer):
    """(the steered model, its sampler's source): every turn searches (VARYING), turns of varying length."""
    model = Transformer(ModelConfig.tiny(vocab_size=151936), rngs=nnx.Rngs(0))
    graphdef, _ = nnx.split(model)
    params = steered_params(model, steering=VARYING)
    sampling = SamplingConfig(temperature=REAL_TEMPERATURE, top_p=1.0, decode_chunk=8,
                              stop_ids=agent.turn_stop_ids(qwen_tokenizer))
    source = paged(graphdef, model.cfg, sampling, AgentConfig(**CONFIG), 8)
    return nnx.merge(graphdef, params), params, source


def rollout(tokenizer, steered, policy):
    _, params, source = steered
    cfg = AgentConfig(**CONFIG, context_policy=policy)
    examples = [example(i, f"question number {i}", ("paris",)) for i in range(4)]
    return agent.rollout(source, params, tokenizer, EchoRetriever(),
                         agent.RolloutRequest(examples, jax.random.key(0), cfg)).trajectories


def trainer_logp(model, batch):
    """The trainer's log-probs ([B, T]) of a batch (rewards and advantages 0), on its packed rows."""
    step = RLTrainStep(model, ObjectiveConfig(temperature=REAL_TEMPERATURE), UPDATE,
                       segmented=batch.segment_first_bt is not None)
    zeros = np.zeros(batch.num_trajectories, np.float32)
    prepared = step.prepare_batch(batch.with_rewards(zeros).with_advantages(zeros))
    logp_uxbt = np.asarray(step.sequence_logp(nnx.state(model, nnx.Param), prepared))
    return logp_uxbt.reshape(batch.tokens_bt.shape)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["none", "drop_observations"])
def test_the_trainer_scores_every_segment_as_the_sampler_did(qwen_tokenizer, steered, policy):
    model = steered[0]
    trajectories = rollout(qwen_tokenizer, steered, policy)
    segments = [len(t.segments) for t in trajectories]
    assert segments == [1] * 4 if policy == "none" else max(segments) >= 3  # several edits
    rows = max(sum(len(s.tokens) for s in t.segments) for t in trajectories)
    batch = padded_batch(trajectories, 0, round_up(rows, 64), segmented=policy != "none")
    logp_bt = trainer_logp(model, batch)
    trained_bt = batch.loss_mask_bt == 1
    assert trained_bt.sum() == sum(t.loss_mask.sum() for t in trajectories)  # every sampled token, once
    np.testing.assert_allclose(logp_bt[trained_bt], batch.sampler_logp_bt[trained_bt], atol=1e-4)
    if policy != "none":  # sharp: the same rows as one sequence each (segments attending to the ones before)
        whole = dataclasses.replace(batch, segment_first_bt=np.zeros_like(batch.segment_first_bt))
        gap = np.abs(trainer_logp(model, whole)[trained_bt] - batch.sampler_logp_bt[trained_bt]).max()
        assert gap > 1e-3  # 10 x the tolerance


def old_padded_batch(trajectories, pad_id, length):
    """The batch as the trainer built it before segments (written out from that code)."""
    num = len(trajectories)
    fields = {name: np.zeros((num, length), np.float32) for name in ("mask", "loss_mask", "answer_mask",
                                                                       "sampler_logp")}
    tokens, actions = np.full((num, length), pad_id, np.int32), np.full((num, length), -1, np.int32)
    for row, t in enumerate(trajectories):
        n = len(t.tokens)
        tokens[row, :n], actions[row, :n], fields["mask"][row, :n] = t.tokens, t.action_ids, 1
        fields["loss_mask"][row, :n], fields["answer_mask"][row, :n] = t.loss_mask, t.answer_mask
        fields["sampler_logp"][row, :n] = t.sampler_logp
    return tokens, actions, fields


@pytest.mark.slow
def test_policy_none_builds_the_batch_as_before(qwen_tokenizer, steered):
    trajectories = rollout(qwen_tokenizer, steered, "none")
    length = round_up(max(len(t.tokens) for t in trajectories), 64)
    batch = padded_batch(trajectories, 7, length)
    tokens, actions, fields = old_padded_batch(trajectories, 7, length)
    np.testing.assert_array_equal(batch.tokens_bt, tokens)
    np.testing.assert_array_equal(batch.action_ids_bt, actions)
    for name, want in fields.items():
        np.testing.assert_array_equal(getattr(batch, f"{name}_bt"), want)
    assert batch.segment_first_bt is None


def np_segment_gate(delta, m, adv, first):
    """The response gate with a segment as the response: np_gate("response") of each segment on its own."""
    g = np.zeros_like(delta)
    for b in range(len(delta)):
        for start in np.unique(first[b]):
            in_segment = first[b] == start
            g[b, in_segment] = np_gate("response", delta[b:b + 1, in_segment], m[b:b + 1, in_segment],
                                       adv[b:b + 1])[0]
    return g


def test_the_response_gate_holds_each_segment_by_its_own_net_delta():
    rng = np.random.default_rng(0)
    num, length = 6, 40
    m = (rng.uniform(size=(num, length)) < 0.6).astype(np.float32)
    delta = rng.normal(size=(num, length)).astype(np.float32)
    adv = np.asarray([1.0, 0.0, -1.0, 0.5, 2.0, 0.0], np.float32)
    starts = [sorted(rng.choice(np.arange(1, 30), size=3, replace=False)) for _ in range(num)]
    first = np.stack([np.asarray([max([0] + [s for s in row if s <= t]) for t in range(length)], np.int32)
                      for row in starts])
    actions = np.full((num, length), -1, np.int32)
    got = np.asarray(llds_gate("response", delta, m, adv, actions, first))
    want = np_segment_gate(delta, m, adv, first)
    np.testing.assert_array_equal(got, want)
    whole = np.asarray(llds_gate("response", delta, m, adv, actions))
    assert (got != whole).any()  # the segments' sums decide, not the rows'
    np.testing.assert_array_equal(whole, np_gate("response", delta, m, adv))


@pytest.mark.slow
def test_segmented_batches_of_another_layout_compile_nothing_after_the_first(qwen_tokenizer, steered,
                                                                             backend_compiles):
    """Two rollouts of many turns and several edits, padded to one length: the second batch (other segments, other
    packed-row counts) trains with the programs the first compiled (`optim.precompile_row_counts`)."""
    model, params, source = steered
    cfg = AgentConfig(**{**CONFIG, "max_turns": 6}, context_policy="drop_observations")
    examples = [example(i, f"question number {i}", ("paris",)) for i in range(4)]
    runs = [agent.rollout(source, params, qwen_tokenizer, EchoRetriever(),
                          agent.RolloutRequest(examples, jax.random.key(seed), cfg)).trajectories for seed in (0, 1)]
    assert all(sum(len(t.segments) for t in ts) > len(ts) for ts in runs)  # edits in both
    assert max(len(t.segments) for ts in runs for t in ts) >= 4
    length = round_up(max(sum(len(s.tokens) for s in t.segments) for ts in runs for t in ts), 64)
    update = dataclasses.replace(UPDATE, precompile_row_counts=True)
    step = RLTrainStep(model, ObjectiveConfig(temperature=REAL_TEMPERATURE), update, segmented=True)
    rewards = np.asarray([1.0, 0.0, 1.0, 0.0], np.float32)
    batches = [padded_batch(ts, 0, length, segmented=True).with_rewards(rewards).with_advantages(rewards - 0.5)
               for ts in runs]
    assert [r.num_rows for r in step.prepare_batch(batches[0]).rows] != \
        [r.num_rows for r in step.prepare_batch(batches[1]).rows]
    state = step.init_state()
    ref = step.reference_params(state.params)
    state, _ = step.train_on_batch(state, ref, batches[0])
    with backend_compiles() as compiles:
        state, metrics = step.train_on_batch(state, ref, batches[1])
    assert compiles == [] and metrics.scalars["actor/nonfinite"] == 0
