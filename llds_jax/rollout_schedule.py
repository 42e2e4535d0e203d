"""The paged engine's step calls at expected lengths, for the step estimate (`llds_jax.step_estimate`): the real
engine (`llds_jax.rollout.engine.Engine`: its scheduler, token buckets, page table and GRPO prompt sharing) driven
by conversations of the expected lengths under a scheduling policy, with a runner that samples scripted turns
instead of running a model. Every call it makes is recorded with what the roofline needs: its token bucket, its
real tokens, the pages its sequences read and its decode iterations.

The conversations (`scripts`): one host's `sequences` trajectories in GRPO groups of `group` samples that share a
prompt; each length at its logged mean and spread (`llds_jax.step_lengths.Lengths`: a standard deviation), its whole
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

The policies, as `llds_jax.rollout.driver` runs them:
  barrier     sessions of the engine's sequence slots: every conversation of a session samples its turn, then
              every observation is appended, until all have ended.
  continuous  a conversation enters when the engine can admit it (a slot and its worst-case pages); a search's
              observation is appended `search_latency_calls` calls after its turn ended (1: the retriever answers
              while the next call runs, as a local index does; the search's own seconds are costed apart), an
              invalid action's before the next call.
Tree rollouts are not modelled.

Units: tokens, pages, calls (device calls of the step program).
"""
from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Sequence

import numpy as np

from llds_jax import config as config_lib
from llds_jax.config.sections import RolloutConfig
from llds_jax.rollout.config import AgentConfig, PagingConfig, SamplingConfig
from llds_jax.rollout.engine import Engine, EngineConfig, StepBatch, StepResult
from llds_jax.rollout.paged_sampler import engine_config

STOP_ID, TOKEN_ID = 0, 1  # the scripted turns' tokens: TOKEN_ID, then STOP_ID as a turn's last
POLICIES = ("barrier", "continuous")
GOLDEN = (math.sqrt(5) - 1) / 2  # the golden ratio's fraction: a low-discrepancy sequence of its multiples
WIDTH_STEPS = 12  # bisections of a spread's width that keep its standard deviation in whole numbers


@dataclasses.dataclass(frozen=True)
class Conversation:
    """One scripted trajectory: its prompt (shared by its group), per turn the tokens it samples and whether it ends
    on a stop id (dropped from the context; else it ends at its budget and keeps every token), and the tokens of the
    observation after each turn but its last and whether that observation answers a search (else it is the
    invalid-action message, appended as soon as the turn ends)."""

    prompt: tuple[int, ...]
    turn_tokens: tuple[int, ...]
    observation_tokens: tuple[int, ...]
    stops: tuple[bool, ...]
    searches: tuple[bool, ...]


@dataclasses.dataclass(frozen=True)
class Call:
    """One device call of the step program.

    Attributes:
      bucket: its token bucket (the compiled program's T).
      tokens: real tokens of its ragged batch.
      pages_read: pages its ragged forward reads (each sequence's pages up to its length).
      iterations: decode iterations after the ragged forward (its most samples of a sequence, minus 1).
      iteration_pages_read: pages all its decode iterations read together (each active sequence's pages).
    """

    bucket: int
    tokens: int
    pages_read: int
    iterations: int
    iteration_pages_read: int


@dataclasses.dataclass(frozen=True)
class Schedule:
    """What a rollout runs: its calls in order, the engine's own counts per bucket, its policy, the most sequences
    it held at once, (barrier) the turn rounds that ended with searches (each waits for its last search call),
    and the share of its calls' sample slots that sampled (the engine's decode occupancy)."""

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
    """The scripted conversations of one host's rollout at `lengths` (`llds_jax.step_lengths.Lengths`: per
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


class ScriptedRunner:
    """The engine's device side for the schedule: each sequence (its key data is (sequence, 0)) samples its
    script's turns, a turn ending on STOP_ID where its script says so (else at its budget); records each call
    (`Call`)."""

    def __init__(self, convs: Sequence[Conversation], page_size: int):
        self.convs, self.page_size = convs, page_size
        self.calls: list[Call] = []

    def run(self, params, batch: StepBatch) -> StepResult:
        del params
        s, c = len(batch.samples_s), batch.decode_chunk
        tokens_sc = np.full((s, c), TOKEN_ID, np.int32)
        n_s = np.zeros(s, np.int32)
        for row in range(batch.num_seqs):
            if not batch.samples_s[row]:
                continue
            conv = self.convs[int(batch.key_data_s[row, 0])]
            done, left, stops = int(batch.count_s[row]), 0, False
            for length, stops in zip(conv.turn_tokens, conv.stops):  # the turn this sample belongs to, its tokens left
                if done < length:
                    left = length - done
                    break
                done -= length
            n = min(int(batch.samples_s[row]), max(left, 1))
            n_s[row] = n
            if n == left and stops:
                tokens_sc[row, n - 1] = STOP_ID
        pages = -(-batch.kv_lens_s[:batch.num_seqs] // self.page_size)
        iterations = max(int(n_s.max(initial=0)) - 1, 0)
        # Decode iteration i reads the pages of each sequence still sampling, one slot longer each iteration.
        lens = batch.kv_lens_s[:batch.num_seqs]
        iteration_pages = sum(int(np.sum(-(-(lens + i) // self.page_size) * (n_s[:batch.num_seqs] > i)))
                              for i in range(1, iterations + 1))
        self.calls.append(Call(len(batch.tokens_t), int(batch.cu_q_lens_s[batch.num_seqs]), int(pages.sum()),
                               iterations, iteration_pages))
        return StepResult(tokens_sc, np.zeros((s, c), np.float32), n_s)


def run(config: EngineConfig, convs: Sequence[Conversation], policy: str, search_latency_calls: int = 1
        ) -> Schedule:
    """The calls of one rollout of `convs` on an engine of `config` (its stop ids replaced by STOP_ID) under
    `policy` (module docstring). `search_latency_calls`: the calls a search's observation comes after its turn ended
    (continuous)."""
    if policy not in POLICIES:
        raise ValueError(f"rollout schedule: policy {policy!r} is not modelled (one of {', '.join(POLICIES)})")
    config = dataclasses.replace(config, stop_ids=(STOP_ID,))
    runner = ScriptedRunner(convs, config.page_size)
    engine = Engine(runner, None, config)
    turn = [0] * len(convs)
    starts = [len(conv.prompt) for conv in convs]  # each conversation's context at its turn's start
    waits, in_flight = 0, 0

    def admit(seq: int) -> None:
        conv = convs[seq]
        engine.add_request(seq, conv.prompt, np.array([seq, 0], np.uint32), _budget(config, conv, 0,
                                                                                    len(conv.prompt)))

    def close(seq: int) -> bool:
        """Ends the turn just sampled: True when the conversation goes on (an observation follows)."""
        turn[seq] += 1
        return turn[seq] < len(convs[seq].turn_tokens)

    def searched(seq: int) -> bool:
        """Whether the observation after the turn just closed answers a search."""
        return convs[seq].searches[turn[seq] - 1]

    def extend(seq: int) -> None:
        conv, context = convs[seq], engine.context(seq)
        observation = conv.observation_tokens[turn[seq] - 1]
        # The turn's tokens but a closing stop id are kept (the driver's turn cut drops it).
        kept = len(context) - starts[seq] - (context[-1] == STOP_ID)
        budget = _budget(config, conv, turn[seq], starts[seq] + kept + observation)
        if budget < 1:
            engine.finish(seq)
            return
        engine.extend(seq, kept, [TOKEN_ID] * observation, budget)
        starts[seq] = starts[seq] + kept + observation

    if policy == "barrier":
        slots = config.max_seqs
        for first in range(0, len(convs), slots):
            session = range(first, min(first + slots, len(convs)))
            for seq in session:
                admit(seq)
            in_flight = max(in_flight, engine.in_flight)
            while True:
                ended = []
                while engine.running:
                    ended += [seq for seq, _ in engine.step()]
                going = [seq for seq in ended if close(seq)]
                for seq in ended:
                    if seq not in going:
                        engine.finish(seq)
                if not going:
                    break
                waits += any(searched(seq) for seq in going)  # the round waits for its searches, if any
                for seq in going:
                    extend(seq)
    else:
        queue, waiting, calls = deque(range(len(convs))), [], 0
        while True:
            due = [seq for seq, at in waiting if at <= calls]
            waiting = [(seq, at) for seq, at in waiting if at > calls]
            for seq in due:
                extend(seq) if turn[seq] < len(convs[seq].turn_tokens) else engine.finish(seq)
            while queue and engine.can_admit():
                admit(queue.popleft())
            in_flight = max(in_flight, engine.in_flight)
            if engine.running:
                for seq, _ in engine.step():
                    going = close(seq)
                    waiting.append((seq, calls + 1 + (search_latency_calls if going and searched(seq) else 0)))
                calls += 1
            elif waiting:
                calls = min(at for _, at in waiting)
            else:
                break
    return Schedule(tuple(runner.calls), dict(engine.counts.calls), dict(engine.counts.batch_tokens), len(convs),
                    policy, in_flight, waits, engine.counts.sampled_tokens / max(engine.counts.sample_slots, 1))


def _budget(config: EngineConfig, conv: Conversation, turn: int, context: int) -> int:
    """Tokens turn `turn` may sample after `context` tokens: its script's, within the engine's context."""
    return max(0, min(conv.turn_tokens[turn], config.max_context - context))


def for_run(cfg, lengths, sequences: int) -> Schedule:
    """The schedule of one host's training rollout of `sequences` trajectories of a run of `cfg` at `lengths`
    (`llds_jax.step_lengths.Lengths`: means and spreads), its engine shaped as the run shapes it
    (`run_builder.build`)."""
    rollout = config_lib.build(RolloutConfig, cfg.rollout)
    agent = AgentConfig.of(rollout)
    if agent.trees:
        raise ValueError("rollout schedule: tree rollouts (rollout.trees) are not modelled")
    paging = PagingConfig.of(rollout)
    sampling = SamplingConfig.of(rollout, (STOP_ID,))
    slots = min(sequences, agent.max_batch_size or sequences)
    engine = engine_config(agent, sampling, slots, paging.page_size, paging.max_step_tokens, paging.num_pages)
    policy = "continuous" if agent.continuous_batching else "barrier"
    convs = scripts(sequences, cfg.data.samples_per_prompt, lengths, agent.max_turns + 1, agent.max_turn_tokens,
                    agent.max_prompt_tokens, agent.max_observation_tokens, agent.max_context_tokens)
    return run(engine, convs, policy)
