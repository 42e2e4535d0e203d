"""The Search-R1 multi-turn agent loop over the rollout engine and an async retriever.

Per batch of questions (a `RolloutRequest`): prompts (protocol.fit_prompt: within `max_prompt_tokens`, the question
cut first) are encoded once into the engine's paged KV cache; then up to `max_turns` turns with search and one final
turn in which a search is not executed:

  1. every unfinished sequence decodes until its text holds `</search>` or `</answer>`, a stop token (EOS), or
     `max_turn_tokens` new tokens;
  2. the turn is cut (protocol.cut_turn_tokens): the kept, trained tokens are the sampled ones up to the token that
     completes the cut. The stop token is never kept (Search-R1 drops the end-of-turn token too). Sampled tokens
     after the cut are rolled back out of the KV cache;
  3. the action is parsed from the cut text: `answer` ends the sequence; `search` queries go to the retriever in
     batched calls; no valid action appends the invalid-action message;
  4. the observation is tokenized (add_special_tokens=False), cut to `max_observation_tokens` (counted per turn)
     and appended to the KV cache; the conversation is never re-encoded.

The driver (`rollout.driver`) schedules the conversations on the engine under one policy: `barrier` (turn-
synchronous sessions of `max_batch_size`), `continuous` (`rollout.continuous_batching`) or `tree`
(`rollout.trees`, Tree-GRPO). Retrieval overlaps decoding: a turn that ends is cut and parsed at once and its
search sent while the engine decodes the others. Each query's result does not depend on the call it went in, so
the trajectories do not depend on the policy's pace; only the waiting does.

A failed search (an error result for that query, an exception or a timeout of the whole call) gives that
sequence the observation `steps.SEARCH_ERROR_OBSERVATION` (an information block holding one "Search failed: ..." line)
and records the error; the other sequences are unaffected.

Context caps differ from Search-R1 in one way: Search-R1 left-truncates the rolling context to 4096 tokens; with a
KV cache we instead end a sequence cleanly (end reason "context_full") when its next turn or observation would
take prompt + response past `max_context_tokens` or the response past `max_response_tokens`. A turn's budget is
shortened to what fits.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Optional

import jax

from llds_jax.data.qa import QAExample
from llds_jax.rollout.config import AgentConfig
from llds_jax.rollout.driver import Driver
from llds_jax.rollout.interfaces import EngineSource
from llds_jax.rollout.partial import Carry, StepPlan, settle
from llds_jax.rollout.stats import RolloutStats
from llds_jax.rollout.steps import AgentSteps
from llds_jax.rollout.trajectory import Trajectory, rollout_metrics
from llds_jax.search.types import Retriever


@dataclasses.dataclass(frozen=True)
class Rollout:
    """Finished trajectories (in input order), the rollout's `stats` and its batch `metrics`: the trajectories'
    means and shares (`trajectory.rollout_metrics`) and the stats' (`RolloutStats.metrics`: seconds, counts,
    tokens/s, decode occupancy, the step programs' calls and tokens per token bucket).

    `stopped`: the rollout was abandoned on a stop request (`RolloutRequest.stopping`): no trajectories, no metrics.
    `carry`: a partial step's groups left for the next steps (`rollout.partial`); None without a plan.
    """

    trajectories: list[Trajectory]
    metrics: dict[str, float]
    stats: Optional[RolloutStats] = None
    stopped: bool = False
    carry: Optional[Carry] = None

    def __repr__(self) -> str:
        # Short: asyncio.Runner.run formats the finished task, result included, when it restores the SIGINT
        # handler; the full repr of thousands of trajectories' arrays took longer than the rollout's decoding.
        return f"Rollout(<{len(self.trajectories)} trajectories>, metrics={self.metrics!r})"


END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>")  # Qwen2.5, Llama-3


def turn_stop_ids(tokenizer) -> tuple[int, ...]:
    """Token ids that end a turn: the tokenizer's EOS plus the end-of-turn / end-of-text tokens of the Qwen2.5 and
    Llama-3 vocabularies it has (a base model prompted with a chat template may close its turn with either)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    for token in END_OF_TURN_TOKENS:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if isinstance(token_id, int) and token_id != tokenizer.unk_token_id:
            ids.add(token_id)
    if not ids:
        raise ValueError("the tokenizer of model.tokenizer_path (default: model.path) has no EOS token: set "
                         "eos_token in its tokenizer_config.json")
    return tuple(sorted(ids))


@dataclasses.dataclass(frozen=True)
class PartialRequest:
    """A partial step's part of a rollout request (`rollout.partial`).

    Attributes:
      plan: the step's plan (`partial.plan_step`): its carried conversations resume first and the rollout ends once
        `plan.prompts` groups are complete.
      first_group: the group number the first complete group gets (this host's first group of the global batch);
        the rest follow on from it.
      max_staleness: where the carry's staleness histogram ends (`rollout.max_staleness`, `partial.settle`).
    """

    plan: StepPlan
    first_group: int = 0
    max_staleness: int = 0


@dataclasses.dataclass(frozen=True)
class RolloutRequest:
    """What one rollout runs (`rollout`).

    Attributes:
      examples: the questions, one per sample (repeat an example for several samples; they share its uid); with
        `partial`, its plan's examples.
      rng: a PRNG key; example i samples from the stream of global sequence id first_sequence + i (per session
        when `config.max_batch_size` splits the examples: `driver.session_stream`).
      config: the agent loop's limits, sampling and policy (`AgentConfig`).
      group_size: consecutive samples that form one GRPO group (global sequence id // group_size is a
        trajectory's group: `trajectory.Lineage`); with `config.trees`, a prompt's tree leaves. With `partial`,
        its plan's.
      first_sequence: the global sequence id of examples[0], e.g. this host's first row of a global batch on
        several hosts, so that the hosts together sample what one process would.
      version: the policy version its turns record (`Turn.version`: the training step); with `partial`, its
        plan's.
      partial: a partial step's plan and how its groups settle (`PartialRequest`); None: every example runs to
        its end.
      between_sessions: called before every session but the first (`config.max_batch_size` splits the examples
        into sessions; barrier and tree policies); what it raises ends the rollout (the trainer's stop check: a
        preemption notice then waits for one session, not the whole rollout).
      stopping: whether a stop was requested on this host (the trainer's PreemptionGuard): once it is, searches in
        flight are abandoned, no new turn or session starts, and the Rollout comes back `stopped` (the caller
        agrees on the stop with the other hosts: this one returns at once, they finish theirs).
    """

    examples: Sequence[QAExample]
    rng: jax.Array
    config: AgentConfig
    group_size: int = 1
    first_sequence: int = 0
    version: int = 0
    partial: Optional[PartialRequest] = None
    between_sessions: Optional[Callable[[], None]] = None
    stopping: Optional[Callable[[], bool]] = None

    def __post_init__(self):
        if not self.examples:
            raise ValueError("rollout: no examples")
        if self.partial is not None:
            plan = self.partial.plan
            if (self.group_size, self.version) != (plan.group_size, plan.version) or \
                    list(self.examples) != plan.examples:
                raise ValueError(f"rollout: a partial request runs its plan's examples, group size "
                                 f"({plan.group_size}) and version ({plan.version}); got {len(self.examples)} "
                                 f"examples, group size {self.group_size}, version {self.version}")


def rollout(sampler: EngineSource, params, tokenizer, retriever: Retriever, request: RolloutRequest,
            runner: Optional[asyncio.Runner] = None) -> Rollout:
    """Runs the agent loop for `request` (`RolloutRequest`: the examples, their PRNG key, the agent's config and
    a partial step's plan).

    Args:
      sampler: opens the rollout's engine (`interfaces.EngineSource`, e.g. `paged_sampler.PagedSampler`); the
        engine's steps run on a worker thread.
      params: the policy parameters (`nnx.split(model)[1]`).
      tokenizer: a Hugging Face tokenizer (prompt, turn text, observations).
      retriever: the async retriever (`search.types.Retriever`).
      request: what to roll out.
      runner: an `asyncio.Runner` to reuse one event loop across calls (async retriever clients bind to a
        loop); a fresh loop per call without one.
    With `config.continuous_batching` the examples run as one stream (policy `continuous`); with `config.trees`
    each session's examples (whole groups of `config.tree_group` samples of one question) grow as trees (`tree`);
    else in turn-synchronous sessions (`barrier`). Returns a Rollout with one trajectory per example, in order;
    with a partial request, the first complete groups' trajectories, renumbered from `partial.first_group`, and
    its `carry` (`partial.settle`).
    """
    coro = rollout_async(sampler, params, tokenizer, retriever, request)
    return runner.run(coro) if runner is not None else asyncio.run(coro)


async def rollout_async(sampler: EngineSource, params, tokenizer, retriever: Retriever,
                        request: RolloutRequest) -> Rollout:
    """`rollout` as a coroutine."""
    config, partial = request.config, request.partial
    plan = partial.plan if partial is not None else None
    stats = RolloutStats(forked_prefix_tokens=0 if config.trees else None)
    agent_steps = AgentSteps(tokenizer, retriever, config, stats, request.stopping)
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rollout-decode") as decode_thread:
        engine = sampler.engine(params, agent_steps.stop_matcher())
        policy = "tree" if config.trees else "continuous" if config.continuous_batching else "barrier"
        driver = Driver(engine, agent_steps, request.examples, decode_thread, request.group_size, request.version,
                        plan)
        trajectories = await driver.run(policy, request.rng, request.first_sequence, request.between_sessions)
    if agent_steps.stopping():
        return Rollout([], {}, stopped=True)
    carry, partial_metrics = None, {}
    if partial is not None:
        trajectories, carry, partial_metrics = settle(plan, driver.convs, tokenizer, partial.first_group,
                                                      partial.max_staleness)
    stats.counts = engine.counts
    stats.rollout_s = time.perf_counter() - start
    metrics = {**rollout_metrics(trajectories), **stats.metrics(sampler.token_budgets),
               "trajectories": float(len(trajectories)), **partial_metrics}
    return Rollout(trajectories, metrics, stats, carry=carry)
