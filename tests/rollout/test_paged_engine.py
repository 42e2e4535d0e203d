"""The paged engine against today's dense-cache sampler on the same tiny model: the same trajectories token for
token (greedy and sampled: each sequence's PRNG stream and decode-chunk alignment are kept) under every policy,
whatever the token budget; the sampler log-probs of a full forward."""
import re

import jax
import numpy as np
import pytest

from llds_jax.model import ModelConfig
from llds_jax.rollout import agent
from flax import nnx

from llds_jax.rollout.config import AgentConfig, SamplingConfig
from llds_jax.rollout.paged_sampler import PagedSampler, engine_config, token_budgets
from tests.rollout.test_agent import REAL_CONFIG, EchoRetriever, example, full_forward_logps, real  # noqa: F401
from tests.rollout.test_continuous import (CONFIG, assert_same_trajectories, greedy, rollout,  # noqa: F401
                                           sampled, tiny)
from tests.rollout.test_tree import TREES


def paged(graphdef, model_cfg, sampling, agent_config, max_seqs, max_step_tokens=512, page_size=8):
    return PagedSampler(graphdef, model_cfg, sampling,
                        engine_config(agent_config, sampling, max_seqs, page_size, max_step_tokens))


def test_token_budgets_double_from_the_slots_to_the_step_maximum():
    assert token_budgets(8, 100) == (8, 16, 32, 64, 100)
    assert token_budgets(8, 64) == (8, 16, 32, 64)
    assert token_budgets(8, 8) == (8,)


@pytest.mark.parametrize("continuous", [False, True], ids=["barrier", "continuous"])
@pytest.mark.parametrize("max_step_tokens, page_size", [(512, 8), (16, 5)], ids=["whole-prompts", "chunked"])
def test_greedy_trajectories_equal_the_dense_samplers(qwen_tokenizer, tiny, greedy, continuous, max_step_tokens,
                                                      page_size):
    model, graphdef = tiny
    _, params, sampling, sampler = greedy
    dense = rollout(qwen_tokenizer, sampler, params, continuous=False)
    config = AgentConfig(**CONFIG, continuous_batching=continuous)
    new = paged(graphdef, model.cfg, sampling, config, CONFIG["max_batch_size"], max_step_tokens, page_size)
    result = rollout(qwen_tokenizer, new, params, continuous=continuous)
    assert_same_trajectories(dense.trajectories, result.trajectories)
    m = result.metrics
    assert m["prompt_tokens"] == dense.metrics["prompt_tokens"]
    # What each step program ran: every ragged batch within its bucket; every prompt and observation token and
    # every sampled token but each turn's last (fed back by the decode loop, not the batch) went through a batch
    # once, except the prompt tokens a group's sample shared and the tokens rolled back after a turn's cut.
    buckets = new.engine_config.token_budgets
    assert sum(m[f"step_calls_{b}"] for b in buckets) >= 1
    assert all(m[f"step_tokens_{b}"] <= b * m[f"step_calls_{b}"] for b in buckets)
    assert sum(m[f"step_tokens_{b}"] for b in buckets) >= (m["prompt_tokens"] - m["shared_prompt_tokens"]
                                                          + m["observation_tokens"])


def test_sampled_trajectories_equal_the_dense_samplers_under_both_policies(qwen_tokenizer, tiny, sampled):
    model, graphdef = tiny
    params, sampler = sampled
    dense = rollout(qwen_tokenizer, sampler, params, continuous=False, seed=5)
    assert len({t.num_turns for t in dense.trajectories}) > 1
    for continuous in (False, True):
        config = AgentConfig(**CONFIG, continuous_batching=continuous)
        new = paged(graphdef, model.cfg, sampler.config, config, CONFIG["max_batch_size"])
        assert_same_trajectories(dense.trajectories, rollout(qwen_tokenizer, new, params, continuous, seed=5)
                                 .trajectories)


def test_tree_rollouts_equal_the_dense_samplers_and_their_log_probs_a_full_forward(qwen_tokenizer, real):
    graphdef, model_params, params, sampler = real
    examples = [example(i, f"question number {i}", ("paris",)) for i in range(2) for _ in range(6)]
    config = AgentConfig(**REAL_CONFIG, **TREES)
    dense = agent.rollout(sampler, params, qwen_tokenizer, EchoRetriever(), examples, jax.random.key(0), config)
    new = paged(graphdef, ModelConfig.tiny(vocab_size=151936), sampler.config, config, len(examples))  # `real`'s
    result = agent.rollout(new, params, qwen_tokenizer, EchoRetriever(), examples, jax.random.key(0), config)
    assert_same_trajectories(dense.trajectories, result.trajectories, atol=1e-4)
    assert result.metrics["forked_prefix_tokens"] == dense.metrics["forked_prefix_tokens"] > 0
    packed, (ref_bt,) = full_forward_logps(graphdef, params, result.trajectories, (0.9,))
    model_bt = packed.loss_mask_bt[:, 1:] == 1
    np.testing.assert_allclose(packed.sampler_logp_bt[:, 1:][model_bt], ref_bt[model_bt], atol=1e-4)


def test_after_the_first_rollout_no_step_compiles_and_no_program_sorts_the_vocabulary(qwen_tokenizer, tiny,
                                                                                     backend_compiles):
    model, graphdef = tiny
    params = nnx.split(model)[1]
    sampling = SamplingConfig(temperature=1.0, top_p=0.9, decode_chunk=4, stop_ids=agent.turn_stop_ids(qwen_tokenizer))
    config = AgentConfig(**CONFIG, continuous_batching=True)
    new = paged(graphdef, model.cfg, sampling, config, CONFIG["max_batch_size"], max_step_tokens=64)
    rollout(qwen_tokenizer, new, params, continuous=True, seed=1)
    assert new.freeze_shapes() > 0  # the buckets the first rollout did not run
    with backend_compiles() as compiles:
        rollout(qwen_tokenizer, new, params, continuous=True, seed=2)
        assert new.freeze_shapes() == 0
    assert compiles == []
    for bucket in new.engine_config.token_budgets:  # the compiled program's HLO: no sort op (a full sort of
        hlo = new.runner._step.lower(params, *new.runner.abstract_args(bucket)).compile().as_text()  # the vocab)
        assert not re.findall(r"\bsort\(", hlo)
