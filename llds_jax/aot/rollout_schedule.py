"""The paged engine's step calls at expected lengths, for the step estimate (`llds_jax.aot.step_estimate`): the run's
own rollout, the driver (`llds_jax.rollout.driver.Driver`: its policies, its search queue, partial rollouts' cut)
over the engine (`llds_jax.rollout.engine.Engine`: its scheduler, token buckets, page table, GRPO prompt sharing,
preemption and overlapped calls), with what a model, a tokenizer and a retriever would answer scripted
(`llds_jax.aot.scripted_agent`): each trajectory samples its script's turns and observations. Every call it makes
is recorded with what the roofline needs: its token bucket, its real tokens, the pages its sequences read and its
decode iterations, and per sequence its new tokens, its length and its samples (what the kernel-faithful estimate
costs the attention kernel's calls from). Fed a rollout's own trajectories (`Conversation.of_trajectory`) it makes
that rollout's calls, bucket for bucket (tests/rollout/test_schedule_vs_engine.py).

The conversations (`scripts`): one host's `sequences` trajectories in GRPO groups of `group` samples that share a
prompt; each length at its logged mean and spread (`llds_jax.aot.step_lengths.Lengths`: a standard deviation), its whole
numbers spread evenly about the mean at that standard deviation (a uniform's, mean +- sqrt(3) x std for long
lengths; narrowed where a cap or 1 would cut one side, so that the mean is kept) in a low-discrepancy order: the
groups' prompt tokens, the trajectories' turns (whole numbers; the most turns to the shortest prompts, since the
longer ones fill the context sooner, and no more than the context holds after the shortest prompt at the mean turn
and observation lengths), the turns' sampled tokens and the observations' tokens (one after each turn but a
trajectory's last). The spreads matter: a barrier's turn round waits for its longest row and a session for its
trajectory of most turns, a call samples up to its longest sequence's samples, and the token bucket an input call
falls in follows the lengths it holds, not their means. A turn shorter than `rollout.max_turn_tokens` ends on a stop
id at its length, which is not kept in the context (the driver cuts it; the engine samples in calls of
`decode_chunk`, so a turn ended by a stop string mid-call costs the same calls); a turn of `rollout.max_turn_tokens`
ends at its budget and keeps every token, so its last sampled token, not yet written, is written with the
observation. Of the observations, `Lengths.searches` per trajectory (spread evenly) answer a search; the others are
the invalid-action message, known when the turn ends (`AgentSteps.close_turn`).

A retriever call (the driver's queue: one call in flight, the queries closed by one engine step sent together)
answers `search_latency_calls` device calls after it was sent (1: while the next call runs, as a local index does;
the search's own seconds are costed apart), or at once when the driver waits for it with nothing to decode
(`Schedule.search_waits`). Tree rollouts are not modelled.

Partial rollouts (issue 59, `partial_run`): a few steps of the run's own plan, cut and carry (`rollout.partial`):
each starts ceil(over_sampling x P) groups (the carried ones first), is cut once P groups are complete, and carries
the rest to the next step, where the carried conversations resume at their last complete turn with their contexts
encoded again (re-prefilled); the steps after the first ones are the steady state the estimate reports
(`llds_jax.aot.step_estimate.partial_time`).

Units: tokens, pages, calls (device calls of the step program).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import math
from collections.abc import Sequence

import jax
import numpy as np

from llds_jax.aot import scripted_agent
from llds_jax.aot.scripted_agent import STOP_ID, Call
from llds_jax.config.sections import RolloutConfig, RunConfig
from llds_jax.data.qa import QAExample
from llds_jax.rollout.config import AgentConfig, PagingConfig, PartialConfig, SamplingConfig
from llds_jax.rollout.driver import Driver
from llds_jax.rollout.engine import Engine
from llds_jax.rollout.paged_sampler import engine_config
from llds_jax.rollout import partial as partial_lib
from llds_jax.rollout.partial import Carry, StepPlan, plan_step, settle
from llds_jax.rollout.step_calls import EngineConfig
POLICIES = ("barrier", "continuous")
GOLDEN = (math.sqrt(5) - 1) / 2  # the golden ratio's fraction: a low-discrepancy sequence of its multiples
WIDTH_STEPS = 12  # bisections of a spread's width that keep its standard deviation in whole numbers


@dataclasses.dataclass(frozen=True)
class Conversation:
    """One scripted trajectory: its prompt (shared by its group), per turn the tokens it samples and whether it ends
    on a stop id (dropped from the context; else it ends at its budget and keeps every token), and the tokens of the
    observation after each turn but its last and whether that observation answers a search (else it is the
    invalid-action message, appended as soon as the turn ends). A run's own trajectory (`of_trajectory`) also says
    which turns a stop string ended (`text_stops`: the engine's stop-string check, not the device, sees it end) and
    the tokens each turn kept (`kept`: its cut; default every token but a closing stop id)."""

    prompt: tuple[int, ...]
    turn_tokens: tuple[int, ...]
    observation_tokens: tuple[int, ...]
    stops: tuple[bool, ...]
    searches: tuple[bool, ...]
    text_stops: tuple[bool, ...] = ()
    kept: tuple[int, ...] = ()

    def text_stop(self, turn: int) -> bool:
        return bool(self.text_stops) and self.text_stops[turn]

    def kept_tokens(self, turn: int) -> int:
        """Tokens turn `turn` keeps in the context."""
        return self.kept[turn] if self.kept else self.turn_tokens[turn] - self.stops[turn]

    @classmethod
    def of_trajectory(cls, trajectory) -> Conversation:
        """A run's trajectory (`rollout.trajectory.Trajectory`) as its script: its prompt, per turn the tokens it
        sampled, how it ended and the tokens it kept, its observations' tokens and which answered a search."""
        turns = trajectory.turns
        return cls(tuple(trajectory.prompt_ids), tuple(t.num_sampled for t in turns),
                   tuple(len(t.observation_ids) for t in turns[:-1]), tuple(t.hit_stop for t in turns),
                   tuple(t.action.kind == "search" for t in turns[:-1]),
                   tuple(not t.hit_stop for t in turns),  # a stop string, or its budget: the same end
                   tuple(len(t.token_ids) for t in turns))


@dataclasses.dataclass(frozen=True)
class Schedule:
    """What a rollout runs: its calls in order, the engine's own counts per bucket, its policy, the most sequences
    it held at once, the driver's waits for a retriever call with nothing to decode (barrier: a turn round's last
    search call), and the share of its calls' sample slots that sampled (the engine's decode occupancy)."""

    calls: tuple[Call, ...]
    calls_per_bucket: dict[int, int]
    tokens_per_bucket: dict[int, int]
    sequences: int
    policy: str
    rows_in_flight: int
    search_waits: int
    occupancy: float


def _even(n: int, mean: float, std: float, low: int, high: int, offset: float = 0.0) -> list[int]:
    """n whole numbers of mean `mean` (their sum round(n x mean)) and standard deviation `std`, spread evenly about
    the mean (a uniform's quantiles, whole numbers by error diffusion; the width is bisected so that the whole
    numbers keep `std`, which rounding widens where lengths are few: turns), no wider than [low, high] allows on
    both sides (the mean kept); in a low-discrepancy order (the golden ratio's, from `offset`), so that any run of
    consecutive ones spans the spread."""
    order = sorted(range(n), key=lambda i: (offset + i * GOLDEN) % 1.0)
    quantile = [0.0] * n
    for r, i in enumerate(order):
        quantile[i] = 2 * (r + 0.5) / n - 1

    def at(width: float) -> list[int]:
        out, total = [], 0.0
        for q in quantile:  # rounded so that every prefix keeps its sum
            out.append(round(total + mean + width * q) - round(total))
            total += mean + width * q
        return [min(high, max(low, v)) for v in out]

    widest = max(0.0, min(mean - low, high - mean))
    narrow, wide = 0.0, min(widest, 2 * math.sqrt(3) * std)
    if std <= 0 or float(np.std(at(wide))) <= std:
        return at(wide if std > 0 else 0.0)
    for _ in range(WIDTH_STEPS):
        middle = (narrow + wide) / 2
        narrow, wide = (middle, wide) if float(np.std(at(middle))) < std else (narrow, middle)
    return at((narrow + wide) / 2)


def scripts(sequences: int, group: int, lengths, max_turns: int, max_turn_tokens: int, max_prompt_tokens: int,
            max_observation_tokens: int, max_context: int) -> list[Conversation]:
    """The scripted conversations of one host's rollout at `lengths` (`llds_jax.aot.step_lengths.Lengths`: per
    trajectory its means and spreads; module docstring), each length within its cap."""
    groups = -(-sequences // group)
    prompts = _even(groups, lengths.prompt_tokens, lengths.prompt_tokens_std, 1, max(max_prompt_tokens, 1), 0.5)
    # A trajectory's turns: at most those whose mean lengths fit the context after the shortest prompt (and
    # rollout.max_turns + 1), the most to the shortest prompts (the longer ones fill the context sooner), those of
    # equal prompts in a low-discrepancy order.
    per_turn = lengths.sampled_tokens / max(lengths.turns, 1.0)
    fit = (max_context - min(prompts) + lengths.observation_tokens) // max(per_turn + lengths.observation_tokens, 1)
    most = max(1, math.ceil(lengths.turns), min(max_turns, int(fit)))
    counts = sorted(_even(sequences, max(lengths.turns, 1.0), lengths.turns_std, 1, most), reverse=True)
    turns = [0] * sequences
    for k, i in zip(counts, sorted(range(sequences), key=lambda i: (prompts[i // group], (i * GOLDEN) % 1.0))):
        turns[i] = k
    turn_tokens = _even(sum(turns), per_turn, lengths.turn_tokens_std, 1, max_turn_tokens, 0.25)
    n_observations = max(sum(turns) - sequences, 1)
    observations = _even(n_observations, lengths.observation_tokens, lengths.observation_tokens_std,
                         1, max(max_observation_tokens, 1), 0.75)
    # The observations that answer a search: round(sequences x searches) of them, in a low-discrepancy order.
    searched = set(sorted(range(n_observations), key=lambda j: (0.125 + j * GOLDEN) % 1.0)[
        :min(n_observations, round(sequences * lengths.searches))])
    convs, t, o = [], 0, 0
    for i, k in enumerate(turns):
        ids = tuple([2 + i // group] * prompts[i // group])  # a group's samples share their prompt
        sampled = tuple(turn_tokens[t:t + k])
        convs.append(Conversation(ids, sampled, tuple(observations[o:o + k - 1]),
                                  tuple(n < max_turn_tokens for n in sampled),
                                  tuple(j in searched for j in range(o, o + k - 1))))
        t, o = t + k, o + k - 1
    return convs


def agent_for(config: EngineConfig, convs: Sequence[Conversation], max_turn_tokens: int = 0) -> AgentConfig:
    """The agent loop's limits for scripted `convs` on an engine of `config`: their most turns, a turn's budget
    `max_turn_tokens` (0: their longest turn's tokens), the context and the response within the engine's
    context."""
    return AgentConfig(max_turns=max(len(c.turn_tokens) for c in convs),
                       max_turn_tokens=max_turn_tokens or max(t for c in convs for t in c.turn_tokens),
                       max_observation_tokens=max((o for c in convs for o in c.observation_tokens), default=1),
                       max_prompt_tokens=max(len(c.prompt) for c in convs), max_context_tokens=config.max_context,
                       max_response_tokens=config.max_context, max_batch_size=config.max_seqs)


def run(config: EngineConfig, convs: Sequence[Conversation], policy: str, agent: AgentConfig | None = None,
        search_latency_calls: int = 1, overlap: bool = True) -> Schedule:
    """The calls of one rollout of `convs` under `policy` (module docstring): the run's driver over an engine of
    `config` (its stop ids replaced by STOP_ID) with the agent loop's limits `agent` (default `agent_for`); a group's
    samples are the conversations of one prompt. `search_latency_calls`: the device calls a retriever call takes
    (1: it answers while the next call runs, as a local index does; the search's own seconds are costed apart).
    `overlap`: the engine dispatches each call before it absorbs the one in flight, as it runs on a device
    (`rollout.engine`); False: one call at a time."""
    instances: dict[tuple[int, ...], int] = {}
    for conv in convs:
        instances.setdefault(conv.prompt, len(instances))
    book = scripted_agent.ScriptBook(convs, 1)
    examples = [ex for i, conv in enumerate(convs)
                for ex in scripted_agent.examples([instances[conv.prompt]], [i], 1)]
    return _drive(config, book, examples, policy, agent or agent_for(config, convs), search_latency_calls,
                  overlap)[0]


def context_tokens(conv: Conversation, turns: int) -> int:
    """Tokens of `conv`'s context after its first `turns` turns (not its last) and their observations: what a
    conversation resumed there re-encodes (each turn's sampled tokens but a closing stop id)."""
    return len(conv.prompt) + sum(conv.kept_tokens(t) + conv.observation_tokens[t] for t in range(turns))


def _drive(config: EngineConfig, book: scripted_agent.ScriptBook, examples: Sequence[QAExample], policy: str,
           agent: AgentConfig, search_latency_calls: int, overlap: bool, plan: StepPlan | None = None,
           version: int = 0) -> tuple[Schedule, Driver]:
    """The schedule of the run's `Driver` over the run's `Engine` for `examples` (`scripted_agent.examples`, their
    scripts in `book`), and the driver (its conversations: where each stands at the end); with a partial step's
    `plan` (its examples), cut once its groups are complete, its turns of policy `version`."""
    if policy not in POLICIES:
        raise ValueError(f"rollout schedule: policy {policy!r} is not modelled (one of {', '.join(POLICIES)})")
    config = dataclasses.replace(config, stop_ids=(STOP_ID,))
    runner = scripted_agent.ScriptedRunner(book, config.page_size)
    engine = Engine(runner, None, config, scripted_agent.ScriptedStopMatcher(), overlap=overlap)
    runner.engine = engine
    searches = scripted_agent.ScriptedSearches(runner, search_latency_calls)
    driver = Driver(engine, scripted_agent.ScriptedSteps(agent, book, runner), examples,
                    scripted_agent.InlineExecutor(), book.group, version, plan, searches=searches)
    asyncio.run(driver.run(policy, jax.random.key(version)))
    schedule = Schedule(tuple(runner.calls), dict(engine.counts.calls), dict(engine.counts.batch_tokens),
                        len(examples), policy, runner.rows_in_flight, searches.waits,
                        engine.counts.sampled_tokens / max(engine.counts.sample_slots, 1))
    return schedule, driver


def _setup(run_config: RunConfig, lengths, sequences: int, started: int
           ) -> tuple[EngineConfig, list[Conversation], str, AgentConfig]:
    """The engine of one host's training rollout of a run of `run_config` starting `started` trajectories (its
    slots: `RunConfig.engine_slots`), the scripted conversations of a batch of `sequences` trajectories at `lengths`,
    the run's policy and its agent loop's limits."""
    rollout = run_config.rollout
    agent = AgentConfig.of(rollout)
    if agent.trees:
        raise ValueError("rollout schedule: tree rollouts (rollout.trees) are not modelled")
    paging = PagingConfig.of(rollout)
    sampling = SamplingConfig.of(rollout, (STOP_ID,))
    slots = run_config.engine_slots(started)
    engine = engine_config(agent, sampling, slots, paging.page_size, paging.max_step_tokens, paging.num_pages)
    policy = "continuous" if agent.continuous_batching else "barrier"
    convs = scripts(sequences, run_config.data.samples_per_prompt, lengths, agent.max_turns + 1, agent.max_turn_tokens,
                    agent.max_prompt_tokens, agent.max_observation_tokens, agent.max_context_tokens)
    return engine, convs, policy, agent


def for_run(run_config: RunConfig, lengths, sequences: int) -> Schedule:
    """The schedule of one host's training rollout of `sequences` trajectories of a run of `run_config` at `lengths`
    (`llds_jax.aot.step_lengths.Lengths`: means and spreads), its engine shaped as the run shapes it
    (`run_builder.build`)."""
    engine, convs, policy, agent = _setup(run_config, lengths, sequences, sequences)
    return run(engine, convs, policy, agent)


# ----- partial rollouts (issue 59): over-sample, cut at the batch, carry the tail -------------------------------------

PARTIAL_STEPS = 6  # steps of a simulated partial run
PARTIAL_WARMUP = 2  # its first steps, left out of its steady state: the first carries nothing in and more out


@dataclasses.dataclass(frozen=True)
class PartialStep:
    """One step of a partial run (`partial_run`).

    Attributes:
      schedule: its rollout's calls, up to the cut (`Schedule.sequences`: the trajectories it trains, P x group).
      started: groups it ran (carried first, then fresh): ceil(over_sampling x P).
      trained: groups it trains: P.
      resumed, reprefill_tokens, carried, carried_groups, dropped: the run's partial metrics of the step
        (`rollout.partial`: `partial/resumed`, carried conversations it resumed; `partial/reprefill_tokens`, their
        contexts' tokens encoded again; `partial/carried`, started conversations of the groups it carries on;
        `partial/carried_groups`, those groups, complete ones past the P trained too; `partial/dropped`, started
        conversations of carried groups dropped at its start, older than max_staleness).
    """

    schedule: Schedule
    started: int
    trained: int
    resumed: int
    reprefill_tokens: int
    carried: int
    carried_groups: int
    dropped: int


def partial_run(config: EngineConfig, batch: Sequence[Conversation], group: int, policy: str, over_sampling: float,
                max_staleness: int = RolloutConfig.max_staleness, steps: int = PARTIAL_STEPS,
                search_latency_calls: int = 1, overlap: bool = True, agent: AgentConfig | None = None
                ) -> list[PartialStep]:
    """`steps` steps of partial rollouts (issue 59) as the run takes them (`rollout.partial`: `plan_step`, the
    driver's cut, `settle`), each training P = len(batch) / group groups, on an engine of `config` under `policy`.

    The prompts: a stream of batches, each scripted as `batch` (the synchronous step's conversations, `scripts`:
    the same lengths every batch, its groups in its order), each group its own prompt. Step k (from 0, its PRNG
    key k): the carried groups first (one whose oldest complete turn is more than `max_staleness` steps old
    dropped), fresh ones up to ceil(over_sampling x P) groups; the carried conversations resume at their last
    complete turn (their contexts encoded again), the rollout is cut once P groups are complete, and the groups
    not trained are carried. With `over_sampling` 1 nothing is left at the cut: each step is `run(config, batch,
    policy)`, call for call. `search_latency_calls`, `overlap`, `agent`: as `run`'s.

    Which groups complete first follows the spreads: a group completes with its slowest sample, so at the cut
    the groups of short samples (few turns, short turns) are trained and those of long ones carried, to be
    trained the next step (or dropped, past `max_staleness`).
    """
    if over_sampling < 1:
        raise ValueError(f"partial rollouts: over_sampling {over_sampling} is below 1")
    prompts = len(batch) // group
    book = scripted_agent.ScriptBook(batch, group)
    agent = agent or agent_for(config, batch)
    partial = PartialConfig(True, over_sampling, max_staleness)
    drawn = itertools.count()

    def draw() -> list[QAExample]:  # the next batch: its groups' first samples
        return scripted_agent.examples([next(drawn) for _ in range(prompts)], range(prompts), 1)

    carry, out = Carry(), []
    for step in range(steps):
        with _quiet(partial_lib.log):  # a what-if: its dropped groups are counted, not logged
            plan = plan_step(carry, draw, partial, prompts, group, step)
        schedule, driver = _drive(config, book, plan.examples, policy, agent, search_latency_calls, overlap, plan,
                                  step)
        _, carry, metrics = settle(plan, driver.convs, scripted_agent.ScriptedTokenizer(), 0, max_staleness)
        out.append(PartialStep(dataclasses.replace(schedule, sequences=prompts * group), len(plan.groups), prompts,
                               *(int(metrics[f"partial/{k}"]) for k in ("resumed", "reprefill_tokens", "carried",
                                                                        "carried_groups", "dropped"))))
    return out


@contextlib.contextmanager
def _quiet(log: logging.Logger):
    """`log` says nothing below an error meanwhile."""
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def partial_for_run(run_config: RunConfig, lengths, sequences: int, over_sampling: float,
                    max_staleness: int = RolloutConfig.max_staleness,
                    steps: int = PARTIAL_STEPS) -> list[PartialStep]:
    """`partial_run` for one host of a run of `run_config` training `sequences` trajectories per step at `lengths`
    (`for_run`'s engine and conversations; the engine's slots `rollout.max_batch_size`, else every trajectory
    started: ceil(over_sampling x P) groups)."""
    group = run_config.data.samples_per_prompt
    started = math.ceil(over_sampling * (sequences // group)) * group
    engine, convs, policy, agent = _setup(run_config, lengths, sequences, started)
    return partial_run(engine, convs, group, policy, over_sampling, max_staleness, steps, agent=agent)
