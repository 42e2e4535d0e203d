"""Tree rollouts (Tree-GRPO, arXiv 2509.21240; `rollout.trees`): each prompt's group grows as M trees whose nodes
are agent steps, branching from existing steps instead of starting over.

Per session (whole groups of G = M x (1 + L x N) samples of one prompt each):

  round 0      M chains per prompt, sampled as the chain rollout samples them, in a session that keeps every row
               (no compaction) and records each turn's start (`Session.turn_starts`).
  round l      for each tree, N nodes chosen among its agent-step boundaries (the start of a turn after an
  (1 .. L)     observation: a think -> search -> observation step is a node; a tree with none forks its root, the
               prompt), by `rollout.tree_select`: "uniform" draws them (without replacement when the tree has N or
               more; Tree-GRPO's choice), "entropy" takes the nodes whose following turn began with the highest mean
               surprisal -log p over its first `rollout.tree_entropy_tokens` sampled tokens (an estimate of the
               entropy there, unbiased for untruncated sampling; ARPO branches where the entropy after a tool
               result is high). Each node is forked in the KV cache (`Session.fork`: the parent's rows copied on
               device, rolled back to the node and re-extended by its last token: never a re-encode) and the fork
               samples its own continuation to the end, from its own PRNG stream. Rounds before the last carry the
               finished rows for later forks.

A tree ends with 1 + L x N leaves; the leaves are the group's trajectories, so shapes stay static. Leaf j of tree t
of the session's group b sits at position p = b x G + t x (1 + L x N) + j (j = 0: the chain; then the forks of round
1, 2, ... in node order): a tree's leaves are contiguous (the trainer's tree of trajectory i is i // (1 + L x N)),
and leaf p samples from the global sequence id first_sequence + p, the id chains use, so the split of a batch over
hosts and sessions does not change what is sampled. The node choice draws from a NumPy generator seeded by the
rollout's key, the tree's first sequence id and the round.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from llds_jax.data.qa import QAExample
from llds_jax.rollout.config import AgentConfig
from llds_jax.rollout.steps import AgentSteps, Conversation
from llds_jax.rollout.trajectory import Trajectory
from llds_jax.rollout.turn_loop import TurnLoop

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


def round_sequences(config: AgentConfig, sequences: int) -> list[int]:
    """Sequences in each round's session of a tree rollout of `sequences` samples (whole groups; `rollout.tree`):
    the chains, then each round's forks plus, before the last round, every finished leaf carried for later forks."""
    chains = sequences // config.tree_group * config.trees
    forks = chains * config.tree_forks
    return [chains] + [chains + r * forks for r in range(1, config.tree_rounds)] + [forks]


def tree_ids(config: AgentConfig, trajectories: int) -> np.ndarray:
    """int32 [trajectories] the tree of each trajectory of a batch of whole groups in rollout order: i // (1 + L x N)
    with `rollout.trees`, i without (each chain its own tree)."""
    return np.arange(trajectories, dtype=np.int32) // (config.leaves_per_tree if config.trees else 1)


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


def fork_conversation(conv: Conversation, turns: int) -> Conversation:
    """A copy of a conversation as it stood at the start of turn `turns`."""
    kept = conv.turns[:turns]
    return Conversation(list(conv.prompt_ids), list(kept),
                        sum(len(t.token_ids) + len(t.observation_ids) for t in kept))


async def run(sampler, params, steps: AgentSteps, examples: Sequence[QAExample],
              decode_thread: concurrent.futures.Executor, rng: jax.Array, first_sequence: int) -> list[Trajectory]:
    """The tree rollout of `examples` (whole groups: runs of G = M x (1 + L x N) samples of one question) in
    sessions of `sampler` (a `sampler.Sampler`); returns one trajectory per example, in order (leaf positions as the
    module docstring says), or none once a stop is requested."""
    config = steps.config
    groups = whole_groups(examples, config.tree_group)
    chains, forks = positions(config, groups)
    leaves = [Leaf(int(position), tree, steps.conversation(examples[position])) for tree, position in enumerate(chains)]
    session = sampler.start(params, [leaf.conv.prompt_ids for leaf in leaves], rng,
                            sequence_ids=first_sequence + chains, compact=False)
    await TurnLoop(steps, [leaf.conv for leaf in leaves], decode_thread).run(session)
    key_data = jax.random.key_data(rng) if jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key) else rng
    seed = [int(x) for x in np.asarray(key_data).ravel()]
    for round_index in range(config.tree_rounds):
        if steps.stopping():
            return []
        _record_nodes(leaves, session)
        last = round_index == config.tree_rounds - 1
        nodes, new_leaves = [], []
        by_tree: dict[int, list[tuple[int, Leaf]]] = {}  # tree -> (session sequence, leaf) of its leaves
        for seq, leaf in enumerate(leaves):
            by_tree.setdefault(leaf.tree, []).append((seq, leaf))
        for tree in range(groups * config.trees):
            in_tree = by_tree[tree]
            chosen = choose_nodes([leaf for _, leaf in in_tree], config, np.random.default_rng(
                seed + [first_sequence + int(chains[tree]), round_index]))
            holder = {node: (seq, leaf) for seq, leaf in in_tree for node in leaf.nodes}
            for node in chosen:
                seq, leaf = holder[node]
                turn = node[1]
                nodes.append((seq, turn))
                position = int(forks[round_index][len(new_leaves)])
                conv = fork_conversation(leaf.conv, turn)
                steps.timing["forked_prefix_tokens"] += conv.response_len
                new_leaves.append(Leaf(position, tree, conv, leaf.nodes[:turn + 1]))
        keys = sampler.keys_of(rng, first_sequence + forks[round_index])
        session = session.fork(nodes, keys, carry=not last, compact=last)
        running = new_leaves if last else leaves + new_leaves
        await TurnLoop(steps, [leaf.conv for leaf in running], decode_thread).run(session)
        leaves = leaves + new_leaves
    if steps.stopping():
        return []
    leaves.sort(key=lambda leaf: leaf.position)
    return steps.trajectories(examples, [leaf.conv for leaf in leaves])


def _record_nodes(leaves: Sequence[Leaf], session) -> None:
    """Extends each leaf's nodes to every turn it has sampled (the new ones are its own)."""
    for seq, leaf in enumerate(leaves):
        leaf.nodes += [(leaf.position, turn) for turn in range(len(leaf.nodes), len(session.turn_starts[seq]))]
