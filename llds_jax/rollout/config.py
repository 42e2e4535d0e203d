"""The views the rollout code takes of the run config's `rollout` section (`llds_jax.config.sections.RolloutConfig`):
the multi-turn protocol's limits (`AgentConfig`, llds_jax.rollout.agent), partial rollouts (`PartialConfig`,
llds_jax.rollout.partial), how the engine draws tokens (`SamplingConfig`, llds_jax.rollout.sampling), the paged
engine's shapes (`PagingConfig`) and its attention kernel's tiles (`KernelTiles`, llds_jax.rollout.runner).

A view's field that is a run key takes the section's declaration (`bounds.same`): its default, range and the key
its errors name. Plain Python (no JAX).
"""
from __future__ import annotations

import dataclasses

from llds_jax import bounds
from llds_jax.bounds import same
from llds_jax.config.sections import EvalConfig, RolloutConfig, tree_leaves


@dataclasses.dataclass(frozen=True)
class AgentConfig:
    """The multi-turn protocol's limits, as `RolloutConfig` declares them (each field is the `rollout` key of its
    name; the docs of `RolloutConfig`). With `trees`, a tree ends with 1 + L x N leaves (L `tree_rounds`, N
    `tree_forks`), a group with M x (1 + L x N); `tree_select` "entropy" picks the nodes whose following turn began
    with the highest mean surprisal over its first `tree_entropy_tokens` sampled tokens."""

    max_turns: int = same(RolloutConfig, "max_turns")
    max_turn_tokens: int = same(RolloutConfig, "max_turn_tokens")
    max_observation_tokens: int = same(RolloutConfig, "max_observation_tokens")
    max_prompt_tokens: int = same(RolloutConfig, "max_prompt_tokens")
    max_context_tokens: int = same(RolloutConfig, "max_context_tokens")
    max_response_tokens: int = same(RolloutConfig, "max_response_tokens")
    max_trajectory_tokens: int = same(RolloutConfig, "max_trajectory_tokens")
    context_policy: str = same(RolloutConfig, "context_policy")
    keep_observations: int = same(RolloutConfig, "keep_observations")
    retrieval_top_k: int = same(RolloutConfig, "retrieval_top_k")
    search_timeout_s: float = same(RolloutConfig, "search_timeout_s")
    max_batch_size: int = same(RolloutConfig, "max_batch_size")
    continuous_batching: bool = same(RolloutConfig, "continuous_batching")
    trees: int = same(RolloutConfig, "trees")
    tree_rounds: int = same(RolloutConfig, "tree_rounds")
    tree_forks: int = same(RolloutConfig, "tree_forks")
    tree_select: str = same(RolloutConfig, "tree_select")
    tree_entropy_tokens: int = same(RolloutConfig, "tree_entropy_tokens")

    @classmethod
    def of(cls, rollout: RolloutConfig, evaluation: EvalConfig | None = None) -> AgentConfig:
        """The agent loop of a `rollout` section: training's, or with the `eval` section an evaluation's
        (eval.max_turns, chains)."""
        limits = {f.name: getattr(rollout, f.name) for f in dataclasses.fields(cls)}
        if evaluation is not None:
            limits.update(max_turns=evaluation.max_turns, trees=0)
        return cls(**limits)

    @property
    def leaves_per_tree(self) -> int:
        """Trajectories of one tree: its chain and one per fork (1 + L x N)."""
        return tree_leaves(1, self.tree_rounds, self.tree_forks)

    @property
    def tree_group(self) -> int:
        """Trajectories a prompt's trees give (M x (1 + L x N)); 0 without trees."""
        return tree_leaves(self.trees, self.tree_rounds, self.tree_forks)

    def __post_init__(self):
        bounds.check(self)


@dataclasses.dataclass(frozen=True)
class PartialConfig:
    """Partial rollouts (`llds_jax.rollout.partial`, docs/partial-rollouts.md), as `RolloutConfig` declares them:
    `partial` starts ceil(`over_sampling` x P) groups, ends the rollout once P are complete and carries the
    unfinished conversations into the next steps; a carried group more than `max_staleness` policy versions old is
    dropped (counted in `partial/dropped`)."""

    partial: bool = same(RolloutConfig, "partial")
    over_sampling: float = same(RolloutConfig, "over_sampling")
    max_staleness: int = same(RolloutConfig, "max_staleness")

    @classmethod
    def of(cls, rollout: RolloutConfig) -> PartialConfig:
        """The partial rollouts' keys of a `rollout` section."""
        return cls(rollout.partial, rollout.over_sampling, rollout.max_staleness)

    def __post_init__(self):
        bounds.check(self)


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How tokens are drawn and how the decode loop is shaped (temperature, top_p, top_k, decode_chunk: the
    `rollout` keys, `RolloutConfig`).

    Attributes:
      greedy: take the argmax (temperature, top_p, top_k ignored; log-probs at temperature 1).
      stop_ids: token ids that end a row's turn (EOS); the stop token itself is returned with the turn.
    """

    temperature: float = same(RolloutConfig, "temperature")
    top_p: float = same(RolloutConfig, "top_p")
    top_k: int = same(RolloutConfig, "top_k")
    greedy: bool = False
    stop_ids: tuple[int, ...] = ()
    decode_chunk: int = same(RolloutConfig, "decode_chunk")

    @classmethod
    def of(cls, rollout: RolloutConfig, stop_ids: tuple[int, ...], greedy: bool = False) -> SamplingConfig:
        """The sampler of a `rollout` section: training samples at its temperature / top-p / top-k; `greedy`
        (evaluation) takes the argmax."""
        return cls(temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k, greedy=greedy,
                   stop_ids=stop_ids, decode_chunk=rollout.decode_chunk)

    def __post_init__(self):
        bounds.check(self)
        object.__setattr__(self, "stop_ids", tuple(int(i) for i in self.stop_ids))


@dataclasses.dataclass(frozen=True)
class PagingConfig:
    """The rollout engine's shapes (`llds_jax.rollout.paged_sampler`): a paged KV cache, one ragged step program per
    token bucket (page_size, max_step_tokens, num_pages: the `rollout` keys, `RolloutConfig`)."""

    page_size: int = same(RolloutConfig, "page_size")
    max_step_tokens: int = same(RolloutConfig, "max_step_tokens")
    num_pages: int = same(RolloutConfig, "num_pages")

    @classmethod
    def of(cls, rollout: RolloutConfig) -> PagingConfig:
        """The engine shapes of a `rollout` section."""
        return cls(page_size=rollout.page_size, max_step_tokens=rollout.max_step_tokens, num_pages=rollout.num_pages)

    def __post_init__(self):
        bounds.check(self)


@dataclasses.dataclass(frozen=True)
class Tile:
    """The ragged paged attention kernel's tile (`llds_jax.model.paged_attention`): pages of keys and query tokens
    per block (0: the kernel's default, `paged_attention.KERNEL_KV_PAGES_PER_BLOCK` and
    `KERNEL_QUERIES_PER_BLOCK`)."""

    kv_pages_per_block: int = 0
    queries_per_block: int = 0

    def kwargs(self) -> dict[str, int | None]:
        """The tile as `paged_attention`'s keyword arguments (None: its default)."""
        return {"kv_pages_per_block": self.kv_pages_per_block or None,
                "queries_per_block": self.queries_per_block or None}


@dataclasses.dataclass(frozen=True)
class KernelTiles:
    """The attention kernel's tiles in the rollout's step program (`rollout` keys, `RolloutConfig`; chosen with
    `python -m llds_jax.aot.tiles`, docs/tpu.md): the ragged forward of a token bucket above the engine's sequence
    slots at (kv_pages_per_block, queries_per_block); its decode iterations, and the ragged forward of the slots'
    bucket (whose calls hold mostly one token per sequence), at (decode_kv_pages_per_block,
    decode_queries_per_block)."""

    kv_pages_per_block: int = same(RolloutConfig, "kv_pages_per_block")
    queries_per_block: int = same(RolloutConfig, "queries_per_block")
    decode_kv_pages_per_block: int = same(RolloutConfig, "decode_kv_pages_per_block")
    decode_queries_per_block: int = same(RolloutConfig, "decode_queries_per_block")

    @classmethod
    def of(cls, rollout: RolloutConfig) -> KernelTiles:
        """The tiles of a `rollout` section."""
        return cls(**{f.name: getattr(rollout, f.name) for f in dataclasses.fields(cls)})

    @property
    def decode(self) -> Tile:
        """The tile of the decode iterations."""
        return Tile(self.decode_kv_pages_per_block, self.decode_queries_per_block)

    @property
    def ragged(self) -> Tile:
        """The tile of the ragged forward of a token bucket above the slots'."""
        return Tile(self.kv_pages_per_block, self.queries_per_block)

    def forward(self, bucket: int, slots: int) -> Tile:
        """The tile of the ragged forward at token bucket `bucket` of an engine of `slots` sequence slots."""
        return self.decode if bucket <= slots else self.ragged

    def __post_init__(self):
        bounds.check(self)
