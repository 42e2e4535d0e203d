"""Continuous batching of the agent loop (`AgentConfig.continuous_batching`).

The session path (`turn_loop.TurnLoop`) runs a batch turn-synchronously: rows that ended their turn or their
trajectory idle until the batch's longest turn ends, and the next batch waits for the longest trajectory. Here one
device batch (`row_session.RowSession`) of R rows (`max_batch_size`, or all sequences when 0) serves every sequence of
the rollout from a queue, and after every decode chunk the host:

  1. cuts and parses the turns that ended in the chunk (`steps.AgentSteps.close_turn`) and starts their searches, one
     batched call per chunk, on the event loop while decoding goes on (as the session path does);
  2. takes the observations that are ready (searches back, invalid-action messages) and the queued sequences that
     fit the free rows, and appends them in one extend over just those rows (roll back + observation, or an
     empty row + prompt); the other rows' cache, logits and decode state are untouched;
  3. starts the next turn of those sequences, frees the rows of finished trajectories (they take queued
     sequences at the next step) and, once the queue is empty, compacts the live rows to a smaller row bucket (a
     power of two or 1.5x one, `ShapePlan.compacted_rows`: the live rows fill more than 2/3 of it);
  4. decodes the next chunk; rows waiting for a search or without a sequence are done in it. When fewer rows are
     on their turn than wait for a search (none, or a chunk at low occupancy while searches are about to come
     back: a decode step costs about the same at any number of rows), it waits for the first search call to come
     back instead (search_s) and goes back to 1.

Sequence i samples its n-th token with fold_in(key_i, n), key_i the key the session path gives it
(`agent._session_stream` and `Sampler.start`): for the same sampled tokens the trajectories, log-probs and rewards
are those of the session path. The logits differ at float rounding only (the prompt is encoded by an extend into a
row rather than by the batch's prefill, and padding differs), so greedy decoding gives the same tokens but for a
near-tie.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import time
from collections.abc import Sequence
from typing import Optional

import jax

from llds_jax.data.qa import QAExample
from llds_jax.rollout.steps import AgentSteps, add_decode_counts
from llds_jax.rollout.interfaces import SampledTurn
from llds_jax.rollout.trajectory import END_CONTEXT_FULL, Trajectory, Turn


async def run(sampler, params, steps: AgentSteps, examples: Sequence[QAExample], keys_n: jax.Array, rows: int,
              decode_thread: concurrent.futures.Executor) -> list[Trajectory]:
    """The trajectories of `examples` (in order), sequence i sampling from keys_n[i], at most `rows` at a time.

    sampler: a `sampler.Sampler` (`start_rows`); the engine runs on `decode_thread`, its searches on the running
    event loop. Seconds and token counts go to steps.timing.
    """
    engine = _Engine(sampler, params, steps, examples, keys_n, rows, asyncio.get_running_loop())
    try:
        await asyncio.get_running_loop().run_in_executor(decode_thread, engine.run)
    except BaseException:
        for _, future in engine.in_flight:
            future.cancel()
        raise
    if steps.stopping():  # unfinished conversations: the rollout is abandoned
        return []
    return steps.trajectories(examples, engine.convs)


class _Engine:
    """The host side of one continuous-batching rollout (its `run` on the decode thread)."""

    def __init__(self, sampler, params, steps: AgentSteps, examples: Sequence[QAExample], keys_n: jax.Array, rows: int,
                 loop: asyncio.AbstractEventLoop):
        self.steps, self.timing, self.loop = steps, steps.timing, loop
        self.convs = [steps.conversation(ex) for ex in examples]
        self.session = sampler.start_rows(params, [c.prompt_ids for c in self.convs], keys_n, rows,
                                          steps.config.max_turn_tokens)
        self.queue = collections.deque(range(len(self.convs)))  # sequences waiting for a row
        self.in_flight: list[tuple[list[int], concurrent.futures.Future]] = []  # (sequences, their batched search)
        self.searching: dict[int, Turn] = {}  # closed turns waiting for their search
        # Closed turns whose observation is known: sequence -> (turn, observation or None, search error or None).
        self.ready: dict[int, tuple[Turn, Optional[str], Optional[str]]] = {}
        self.truncations = 0

    def run(self) -> None:
        session = self.session
        while not self.steps.stopping():
            self._collect_searches(block=False)
            self._extend()
            if self.queue and session.free_rows:
                continue  # rows freed by sequences that could not take a turn
            if not self.queue:
                session.compact()
            if not session.decoding or len(self.searching) > session.decoding:
                if not self.in_flight:
                    break
                self._collect_searches(block=True)
                continue
            self._close_turns(session.decode_chunk(self.steps.turn_finished))
        for key in ("prefill_s", "decode_s"):
            self.timing[key] += session.timing[key]
        add_decode_counts(self.timing, session)
        self.steps.warn_truncations(self.truncations)

    def _extend(self) -> None:
        """Appends the ready observations and admits queued sequences into the free rows (one device call), then
        starts their turns."""
        observations: dict[int, tuple[int, list[int]]] = {}
        for seq, (turn, observation, error) in sorted(self.ready.items()):
            ids, truncated = self.steps.append_turn(self.convs[seq], turn, observation, error)
            self.truncations += truncated
            if ids is None:
                self.session.finish(seq)
            else:
                observations[seq] = (len(turn.token_ids), ids)
        self.ready.clear()
        admit = [self.queue.popleft() for _ in range(min(self.session.free_rows, len(self.queue)))]
        if observations or admit:
            self.session.extend(observations, admit)
        for seq in [*observations, *admit]:
            budget = self.steps.budget(self.convs[seq])
            if budget:
                self.session.begin_turn(seq, budget)
            else:
                self.convs[seq].end_reason = END_CONTEXT_FULL
                self.session.finish(seq)

    def _close_turns(self, ended: list[tuple[int, SampledTurn]]) -> None:
        """Cuts and parses the turns that ended in a chunk; their searches go out in one batched call."""
        searching = []
        for seq, sample in ended:
            self.timing["sampled_tokens"] += len(sample.token_ids)
            conv = self.convs[seq]
            turn, searches, observation = self.steps.close_turn(conv, sample,
                                                                final=len(conv.turns) == self.steps.config.max_turns)
            if searches:
                self.searching[seq] = turn
                searching.append(seq)
            else:
                self.ready[seq] = (turn, observation, None)
        if searching:
            queries = [self.searching[seq].action.content for seq in searching]
            self.in_flight.append((searching, asyncio.run_coroutine_threadsafe(self.steps.search(queries),
                                                                                self.loop)))

    def _collect_searches(self, block: bool) -> None:
        """Moves the searches that are back to `ready`; with `block`, first waits for one (counted in search_s)."""
        if block:
            start = time.perf_counter()
            concurrent.futures.wait([f for _, f in self.in_flight], return_when=concurrent.futures.FIRST_COMPLETED)
            self.timing["search_s"] += time.perf_counter() - start
        pending = []
        for seqs, future in self.in_flight:
            if not future.done():
                pending.append((seqs, future))
                continue
            for seq, (observation, error) in zip(seqs, future.result()):
                self.ready[seq] = (self.searching.pop(seq), observation, error)
        self.in_flight = pending
