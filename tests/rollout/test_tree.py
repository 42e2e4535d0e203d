"""Tree rollouts (`rollout.trees`): the node choice, the shape of the trees, forks that share their parent's turns
and sample with the log-probs of their own context, and the budget they spend."""
import dataclasses

import jax
import numpy as np
import pytest

from llds_jax import config as config_lib
from llds_jax.config import ConfigError
from llds_jax.protocol import Action
from llds_jax.rollout import agent
from llds_jax.rollout.config import AgentConfig
from llds_jax.rollout.driver import sequence_keys
from llds_jax.rollout.steps import Conversation
from llds_jax.rollout.trajectory import Lineage, Turn
from llds_jax.rollout.tree import Leaf, choose_nodes, positions, whole_groups
from tests.rollout.test_agent import (REAL_CONFIG, EchoRetriever, example, full_forward_logps,  # noqa: F401
                                      real)

TREES = dict(trees=2, tree_rounds=1, tree_forks=2)  # 6 leaves per prompt


def leaf(position, tree, surprisals, nodes=None):
    """A leaf whose turn k begins with tokens of surprisal surprisals[k]."""
    turns = [Turn((1, 2), (-s, -s), "", Action(None, ""), 2) for s in surprisals]
    return Leaf(position, tree, Conversation([5], Lineage(0, tree, (0, position)), turns),
                nodes or [(position, k) for k in range(len(turns))])


def test_positions_keep_each_trees_leaves_together():
    chains, forks = positions(AgentConfig(trees=2, tree_rounds=2, tree_forks=2), groups=2)
    assert chains.tolist() == [0, 5, 10, 15]
    assert forks.tolist() == [[1, 2, 6, 7, 11, 12, 16, 17], [3, 4, 8, 9, 13, 14, 18, 19]]


def test_uniform_choice_draws_without_replacement_when_it_can_and_falls_back_to_the_root():
    cfg = AgentConfig(trees=1, tree_forks=2)
    leaves = [leaf(0, 0, [1.0, 1.0, 1.0]), leaf(3, 0, [1.0, 1.0], nodes=[(0, 0), (0, 1)])]
    picks = [tuple(choose_nodes(leaves, cfg, np.random.default_rng(seed))) for seed in range(40)]
    assert {frozenset(p) for p in picks} == {frozenset({(0, 1), (0, 2)})}  # the root is no candidate here
    assert all(len(set(p)) == 2 for p in picks)
    one = [leaf(0, 0, [1.0, 1.0])]  # one node: drawn twice
    assert choose_nodes(one, cfg, np.random.default_rng(0)) == [(0, 1), (0, 1)]
    answered = [leaf(0, 0, [1.0])]  # answered at once: only the root
    assert choose_nodes(answered, cfg, np.random.default_rng(0)) == [(0, 0), (0, 0)]


def test_entropy_choice_takes_the_most_surprising_turn_starts():
    cfg = AgentConfig(trees=1, tree_forks=2, tree_select="entropy")
    leaves = [leaf(0, 0, [9.0, 0.5, 3.0, 2.0]), leaf(4, 0, [0.1, 0.2, 2.5], nodes=[(0, 0), (0, 1), (4, 2)])]
    assert choose_nodes(leaves, cfg, np.random.default_rng(0)) == [(0, 2), (4, 2)]  # the root (9.0) is no node
    cfg3 = dataclasses.replace(cfg, tree_forks=3)
    assert choose_nodes(leaves[:1], cfg3, None) == [(0, 2), (0, 3), (0, 1)]


def tree_rollout(tokenizer, real, seed=0, first=0, **config):
    """The tree rollout of two questions' groups of 6 (from global sample `first` on: a host's share)."""
    _, _, params, sampler = real
    examples = [example(i, f"question number {i}", ("paris",)) for i in range(2) for _ in range(6)]
    agent_config = AgentConfig(**REAL_CONFIG, **{**TREES, **config})
    request = agent.RolloutRequest(examples[first:], jax.random.key(seed), agent_config, first_sequence=first,
                                   group_size=agent_config.tree_group)
    return agent.rollout(sampler, params, tokenizer, EchoRetriever(), request)


@pytest.fixture(scope="module")
def tree_result(qwen_tokenizer, real):
    return tree_rollout(qwen_tokenizer, real)


def shared_turns(a, b):
    """How many leading turns (tokens and observations) two trajectories share."""
    k = 0
    while k < min(len(a.turns), len(b.turns)) and a.turns[k] == b.turns[k]:
        k += 1
    return k


def test_forks_share_their_parents_turns_and_sample_with_their_own_contexts_log_probs(qwen_tokenizer, real,
                                                                                      tree_result):
    graphdef, _, params, _ = real
    trajs = tree_result.trajectories
    assert len(trajs) == 12
    assert [t.example.question for t in trajs] == [f"question number {i}" for i in range(2) for _ in range(6)]
    shared = []
    for tree in range(4):
        chain, forks = trajs[3 * tree], trajs[3 * tree + 1:3 * tree + 3]
        for fork in forks:
            k = shared_turns(chain, fork)
            shared.append(k)
            assert k == 0 or chain.turns[k - 1].observation is not None  # forked at an agent-step boundary
            if len(chain.turns) > 1:
                assert k >= 1  # a chain that searched is forked after a search, never at its root
            assert not (fork.turns == chain.turns)  # the fork sampled its own continuation (surely, here)
    assert max(shared) >= 1
    packed, (ref_bt,) = full_forward_logps(graphdef, params, trajs, (0.9,))
    model_bt = packed.loss_mask_bt[:, 1:] == 1
    np.testing.assert_allclose(packed.sampler_logp_bt[:, 1:][model_bt], ref_bt[model_bt], atol=1e-4)


def test_a_tree_rollout_encodes_each_chains_prompt_only_and_is_deterministic(qwen_tokenizer, real, tree_result):
    m = tree_result.metrics
    chains = [tree_result.trajectories[i] for i in (0, 3, 6, 9)]
    assert m["prompt_tokens"] == sum(len(t.prompt_ids) for t in chains)
    assert m["trajectories"] == 12
    forked_observations = sum(len(turn.observation_ids) for t in tree_result.trajectories for turn in t.turns)
    assert 0 < m["observation_tokens"] < forked_observations  # shared observations were appended once
    # What the update trains again: each fork's turns and observations up to its node (the turns it shares with
    # its tree's chain, the only leaf it can fork from with one round).
    shared = [(chains[i // 3], t) for i, t in enumerate(tree_result.trajectories) if i % 3]
    assert m["forked_prefix_tokens"] == sum(len(turn.token_ids) + len(turn.observation_ids)
                                            for chain, fork in shared for turn in fork.turns[:shared_turns(chain, fork)])
    assert m["forked_prefix_tokens"] > 0
    again = tree_rollout(qwen_tokenizer, real)
    second_host = tree_rollout(qwen_tokenizer, real, first=6)  # the second prompt's group, as a second host has it
    for a, b in zip(tree_result.trajectories, again.trajectories):
        np.testing.assert_array_equal(a.tokens, b.tokens)
    for a, b in zip(tree_result.trajectories[6:], second_host.trajectories, strict=True):
        np.testing.assert_array_equal(a.tokens, b.tokens)


@pytest.mark.slow
def test_two_rounds_fork_from_forks_and_carry_the_finished_rows(qwen_tokenizer, real):
    graphdef, _, params, _ = real
    result = tree_rollout(qwen_tokenizer, real, trees=1, tree_rounds=2, tree_forks=1, seed=3,
                          tree_select="entropy")
    trajs = result.trajectories
    assert len(trajs) == 12  # 4 groups (each question's 6 samples: two groups of 3) x 1 tree x (1 + 2 x 1)
    packed, (ref_bt,) = full_forward_logps(graphdef, params, trajs, (0.9,))
    model_bt = packed.loss_mask_bt[:, 1:] == 1
    np.testing.assert_allclose(packed.sampler_logp_bt[:, 1:][model_bt], ref_bt[model_bt], atol=1e-4)


def run_config(**overrides):
    cfg = config_lib.default_config()
    cfg.run_dir, cfg.model.path = "run", "model"
    cfg.data.prompts_per_step, cfg.optim.mini_batch_size, cfg.optim.micro_batch_size = 2, 12, 4
    cfg.data.samples_per_prompt = 6
    cfg.rollout.trees, cfg.rollout.tree_forks = 2, 2
    for key, value in overrides.items():
        section, name = key.split("__")
        cfg[section][name] = value
    return cfg


@pytest.mark.parametrize("overrides, message", [
    (dict(data__samples_per_prompt=5), r"data.samples_per_prompt \(5\) must equal .* rollout.trees x \(1 \+ "
                                       r"rollout.tree_rounds x rollout.tree_forks\) = 6"),
    (dict(rollout__continuous_batching=True), "rollout.trees needs turn-synchronous sessions"),
    (dict(rollout__max_batch_size=8), r"rollout.max_batch_size \(8\) must be a multiple"),
    (dict(rollout__tree_select="best"), "rollout.tree_select must be one of 'uniform', 'entropy'"),
    (dict(rollout__tree_forks=0), "rollout.tree_forks"),
])
def test_tree_config_errors_name_the_key(overrides, message):
    config_lib.check(run_config())
    with pytest.raises(ConfigError, match=message):
        config_lib.check(run_config(**overrides))


def test_leaves_carry_their_group_tree_and_prng_key_from_the_start(qwen_tokenizer, real, tree_result):
    """Leaf p (global sequence id) is in group p // 6 (a question's leaves), tree p // 3 (1 + 1 x 2 leaves each) and
    samples from fold_in(rng, p): the chains' and the forks' keys alike, whatever host holds them."""
    rng = jax.random.key(0)
    for first, result in ((0, tree_result), (6, tree_rollout(qwen_tokenizer, real, first=6))):
        ids = range(first, 12)
        keys = sequence_keys(rng, ids)
        assert [t.lineage.group for t in result.trajectories] == [p // 6 for p in ids]
        assert [t.lineage.tree for t in result.trajectories] == [p // 3 for p in ids]
        assert [t.lineage.key_data for t in result.trajectories] == [tuple(int(x) for x in k) for k in keys]
    assert len({t.lineage.key_data for t in tree_result.trajectories}) == 12


def test_whole_groups_counts_the_groups_and_names_samples_that_are_not_one_questions():
    a, b = example(0, "question a"), example(1, "question b")
    assert whole_groups([a, a, b, b], 2) == 2
    with pytest.raises(ValueError, match="3 samples are not whole groups of 2"):
        whole_groups([a, a, b], 2)
    with pytest.raises(ValueError, match="samples 12..13 are not one question's group"):
        whole_groups([a, a, a, b], 2, first=10)
