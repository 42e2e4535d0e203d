"""What a run holds for its rollouts on the paged engine: the device runner (the page pool and the step programs,
kept across rollouts) and the engine shapes; `PagedSampler.engine(params)` opens one rollout's `Engine`.

The shapes are static for the whole run, so the step programs compile once: S sequence slots (every sequence of a
rollout, or `rollout.max_batch_size`), token buckets from S up to `rollout.max_step_tokens` (powers of two), and a
pool of `rollout.num_pages` pages of `rollout.page_size` slots (0: every slot's worst case, S x max_context_tokens,
plus the padding page).
"""
from __future__ import annotations

from typing import Any, Optional

from jax.sharding import Mesh

from llds_jax.config.sections import pool_pages
from llds_jax.model.config import ModelConfig
from llds_jax.programs import AbstractProgram
from llds_jax.rollout.config import AgentConfig, KernelTiles, PagingConfig, SamplingConfig
from llds_jax.rollout.engine import Engine, EngineConfig
from llds_jax.rollout.interfaces import StopMatcher
from llds_jax.rollout.runner import DeviceRunner, PagePool


def token_budgets(max_seqs: int, max_step_tokens: int) -> tuple[int, ...]:
    """The token buckets of a step: max_seqs (every decoding sequence's pending token), then doubling up to
    max_step_tokens (which is the last, whether a power of two or not)."""
    budgets = [max_seqs]
    while budgets[-1] * 2 < max_step_tokens:
        budgets.append(budgets[-1] * 2)
    if max_step_tokens > budgets[-1]:
        budgets.append(max_step_tokens)
    return tuple(budgets)


def engine_config(agent: AgentConfig, sampling: SamplingConfig, max_seqs: int, page_size: int,
                  max_step_tokens: int, num_pages: int = PagingConfig.num_pages) -> EngineConfig:
    """The engine's shapes for a run (see the module docstring)."""
    return EngineConfig(max_seqs=max_seqs, token_budgets=token_budgets(max_seqs, max(max_step_tokens, max_seqs)),
                        decode_chunk=sampling.decode_chunk, page_size=page_size,
                        num_pages=num_pages or pool_pages(max_seqs, agent.max_context_tokens, page_size),
                        max_context=agent.max_context_tokens, stop_ids=sampling.stop_ids)


class PagedSampler:
    """The paged engine's device side for a run: one `DeviceRunner` and the engine shapes
    (`interfaces.EngineSource`: `token_budgets` are the step programs' buckets).

    Args:
      graphdef: from `graphdef, params = nnx.split(model)`.
      model_cfg: the model's config.
      sampling: how tokens are drawn.
      engine: the engine shapes (`engine_config`).
      mesh: the rollout's mesh (None: the default device).
      pool: a page pool shared with the run's other PagedSampler (`runner.PagePool`); None: its own.
      tiles: the attention kernel's tiles (`KernelTiles`; default: the kernel's own).
    """

    def __init__(self, graphdef, model_cfg: ModelConfig, sampling: SamplingConfig, engine: EngineConfig,
                 mesh: Optional[Mesh] = None, pool: Optional[PagePool] = None, tiles: KernelTiles = KernelTiles()):
        self.config, self.engine_config, self.token_budgets = sampling, engine, engine.token_budgets
        self.runner = DeviceRunner(graphdef, model_cfg, sampling, engine, mesh, pool, tiles)
        self._params = None  # the last rollout's, whose shapes `freeze_shapes` compiles at

    def engine(self, params: Any, stop_matcher: Optional[StopMatcher] = None) -> Engine:
        """A rollout's engine over the run's pool (empty: every page free) with the policy `params`."""
        self._params = params
        return Engine(self.runner, params, self.engine_config, stop_matcher)

    def abstract_programs(self, params: Any) -> list[AbstractProgram]:
        """The rollout's step programs at abstract `params` (`DeviceRunner.abstract_programs`)."""
        return self.runner.abstract_programs(params)

    def freeze_shapes(self, grid: bool = True) -> int:
        """After the first rollout: compiles the step program at every token bucket it did not run (`grid`), so
        that no later step compiles. Returns the programs compiled."""
        return self.runner.compile_all(self._params) if grid and self._params is not None else 0
