"""The turn loop of a turn-synchronous sampler session (`session.Session`): every unfinished conversation samples
its next turn at once, the turns are cut and parsed and their searches sent while other rows still decode, then the
observations are appended (the protocol of `llds_jax.rollout.agent`, whose chains and tree rollouts,
`llds_jax.rollout.tree`, both run it).

A conversation's turn is its final one (a search is not executed) when it has had `max_turns` turns: in a chain
session every conversation is at the same turn; a tree rollout's forks start at different turns.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Sequence
from typing import Optional

from llds_jax.rollout.interfaces import SampledTurn, SamplerSession
from llds_jax.rollout.steps import AgentSteps, Conversation, add_decode_counts
from llds_jax.rollout.trajectory import END_CONTEXT_FULL, Turn


class TurnLoop:
    """The turns of one sampler session over conversations `convs` (sequence i of the session is convs[i]; those
    already ended take no turn).

    Args:
      steps: the protocol's steps (budgets, cutting, searches) and the rollout's timing.
      convs: the session's conversations, updated in place.
      decode_thread: the worker that runs the session's decoding, so that searches go out on the event loop.
    """

    def __init__(self, steps: AgentSteps, convs: Sequence[Conversation], decode_thread: concurrent.futures.Executor):
        self.steps, self.convs, self.decode_thread = steps, list(convs), decode_thread
        self.config, self.timing = steps.config, steps.timing

    async def run(self, session: SamplerSession) -> None:
        """Runs turns until every conversation has ended (or a stop is requested); adds the session's device
        seconds and decode counts to the rollout's timing."""
        while not all(c.end_reason is not None for c in self.convs) and not self.steps.stopping():
            await self._turn(session)
        for key in ("prefill_s", "decode_s"):
            self.timing[key] += session.timing[key]
        add_decode_counts(self.timing, session)

    def _final(self, i: int) -> bool:
        return len(self.convs[i].turns) >= self.config.max_turns

    def _close_turn(self, i: int, sample: SampledTurn, turns: dict[int, Turn], keep: list[int],
                    observations: list[Optional[str]]) -> bool:
        """Cuts and parses sequence i's sampled turn; returns whether it searches. Runs on the decode thread for
        sequences the session reports early (they are not touched elsewhere until decoding is over)."""
        turns[i], searches, observations[i] = self.steps.close_turn(self.convs[i], sample, self._final(i))
        keep[i] = len(turns[i].token_ids)
        return searches

    async def _turn(self, session: SamplerSession) -> None:
        n = len(self.convs)
        active = [c.end_reason is None for c in self.convs]
        budgets = [self.steps.budget(c) if active[i] else 0 for i, c in enumerate(self.convs)]
        keep = [0] * n
        observations: list[Optional[str]] = [None] * n
        turns: dict[int, Turn] = {}
        in_flight: list[tuple[list[int], concurrent.futures.Future]] = []  # (sequences, their batched search)
        loop = asyncio.get_running_loop()

        def on_finished(seqs: list[int], samples: list[SampledTurn]) -> None:  # on the decode thread, between chunks
            searching = [i for i, sample in zip(seqs, samples)
                         if self._close_turn(i, sample, turns, keep, observations)]
            if searching:
                queries = [turns[i].action.content for i in searching]
                in_flight.append((searching, asyncio.run_coroutine_threadsafe(self.steps.search(queries), loop)))

        try:
            samples = await loop.run_in_executor(self.decode_thread, session.decode_turn, budgets,
                                                 self.steps.turn_finished, on_finished)
        except BaseException:
            for _, future in in_flight:
                future.cancel()
            raise
        self.timing["sampled_tokens"] += sum(len(s.token_ids) for s in samples)
        late: list[int] = []  # searching sequences the session did not report early
        for i, (conv, sample) in enumerate(zip(self.convs, samples)):
            if not active[i] or i in turns:
                continue
            if budgets[i] == 0:
                conv.end_reason = END_CONTEXT_FULL
            elif self._close_turn(i, sample, turns, keep, observations):
                late.append(i)
        wait_start = time.perf_counter()
        outcomes: dict[int, tuple[str, Optional[str]]] = {}
        for seqs, future in in_flight:
            outcomes.update(zip(seqs, await asyncio.wrap_future(future)))
        if late:
            outcomes.update(zip(late, await self.steps.search([turns[i].action.content for i in late])))
        self.timing["search_s"] += time.perf_counter() - wait_start
        errors = {}
        for i, (observation, error) in outcomes.items():
            observations[i] = observation
            if error is not None:
                errors[i] = error
        obs_ids: list[Optional[list[int]]] = [None] * n
        truncations = 0
        for i in sorted(turns):
            obs_ids[i], truncated = self.steps.append_turn(self.convs[i], turns[i], observations[i], errors.get(i))
            truncations += truncated
        self.steps.warn_truncations(truncations)
        session.end_turn(keep, obs_ids)
