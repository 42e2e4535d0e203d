"""The paged engine's step calls at expected lengths, for the step estimate (`llds_jax.step_estimate`): the real
engine (`llds_jax.rollout.engine.Engine`: its scheduler, token buckets, page table and GRPO prompt sharing) driven
by conversations of the expected lengths under a scheduling policy, with a runner that samples scripted turns
instead of running a model. Every call it makes is recorded with what the roofline needs: its token bucket, its
real tokens, the pages its sequences read and its decode iterations.

The conversations (`scripts`): one host's `sequences` trajectories in GRPO groups of `group` samples that share a
prompt of `prompt_tokens` tokens; trajectory i takes `turns` turns on average (each trajectory a whole number, the
mean kept), every turn but its last followed by an observation of `observation_tokens` tokens, and its turns sample
`sampled_tokens / turns` tokens on average, spread evenly over (1 +- spread) times the mean (less where
`rollout.max_turn_tokens` would cut the spread's top, so that the mean is kept): a barrier's turn waits for its
longest row, and a call samples up to its longest sequence's samples, so the spread matters. It is 0.5 by default
and, given a run's logged decode occupancy, the spread at which the schedule samples at that occupancy
(`for_run`). A turn ends on a stop id at its length (the engine samples in calls of `decode_chunk`, so a turn ended by a
stop string mid-call costs the same calls).

The policies, as `llds_jax.rollout.driver` runs them:
  barrier     sessions of the engine's sequence slots: every conversation of a session samples its turn, then
              every observation is appended, until all have ended.
  continuous  a conversation enters when the engine can admit it (a slot and its worst-case pages); an
              observation is appended `search_latency_calls` calls after its turn ended (1: the retriever answers
              while the next call runs, as a local index does; the search's own seconds are costed apart).
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
from llds_jax.rollout.engine import Engine, EngineConfig, StepBatch, StepResult
from llds_jax.rollout.paged_sampler import engine_config

STOP_ID, TOKEN_ID = 0, 1  # the scripted turns' tokens: TOKEN_ID, then STOP_ID as a turn's last
POLICIES = ("barrier", "continuous")
OCCUPANCY_STEPS = 5  # bisections of the turns' spread that match a logged decode occupancy (to 1/64)


@dataclasses.dataclass(frozen=True)
class Conversation:
    """One scripted trajectory: its prompt (shared by its group) and per turn the tokens it samples."""

    prompt: tuple[int, ...]
    turn_tokens: tuple[int, ...]
    observation_tokens: int


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


def _spread(n: int, mean: float) -> list[int]:
    """n whole numbers whose sum is round(n x mean), as even as possible (floor or ceil of the mean each)."""
    total = round(n * mean)
    return [(total * (i + 1)) // n - (total * i) // n for i in range(n)]


def scripts(sequences: int, group: int, prompt_tokens: float, turns: float, sampled_tokens: float,
            observation_tokens: float, max_turn_tokens: int, spread: float = 0.5) -> list[Conversation]:
    """The scripted conversations of one host's rollout (module docstring); lengths in tokens per trajectory
    (`observation_tokens` per observation); a turn's tokens spread over (1 +- `spread`) x their mean."""
    per_turn = sampled_tokens / max(turns, 1.0)
    spread = max(0.0, min(spread, max_turn_tokens / per_turn - 1))  # the cap keeps the mean
    prompt = max(1, round(prompt_tokens))
    turn_counts = _spread(sequences, max(turns, 1.0))
    golden = (math.sqrt(5) - 1) / 2
    convs, j = [], 0
    for i, k in enumerate(turn_counts):
        lengths = []
        for _ in range(max(k, 1)):
            u = (j * golden) % 1.0  # an even spread over [0, 1), whatever the number of turns
            lengths.append(int(min(max_turn_tokens, max(1, round(per_turn * (1 - spread + 2 * spread * u))))))
            j += 1
        ids = tuple([2 + i // group] * prompt)  # a group's samples share their prompt
        convs.append(Conversation(ids, tuple(lengths), max(1, round(observation_tokens))))
    return convs


class ScriptedRunner:
    """The engine's device side for the schedule: each sequence (its key data is (sequence, 0)) samples its
    script's turns, a turn ending on STOP_ID; records each call (`Call`)."""

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
            turns = self.convs[int(batch.key_data_s[row, 0])].turn_tokens
            done, left = int(batch.count_s[row]), 0
            for length in turns:  # the turn this sample belongs to, and its tokens left
                if done < length:
                    left = length - done
                    break
                done -= length
            n = min(int(batch.samples_s[row]), max(left, 1))
            n_s[row] = n
            if n == left:
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
    `policy` (module docstring)."""
    if policy not in POLICIES:
        raise ValueError(f"rollout schedule: policy {policy!r} is not modelled (one of {', '.join(POLICIES)})")
    config = dataclasses.replace(config, stop_ids=(STOP_ID,))
    runner = ScriptedRunner(convs, config.page_size)
    engine = Engine(runner, None, config)
    turn = [0] * len(convs)
    waits, in_flight = 0, 0

    def admit(seq: int) -> None:
        conv = convs[seq]
        engine.add_request(seq, conv.prompt, np.array([seq, 0], np.uint32), _budget(config, conv, 0,
                                                                                    len(conv.prompt)))

    def close(seq: int) -> bool:
        """Ends the turn just sampled: True when the conversation goes on (an observation follows)."""
        turn[seq] += 1
        return turn[seq] < len(convs[seq].turn_tokens)

    def extend(seq: int) -> None:
        conv = convs[seq]
        context = len(engine.context(seq))
        kept = conv.turn_tokens[turn[seq] - 1]
        budget = _budget(config, conv, turn[seq], context + conv.observation_tokens)
        if budget < 1:
            engine.finish(seq)
            return
        engine.extend(seq, kept, [TOKEN_ID] * conv.observation_tokens, budget)

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
                waits += 1
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
                    waiting.append((seq, calls + 1 + search_latency_calls if close(seq) else calls + 1))
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


def for_run(cfg, lengths, sequences: int, spread: float = 0.5) -> Schedule:
    """The schedule of one host's training rollout of `sequences` trajectories of a run of `cfg` at `lengths`
    (`llds_jax.step_lengths.Lengths`), its engine shaped as the run shapes it (`run_builder.build`). The turns'
    spread: `spread`, or with a logged decode occupancy the spread whose schedule samples at that occupancy
    (`OCCUPANCY_STEPS` bisections over [0, 1]: the wider the spread, the longer rows wait for a call's longest)."""
    agent = config_lib.agent_config(cfg)
    if agent.trees:
        raise ValueError("rollout schedule: tree rollouts (rollout.trees) are not modelled")
    paging = config_lib.paging_config(cfg)
    sampling = config_lib.sampling_config(cfg, (STOP_ID,))
    slots = min(sequences, agent.max_batch_size or sequences)
    engine = engine_config(agent, sampling, slots, paging.page_size, paging.max_step_tokens, paging.num_pages)
    policy = "continuous" if agent.continuous_batching else "barrier"

    def at(width: float) -> Schedule:
        return run(engine, scripts(sequences, cfg.data.samples_per_prompt, lengths.prompt_tokens, lengths.turns,
                                   lengths.sampled_tokens, lengths.observation_tokens, agent.max_turn_tokens, width),
                   policy)

    if lengths.decode_occupancy is None:
        return at(spread)
    low, high = 0.0, 1.0
    for _ in range(OCCUPANCY_STEPS):
        middle = (low + high) / 2
        low, high = (middle, high) if at(middle).occupancy > lengths.decode_occupancy else (low, middle)
    return at((low + high) / 2)
