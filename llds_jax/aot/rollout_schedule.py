"""The paged engine's step calls at expected lengths, for the step estimate (`llds_jax.aot.step_estimate`): the real
engine (`llds_jax.rollout.engine.Engine`: its scheduler, token buckets, page table and GRPO prompt sharing) driven
by conversations of the expected lengths under a scheduling policy, with a runner that samples scripted turns
instead of running a model. Every call it makes is recorded with what the roofline needs: its token bucket, its
real tokens, the pages its sequences read and its decode iterations, and per sequence its new tokens, its length
and its samples (what the kernel-faithful estimate costs the attention kernel's calls from).

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

The policies, as `llds_jax.rollout.driver` runs them:
  barrier     sessions of the engine's sequence slots: every conversation of a session samples its turn, then
              every observation is appended, until all have ended.
  continuous  a conversation enters when the engine can admit it (a slot and its worst-case pages); a search's
              observation is appended `search_latency_calls` calls after its turn ended (1: the retriever answers
              while the next call runs, as a local index does; the search's own seconds are costed apart), an
              invalid action's before the next call.
The engine overlaps its calls as it does on a device (`run`'s `overlap`; `llds_jax.rollout.engine`): call n + 1 is
dispatched before call n is absorbed, so a turn's end, its observation and a freed slot take effect a call later,
and a turn that ended on a stop id in call n leaves a dropped row in call n + 1 (its budget is the driver's, so the
engine does not know where it ends). Tree rollouts are not modelled.

Partial rollouts (issue 59, `partial_run`): a few steps that each start ceil(over_sampling x P) groups (the carried
ones first), cut the rollout once P groups are complete, and carry the rest to the next step, where the carried
conversations resume at their last complete turn with their contexts encoded again (re-prefilled); the steps
after the first ones are the steady state the estimate reports (`llds_jax.aot.step_estimate.partial_time`).

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
from llds_jax.rollout.engine import Engine
from llds_jax.rollout.paged_sampler import engine_config
from llds_jax.rollout.step_calls import EngineConfig, Immediate, StepBatch, StepResult

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
      tokens: real tokens of its ragged batch (a dropped row's, written, not counted, as the engine counts them).
      pages_read: pages its ragged forward reads (each sequence's pages up to its length).
      iterations: decode iterations after the ragged forward (its most samples of a sequence, minus 1).
      iteration_pages_read: pages all its decode iterations read together (each active sequence's pages).
      q_lens, kv_lens, samples: per sequence of its ragged batch (the first num_seqs of the S rows) its new tokens,
        its length once they are written and the tokens it sampled in the call (decode iteration i runs every
        slot, those with more than i samples sampling at kv_len + i: `llds_jax.aot.step_estimate.FaithfulCost`).
      in_flight: sequences the engine held when the call was made (`Engine.in_flight`: what its host time per
        call follows, `step_estimate.HostTable`).
      searches: turns the call closed whose observation answers a search: the queries of the retriever call it
        sends (the driver's `SearchQueue`: the queries ready after a call go in one call).
    """

    bucket: int
    tokens: int
    pages_read: int
    iterations: int
    iteration_pages_read: int
    q_lens: tuple[int, ...] = ()
    kv_lens: tuple[int, ...] = ()
    samples: tuple[int, ...] = ()
    in_flight: int = 0
    searches: int = 0


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


class ScriptedRunner(Immediate):
    """The engine's device side for the schedule: each sequence (its key data is (sequence, 0)) samples its
    script's turns, a turn ending on STOP_ID where its script says so (else at its budget); records each call
    (`Call`). `offsets`: per sequence the tokens its script sampled before it entered this engine (a resumed
    conversation's complete turns; None: none). Overlapping as `runner.DeviceRunner` overlaps: a row whose batch
    token, taken from the call before, is a stop id samples nothing (the engine drops it)."""

    def __init__(self, convs: Sequence[Conversation], page_size: int, offsets: Sequence[int] | None = None):
        self.convs, self.page_size = convs, page_size
        self.offsets = offsets or [0] * len(convs)
        self.calls: list[Call] = []

    def dispatch(self, params, batch: StepBatch, previous: StepResult | None) -> StepResult:
        resolved = batch.resolved(previous)
        rows = np.flatnonzero(batch.source_s[:batch.num_seqs] >= 0)
        ended = rows[resolved.tokens_t[batch.cu_q_lens_s[rows]] == STOP_ID]
        samples_s = batch.samples_s.copy()
        samples_s[ended] = 0
        result = self.run(params, dataclasses.replace(resolved, samples_s=samples_s))
        # The engine counts a dropped row's token as no real token (`EngineCounts.batch_tokens`); it is written.
        self.calls[-1] = dataclasses.replace(self.calls[-1], tokens=self.calls[-1].tokens - len(ended))
        return result

    def run(self, params, batch: StepBatch) -> StepResult:
        del params
        s, c = len(batch.samples_s), batch.decode_chunk
        tokens_sc = np.full((s, c), TOKEN_ID, np.int32)
        n_s = np.zeros(s, np.int32)
        for row in range(batch.num_seqs):
            if not batch.samples_s[row]:
                continue
            seq = int(batch.key_data_s[row, 0])
            conv = self.convs[seq]
            done, left, stops = int(batch.count_s[row]) + self.offsets[seq], 0, False
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
        q_lens = np.diff(batch.cu_q_lens_s[:batch.num_seqs + 1])
        self.calls.append(Call(len(batch.tokens_t), int(batch.cu_q_lens_s[batch.num_seqs]), int(pages.sum()),
                               iterations, iteration_pages, tuple(q_lens.tolist()), tuple(lens.tolist()),
                               tuple(n_s[:batch.num_seqs].tolist())))
        return StepResult(tokens_sc, np.zeros((s, c), np.float32), n_s)


@dataclasses.dataclass(frozen=True)
class Progress:
    """Where each conversation of a rollout stands when it ends (at its cut, `_drive`).

    Attributes:
      turns: per conversation its complete turns: those whose observation was appended, and its last once it
        ended (a turn in flight at the cut, or ended but waiting for its observation, is not complete).
      ended: per conversation whether it ended (its last turn, or its context full).
    """

    turns: tuple[int, ...]
    ended: tuple[bool, ...]


def run(config: EngineConfig, convs: Sequence[Conversation], policy: str, search_latency_calls: int = 1,
        overlap: bool = True, turn_cap: int | None = None) -> Schedule:
    """The calls of one rollout of `convs` on an engine of `config` (its stop ids replaced by STOP_ID) under
    `policy` (module docstring). `search_latency_calls`: the calls a search's observation comes after its turn ended
    (continuous). `overlap`: the engine dispatches each call before it absorbs the one in flight, as it runs on a
    device (`rollout.engine`); False: one call at a time. `turn_cap`: a turn's budget, `rollout.max_turn_tokens`
    (`_budget`; None: each turn's own tokens, the engine knowing where each turn ends)."""
    return _drive(config, convs, policy, search_latency_calls, overlap=overlap, turn_cap=turn_cap)[0]


def context_tokens(conv: Conversation, turns: int) -> int:
    """Tokens of `conv`'s context after its first `turns` turns (not its last) and their observations: what a
    conversation resumed there re-encodes (each turn's sampled tokens but a closing stop id)."""
    return len(conv.prompt) + sum(n - stop + o for n, stop, o in
                                  zip(conv.turn_tokens[:turns], conv.stops, conv.observation_tokens))


def _drive(config: EngineConfig, convs: Sequence[Conversation], policy: str, search_latency_calls: int = 1,
           group: int = 1, needed: int | None = None, turns: Sequence[int] | None = None,
           ended: Sequence[bool] | None = None, overlap: bool = True, turn_cap: int | None = None
           ) -> tuple[Schedule, Progress]:
    """`run`, and where each conversation stands at the end. A partial step's rollout (`partial_run`): conversation
    i starts after its first `turns[i]` turns (resumed: its context, `context_tokens`, encoded as a new request's
    prompt, its own tokens so that no other sequence shares it; its script goes on at turn `turns[i]`) or, where
    `ended[i]`, has ended before (it never enters the engine); the rollout is cut once `needed` groups of `group`
    consecutive conversations have ended (checked after each turn round of `barrier`, after each call of
    `continuous`, where the driver checks it: `llds_jax.rollout.driver`; None: every conversation runs to its
    end)."""
    if policy not in POLICIES:
        raise ValueError(f"rollout schedule: policy {policy!r} is not modelled (one of {', '.join(POLICIES)})")
    config = dataclasses.replace(config, stop_ids=(STOP_ID,))
    turn = list(turns or [0] * len(convs))  # each conversation's turns closed
    done = list(ended or [False] * len(convs))  # whether each has ended
    complete = list(turn)  # its complete turns (`Progress.turns`)
    runner = ScriptedRunner(convs, config.page_size, [sum(c.turn_tokens[:t]) for c, t in zip(convs, turn)])
    engine = Engine(runner, None, config, overlap=overlap)
    starts = [context_tokens(conv, t) for conv, t in zip(convs, turn)]  # each context at its turn's start
    filler = max((max(conv.prompt) for conv in convs), default=STOP_ID) + 1  # a resumed context's own tokens
    groups_ended = [0] * -(-len(convs) // group)
    for seq, gone in enumerate(done):
        groups_ended[seq // group] += gone
    waits, in_flight = 0, 0

    def admit(seq: int) -> None:
        conv = convs[seq]
        prompt = conv.prompt + (filler + seq,) * (starts[seq] - len(conv.prompt))
        engine.add_request(seq, prompt, np.array([seq, 0], np.uint32), _budget(config, conv, turn[seq], starts[seq], turn_cap))

    def end(seq: int) -> None:
        """The conversation has ended: it leaves the engine."""
        engine.finish(seq)
        done[seq], complete[seq] = True, turn[seq]
        groups_ended[seq // group] += 1

    def cut() -> bool:
        return needed is not None and sum(n == group for n in groups_ended) >= needed

    def close(seq: int) -> bool:
        """Ends the turn just sampled: True when the conversation goes on (an observation follows)."""
        turn[seq] += 1
        return turn[seq] < len(convs[seq].turn_tokens)

    def searched(seq: int) -> bool:
        """Whether the observation after the turn just closed answers a search."""
        return convs[seq].searches[turn[seq] - 1]

    def will_search(seq: int) -> bool:
        """Whether the turn now ending (not yet closed) is followed by a search's observation."""
        conv = convs[seq]
        return turn[seq] + 1 < len(conv.turn_tokens) and conv.searches[turn[seq]]

    def step() -> list[int]:
        """One engine step; its call recorded with the sequences in flight before it and the searches it closed
        (`Call.in_flight`, `Call.searches`). Returns the sequences whose turn ended."""
        in_flight_now, made = engine.in_flight, len(runner.calls)
        ended = [seq for seq, _ in engine.step()]
        if len(runner.calls) > made:
            runner.calls[-1] = dataclasses.replace(runner.calls[-1], in_flight=in_flight_now,
                                                   searches=sum(will_search(seq) for seq in ended))
        return ended

    def extend(seq: int) -> None:
        conv, context = convs[seq], engine.context(seq)
        observation = conv.observation_tokens[turn[seq] - 1]
        # The turn's tokens but a closing stop id are kept (the driver's turn cut drops it).
        kept = len(context) - starts[seq] - (context[-1] == STOP_ID)
        budget = _budget(config, conv, turn[seq], starts[seq] + kept + observation, turn_cap)
        if budget < 1:
            end(seq)
            return
        engine.extend(seq, kept, [TOKEN_ID] * observation, budget)
        starts[seq] = starts[seq] + kept + observation
        complete[seq] = turn[seq]

    if policy == "barrier":
        slots = config.max_seqs
        for first in range(0, len(convs), slots):
            if cut():
                break
            session = [seq for seq in range(first, min(first + slots, len(convs))) if not done[seq]]
            for seq in session:
                admit(seq)
            in_flight = max(in_flight, engine.in_flight)
            while True:
                closed = []
                while engine.running:
                    closed += step()
                going = [seq for seq in closed if close(seq)]
                for seq in closed:
                    if seq not in going:
                        end(seq)
                if not going:
                    break
                waits += any(searched(seq) for seq in going)  # the round waits for its searches, if any
                for seq in going:
                    extend(seq)
                if cut():
                    break
    else:
        queue, waiting, calls = deque(seq for seq in range(len(convs)) if not done[seq]), [], 0
        while True:
            due = [seq for seq, at in waiting if at <= calls]
            waiting = [(seq, at) for seq, at in waiting if at > calls]
            for seq in due:
                extend(seq) if turn[seq] < len(convs[seq].turn_tokens) else end(seq)
            if cut():
                break
            while queue and engine.can_admit(starts[queue[0]]):
                admit(queue.popleft())
            in_flight = max(in_flight, engine.in_flight)
            if engine.running:
                for seq in step():
                    going = close(seq)
                    waiting.append((seq, calls + 1 + (search_latency_calls if going and searched(seq) else 0)))
                calls += 1
            elif waiting:
                calls = min(at for _, at in waiting)
            else:
                break
    schedule = Schedule(tuple(runner.calls), dict(engine.counts.calls), dict(engine.counts.batch_tokens), len(convs),
                        policy, in_flight, waits, engine.counts.sampled_tokens / max(engine.counts.sample_slots, 1))
    return schedule, Progress(tuple(complete), tuple(done))


def _budget(config: EngineConfig, conv: Conversation, turn: int, context: int, turn_cap: int | None) -> int:
    """Tokens turn `turn` may sample after `context` tokens, within the engine's context: the driver's budget,
    `turn_cap` (`rollout.max_turn_tokens`), for a turn that ends on a stop id (the engine learns its end from its
    samples); its script's tokens for a turn at its budget, or where `turn_cap` is None."""
    own = turn_cap if turn_cap and conv.stops[turn] else conv.turn_tokens[turn]
    return max(0, min(own, config.max_context - context))


def _setup(cfg, lengths, sequences: int, started: int) -> tuple[EngineConfig, list[Conversation], str, int]:
    """The engine of one host's training rollout of a run of `cfg` starting `started` trajectories (its slots:
    `rollout.max_batch_size`, else all of them), the scripted conversations of a batch of `sequences` trajectories
    at `lengths`, the run's policy and a turn's budget (`rollout.max_turn_tokens`)."""
    rollout = config_lib.build(RolloutConfig, cfg.rollout)
    agent = AgentConfig.of(rollout)
    if agent.trees:
        raise ValueError("rollout schedule: tree rollouts (rollout.trees) are not modelled")
    paging = PagingConfig.of(rollout)
    sampling = SamplingConfig.of(rollout, (STOP_ID,))
    slots = min(started, agent.max_batch_size or started)
    engine = engine_config(agent, sampling, slots, paging.page_size, paging.max_step_tokens, paging.num_pages)
    policy = "continuous" if agent.continuous_batching else "barrier"
    convs = scripts(sequences, cfg.data.samples_per_prompt, lengths, agent.max_turns + 1, agent.max_turn_tokens,
                    agent.max_prompt_tokens, agent.max_observation_tokens, agent.max_context_tokens)
    return engine, convs, policy, agent.max_turn_tokens


def for_run(cfg, lengths, sequences: int) -> Schedule:
    """The schedule of one host's training rollout of `sequences` trajectories of a run of `cfg` at `lengths`
    (`llds_jax.aot.step_lengths.Lengths`: means and spreads), its engine shaped as the run shapes it
    (`run_builder.build`)."""
    engine, convs, policy, turn_cap = _setup(cfg, lengths, sequences, sequences)
    return run(engine, convs, policy, turn_cap=turn_cap)


# ----- partial rollouts (issue 59): over-sample, cut at the batch, carry the tail -------------------------------------

PARTIAL_STEPS = 6  # steps of a simulated partial run
PARTIAL_WARMUP = 2  # its first steps, left out of its steady state: the first carries nothing in and more out


@dataclasses.dataclass(frozen=True)
class _Group:
    """A GRPO group of a partial run: which group of the batch's scripts its samples follow, per sample its
    complete turns (where it resumes) and whether it ended, and the step of its oldest complete turn (None:
    none yet)."""

    script: int
    turns: tuple[int, ...]
    ended: tuple[bool, ...]
    version: int | None


@dataclasses.dataclass(frozen=True)
class PartialStep:
    """One step of a partial run (`partial_run`).

    Attributes:
      schedule: its rollout's calls, up to the cut (`Schedule.sequences`: the trajectories it trains, P x group).
      started: groups it ran (carried first, then fresh): ceil(over_sampling x P).
      trained: groups it trains: P.
      resumed: carried conversations it resumed with their tokens (at least one complete turn).
      reprefill_tokens: their contexts' tokens (prompt, complete turns and observations), encoded again.
      carried: conversations it hands to the next step with their tokens (unfinished, at least one complete turn).
      carried_groups: groups it hands to the next step (started, not trained: complete ones past the P trained too).
      dropped: carried groups dropped at its start, older than max_staleness.
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
                search_latency_calls: int = 1,
                overlap: bool = True, turn_cap: int | None = None) -> list[PartialStep]:
    """`steps` steps of partial rollouts (issue 59; `rollout.partial` as llds_jax/rollout/partial.py runs it), each
    training P = len(batch) / group groups, on an engine of `config` under `policy`.

    The prompts: a stream of batches, each scripted as `batch` (the synchronous step's conversations, `scripts`:
    the same lengths every batch, its groups in its order). Step k (from 0):
      1. the carried groups come first, in order; one whose oldest complete turn was sampled more than
         `max_staleness` steps before k is dropped (its work lost);
      2. fresh groups from the stream follow, up to ceil(over_sampling x P) groups;
      3. the rollout (`_drive`): the carried conversations resume first, at their last complete turn (a turn in
         flight at the cut, or waiting for its observation, is sampled again: the same tokens, from the same
         PRNG draws), their context re-encoded as a prompt (the KV recomputed under the new weights); those that
         ended never re-enter; it is cut once P groups are complete (every sample ended), checked after each turn
         round of `barrier`, after each call of `continuous`;
      4. the first P complete groups in the step's order are trained; every other group is carried.
    With `over_sampling` 1 nothing is left at the cut: each step is `run(config, batch, policy)`, call for call.
    `overlap`, `turn_cap`: as `run`'s.

    Which groups complete first follows the spreads: a group completes with its slowest sample, so at the cut
    the groups of short samples (few turns, short turns) are trained and those of long ones carried, to be
    trained the next step (or dropped, past `max_staleness`). Without spreads (every sample alike) the groups
    complete in the order they start: the first P started are trained.
    """
    if over_sampling < 1:
        raise ValueError(f"partial rollouts: over_sampling {over_sampling} is below 1")
    prompts = len(batch) // group
    size = math.ceil(over_sampling * prompts)
    carry: list[_Group] = []
    fresh, out = 0, []
    for step in range(steps):
        groups = [g for g in carry if g.version is None or step - g.version <= max_staleness]
        dropped = len(carry) - len(groups)
        while len(groups) < size:
            groups.append(_Group(fresh % prompts, (0,) * group, (False,) * group, None))
            fresh += 1
        convs, turns, ended = [], [], []
        for position, g in enumerate(groups):
            for m in range(group):
                conv = batch[g.script * group + m]
                convs.append(dataclasses.replace(conv, prompt=(2 + position,) * len(conv.prompt)))  # its own prompt
            turns += g.turns
            ended += g.ended
        resumed = [seq for seq, (t, e) in enumerate(zip(turns, ended)) if t and not e]
        schedule, progress = _drive(config, convs, policy, search_latency_calls, group, prompts, turns, ended,
                                    overlap, turn_cap)
        carry, trained = [], 0
        for position, g in enumerate(groups):
            seqs = range(position * group, (position + 1) * group)
            if all(progress.ended[seq] for seq in seqs) and trained < prompts:
                trained += 1
                continue
            now = tuple(progress.turns[seq] for seq in seqs)
            advanced = any(new > old for new, old in zip(now, g.turns))  # a turn of this step's is complete
            carry.append(_Group(g.script, now, tuple(progress.ended[seq] for seq in seqs),
                                step if g.version is None and advanced else g.version))
        carried = sum(t > 0 and not e for g in carry for t, e in zip(g.turns, g.ended))
        out.append(PartialStep(dataclasses.replace(schedule, sequences=prompts * group), len(groups), trained,
                               len(resumed), sum(context_tokens(convs[seq], turns[seq]) for seq in resumed),
                               carried, len(carry), dropped))
    return out


def partial_for_run(cfg, lengths, sequences: int, over_sampling: float,
                    max_staleness: int = RolloutConfig.max_staleness,
                    steps: int = PARTIAL_STEPS) -> list[PartialStep]:
    """`partial_run` for one host of a run of `cfg` training `sequences` trajectories per step at `lengths`
    (`for_run`'s engine and conversations; the engine's slots `rollout.max_batch_size`, else every trajectory
    started: ceil(over_sampling x P) groups)."""
    group = cfg.data.samples_per_prompt
    started = math.ceil(over_sampling * (sequences // group)) * group
    engine, convs, policy, turn_cap = _setup(cfg, lengths, sequences, started)
    return partial_run(engine, convs, group, policy, over_sampling, max_staleness, steps, turn_cap=turn_cap)
