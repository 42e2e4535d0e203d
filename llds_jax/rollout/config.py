"""The rollout's settings: the multi-turn protocol's limits (`AgentConfig`, llds_jax.rollout.agent) and how the
engine draws tokens (`SamplingConfig`, llds_jax.rollout.sampling) and the paged engine's shapes (`PagingConfig`).

Plain Python (no JAX): `llds_jax.config` builds these from a run config without loading JAX.
"""
from __future__ import annotations

import dataclasses

from llds_jax import bounds
from llds_jax.bounds import AT_LEAST_1, NON_NEGATIVE, POSITIVE, PROBABILITY_MASS, field


TREE_SELECTIONS = ("uniform", "entropy")


@dataclasses.dataclass(frozen=True)
class AgentConfig:
    """The multi-turn protocol's limits (Search-R1 defaults).

    Attributes:
      max_turns: turns whose search is executed; one final turn (search not executed) follows.
      max_turn_tokens: new tokens per turn.
      max_observation_tokens: observation tokens kept (the first ones).
      max_prompt_tokens: the prompt keeps its last this many tokens.
      max_context_tokens: cap on prompt + response tokens of a sequence.
      max_response_tokens: cap on response tokens (model and observation) of a sequence.
      retrieval_top_k: documents per search.
      search_timeout_s: timeout of one batched retriever call.
      max_batch_size: sequences per sampler session (0: all at once); larger inputs run in several sessions.
      continuous_batching: instead of sessions that run their sequences turn by turn, one stream in which a
        sequence enters as soon as the engine has a slot for it and each takes its turns at its own pace
        (`llds_jax.rollout.driver`, policy "continuous"). The same tokens are sampled.
      trees: tree rollouts (`llds_jax.rollout.tree`, Tree-GRPO): each prompt's group grows as this many trees (M);
        0: chains, each sample its own conversation.
      tree_rounds: expansion rounds of each tree (L).
      tree_forks: nodes each tree forks per round (N); a tree ends with 1 + L x N leaves, a group with
        M x (1 + L x N).
      tree_select: how a round picks its nodes among a tree's agent-step boundaries: "uniform" (Tree-GRPO) or
        "entropy" (ARPO-like: the nodes whose following turn began with the highest mean surprisal over its first
        `tree_entropy_tokens` sampled tokens).
      tree_entropy_tokens: the tokens that score a node for "entropy".
    """

    SECTION = "rollout"  # the run-config section of its fields (llds_jax.bounds)

    max_turns: int = field(3, NON_NEGATIVE)
    max_turn_tokens: int = field(500, AT_LEAST_1)
    max_observation_tokens: int = field(500, AT_LEAST_1)
    max_prompt_tokens: int = field(2048, AT_LEAST_1)
    max_context_tokens: int = field(4096, AT_LEAST_1)
    max_response_tokens: int = field(4096, AT_LEAST_1)
    retrieval_top_k: int = field(3, AT_LEAST_1)
    search_timeout_s: float = field(60.0, POSITIVE)
    max_batch_size: int = field(0, NON_NEGATIVE)
    continuous_batching: bool = False
    trees: int = field(0, NON_NEGATIVE)
    tree_rounds: int = field(1, AT_LEAST_1)
    tree_forks: int = field(1, AT_LEAST_1)
    tree_select: str = field("uniform", choices=TREE_SELECTIONS)
    tree_entropy_tokens: int = field(8, AT_LEAST_1)

    @property
    def leaves_per_tree(self) -> int:
        """Trajectories of one tree: its chain and one per fork (1 + L x N)."""
        return 1 + self.tree_rounds * self.tree_forks

    @property
    def tree_group(self) -> int:
        """Trajectories a prompt's trees give (M x (1 + L x N)); 0 without trees."""
        return self.trees * self.leaves_per_tree

    def __post_init__(self):
        bounds.check(self)
        if self.trees and self.continuous_batching:
            raise ValueError("rollout.trees needs turn-synchronous sessions: set rollout.continuous_batching False")
        if self.trees and self.max_batch_size % self.tree_group:
            raise ValueError(f"rollout.max_batch_size ({self.max_batch_size}) must be a multiple of a prompt's tree "
                             f"leaves rollout.trees x (1 + rollout.tree_rounds x rollout.tree_forks) = "
                             f"{self.tree_group}: a session holds whole trees")
        if self.max_prompt_tokens >= self.max_context_tokens:
            raise ValueError(f"rollout.max_prompt_tokens ({self.max_prompt_tokens}) must be below "
                             f"rollout.max_context_tokens ({self.max_context_tokens})")


# ----- partial rollouts (issue 59; llds_jax/rollout/partial.py): rollout.partial, rollout.over_sampling,
# rollout.max_staleness --------------------------------------------------------------------------------------------
OVER_SAMPLING = bounds.Range(lambda v: v >= 1, ">= 1")


@dataclasses.dataclass(frozen=True)
class PartialConfig:
    """Partial rollouts (`llds_jax.rollout.partial`, docs/partial-rollouts.md).

    Attributes:
      partial: start more groups than a step trains on, end the rollout once enough are complete and carry the
        unfinished conversations into the next steps (needs objective.tis_cap > 0: their older tokens' behaviour
        correction).
      over_sampling: groups started per step, in units of the step's prompts (ceil(over_sampling x P)).
      max_staleness: the most policy versions a trained token may lag behind the step that trains it; a carried
        group older than that is dropped (counted in `partial/dropped`).
    """

    SECTION = "rollout"

    partial: bool = False
    over_sampling: float = field(2.0, OVER_SAMPLING)
    max_staleness: int = field(1, NON_NEGATIVE)

    def __post_init__(self):
        bounds.check(self)
# ----- end of partial rollouts -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How tokens are drawn and how the decode loop is shaped.

    Attributes:
      temperature: logits are divided by it before sampling (and for the reported log-probs); > 0.
      top_p: nucleus sampling mass in (0, 1]; 1 disables it. With top_k the nucleus is taken among the k
        candidates.
      top_k: sample among the k most likely tokens; 0 disables it.
      greedy: take the argmax (temperature, top_p, top_k ignored; log-probs at temperature 1).
      stop_ids: token ids that end a row's turn (EOS); the stop token itself is returned with the turn.
      decode_chunk: decode steps per device call between host checks of the turn text.
    """

    SECTION = "rollout"  # the run-config section of its fields (llds_jax.bounds)

    temperature: float = field(1.0, POSITIVE)
    top_p: float = field(0.95, PROBABILITY_MASS)
    top_k: int = field(0, NON_NEGATIVE)
    greedy: bool = False
    stop_ids: tuple[int, ...] = ()
    decode_chunk: int = field(32, AT_LEAST_1)

    def __post_init__(self):
        bounds.check(self)
        object.__setattr__(self, "stop_ids", tuple(int(i) for i in self.stop_ids))


@dataclasses.dataclass(frozen=True)
class PagingConfig:
    """The rollout engine's shapes (`llds_jax.rollout.paged_sampler`): a paged KV cache, one ragged step program per
    token bucket.

    Attributes:
      page_size: token slots per page of the paged KV cache.
      max_step_tokens: the most tokens one step's ragged batch holds (prompt and observation chunks and the
        decoding sequences' pending tokens; at least the sequence slots); the step programs are compiled at the
        sequence slots, doubling up to this.
      num_pages: pages in the pool; 0: every sequence slot's worst case (max_context_tokens each).
    """

    SECTION = "rollout"

    page_size: int = field(16, AT_LEAST_1)
    max_step_tokens: int = field(512, AT_LEAST_1)
    num_pages: int = field(0, NON_NEGATIVE)

    def __post_init__(self):
        bounds.check(self)
