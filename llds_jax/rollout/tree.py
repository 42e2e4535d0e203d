"""Tree rollouts (Tree-GRPO, arXiv 2509.21240; `rollout.trees`): each prompt's group grows as M trees whose nodes
are agent steps, branching from existing steps instead of starting over.

Per session (whole groups of G = M x (1 + L x N) samples of one prompt each):

  round 0      M chains per prompt, sampled as the chain rollout samples them; every chain stays in the engine
               (its pages kept for later forks) and each turn's start is a node.
  round l      for each tree, N nodes chosen among its agent-step boundaries (the start of a turn after an
  (1 .. L)     observation: a think -> search -> observation step is a node; a tree with none forks its root, the
               prompt), by `rollout.tree_select`: "uniform" draws them (without replacement when the tree has N or
               more; Tree-GRPO's choice), "entropy" takes the nodes whose following turn began with the highest mean
               surprisal -log p over its first `rollout.tree_entropy_tokens` sampled tokens (an estimate of the
               entropy there, unbiased for untruncated sampling; ARPO branches where the entropy after a tool
               result is high). Each node is forked in the engine (`Engine.fork`: the parent's page table up to
               the node, at most one page copied: never a re-encode) and the fork samples its own continuation
               to the end, from its own PRNG stream. Finished leaves stay in the engine until the last round.

A tree ends with 1 + L x N leaves; the leaves are the group's trajectories, so shapes stay static. Leaf j of tree t
of the session's group b sits at position p = b x G + t x (1 + L x N) + j (j = 0: the chain; then the forks of round
1, 2, ... in node order): a tree's leaves are contiguous (a leaf's `Lineage.tree` is its global id // (1 + L x N)),
and leaf p samples from the global sequence id first_sequence + p, the id chains use, so the split of a batch over
hosts and sessions does not change what is sampled. The node choice draws from a NumPy generator seeded by the
rollout's key, the tree's first sequence id and the round.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from llds_jax.data.qa import QAExample
from llds_jax.rollout.config import AgentConfig
from llds_jax.rollout.steps import Conversation
from llds_jax.rollout.trajectory import Lineage

Node = tuple[int, int]  # (position of the leaf that first sampled from it, turn index): one agent-step boundary


@dataclasses.dataclass
class Leaf:
    """One trajectory of a tree while it grows.

    Attributes:
      position: its place among the session's examples (see the module docstring).
      tree: its tree, numbered within the session.
      conv: its conversation.
      nodes: the node at the start of each turn it sampled (shared with the leaf it was forked from up to the fork).
    """

    position: int
    tree: int
    conv: Conversation
    nodes: list[Node] = dataclasses.field(default_factory=list)


def positions(config: AgentConfig, groups: int) -> tuple[np.ndarray, np.ndarray]:
    """Positions of the chains [groups x M] and of round l's forks [L, groups x M x N] (see the module
    docstring), in session order."""
    m, n, per_tree = config.trees, config.tree_forks, config.leaves_per_tree
    bases = np.arange(groups * m) * per_tree  # the first leaf of each tree
    forks = np.stack([(bases[:, None] + 1 + l * n + np.arange(n)).ravel() for l in range(config.tree_rounds)])
    return bases, forks


def whole_groups(examples: Sequence[QAExample], group: int, first: int = 0) -> int:
    """How many groups of `group` samples of one question each `examples` (samples first .. on) holds; raises
    ValueError naming the samples that are not whole groups of one question."""
    if len(examples) % group:
        raise ValueError(f"tree rollout: {len(examples)} samples are not whole groups of {group}")
    for g in range(len(examples) // group):
        if len({ex.uid for ex in examples[g * group:(g + 1) * group]}) != 1:
            raise ValueError(f"tree rollout: samples {first + g * group}..{first + (g + 1) * group - 1} are not one "
                             "question's group")
    return len(examples) // group


def choose_nodes(leaves: Sequence[Leaf], config: AgentConfig, rng: np.random.Generator) -> list[Node]:
    """The N nodes one round forks in a tree whose leaves are `leaves` (`rollout.tree_select`; see the module
    docstring). Candidates are the tree's boundaries after an agent step (turn index >= 1, a turn sampled from it);
    the root (turn 0) when there are none."""
    n = config.tree_forks
    candidates = sorted({node for leaf in leaves for node in leaf.nodes if node[1] >= 1})
    if not candidates:
        candidates = [leaves[0].nodes[0]]
    if config.tree_select == "uniform":
        picks = rng.choice(len(candidates), size=n, replace=len(candidates) < n)
        return [candidates[i] for i in picks]
    convs = {leaf.position: leaf.conv for leaf in leaves}

    def surprisal(node: Node) -> float:
        logps = convs[node[0]].turns[node[1]].logps[:config.tree_entropy_tokens]
        return -float(np.mean(logps)) if logps else 0.0

    ranked = sorted(candidates, key=lambda node: (-surprisal(node), node))  # stable: ties by node
    return [ranked[i % len(ranked)] for i in range(n)]


def fork_conversation(conv: Conversation, turns: int, lineage: Lineage) -> Conversation:
    """A copy of a conversation as it stood at the start of turn `turns`, with the fork's `lineage`."""
    kept = conv.turns[:turns]
    return Conversation(list(conv.prompt_ids), lineage, list(kept),
                        sum(len(t.token_ids) + len(t.observation_ids) for t in kept))
