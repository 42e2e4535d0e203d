"""Test doubles for the rollout: an engine of scripted turns, and fake retrievers."""
from __future__ import annotations

import asyncio
import dataclasses
import types
from typing import Optional, Sequence, Union

import pytest

from llds_jax.rollout.interfaces import SampledTurn
from llds_jax.rollout.stats import EngineCounts
from llds_jax.search.types import Document, Retriever, SearchResult

ScriptTurn = Union[str, list]  # turn text, or token ids (e.g. to end with an EOS id)


class ScriptedSampler:
    """An engine source (`interfaces.EngineSource`) whose engines emit fixed turns through the real agent loop.

    scripts[i] lists the turns of sequence i (text or token ids). Like the real engine, a turn's tokens come out
    `chunk` per step and the rollout's stop matcher (`StopMatcher`, fed each step's new tokens) is asked after each,
    so tokens after the cut point come back too; a stop id ends the turn (returned with it), as does its budget.
    Records, over every engine it opened: `budgets[seq]` (each turn's budget), `extends[seq]` ((keep, observation
    ids) of each extend) and `events` (("add" or "finish", seq) in the order the driver called them).
    The log-prob of token k of turn t of sequence s is -0.001 (k + 1) - s - 0.1 t.
    """

    token_budgets = ()

    def __init__(self, tokenizer, scripts: Sequence[Sequence[ScriptTurn]], chunk: int = 4,
                 stop_ids: Sequence[int] = ()):
        self.tokenizer, self.scripts, self.chunk, self.stop_ids = tokenizer, scripts, chunk, tuple(stop_ids)
        self.budgets: dict[int, list[int]] = {}
        self.extends: dict[int, list[tuple[int, list[int]]]] = {}
        self.events: list[tuple[str, int]] = []

    def engine(self, params, stop_matcher=None):
        del params
        return ScriptedTurnEngine(self, stop_matcher)


@dataclasses.dataclass
class _Turn:
    tokens: list          # the turn's scripted tokens, cut at its budget or its stop id
    emitted: int = 0
    ended: bool = False


class ScriptedTurnEngine:
    """One rollout's engine of a `ScriptedSampler` (`interfaces.Engine`)."""

    def __init__(self, sampler: ScriptedSampler, stop_matcher):
        self.sampler, self.stop_matcher = sampler, stop_matcher
        self.counts = EngineCounts()
        self.turns: dict[int, _Turn] = {}
        self.turn_index: dict[int, int] = {}

    @property
    def running(self) -> int:
        return sum(not t.ended for t in self.turns.values())

    def can_admit(self, context_tokens: int) -> bool:
        return True

    def _script(self, seq: int) -> list:
        turn = self.sampler.scripts[seq][self.turn_index[seq]]
        return list(turn) if isinstance(turn, list) else self.sampler.tokenizer.encode(turn, add_special_tokens=False)

    def _begin(self, seq: int, budget: int) -> None:
        self.sampler.budgets.setdefault(seq, []).append(budget)
        script = self._script(seq)
        stop = next((k for k, t in enumerate(script) if t in self.sampler.stop_ids), None)
        self.turns[seq] = _Turn(script[:budget if stop is None else min(budget, stop + 1)])
        if self.stop_matcher is not None:
            self.stop_matcher.reset(seq)

    def add_request(self, seq, prompt_ids, key_data, budget):
        self.sampler.events.append(("add", seq))
        self.turn_index[seq] = 0
        self._begin(seq, budget)

    def extend(self, seq, keep, observation_ids, budget):
        turn = self.turns[seq]
        assert turn.ended and 0 <= keep <= turn.emitted
        self.sampler.extends.setdefault(seq, []).append((keep, list(observation_ids)))
        self.turn_index[seq] += 1
        self._begin(seq, budget)

    def fork(self, seq, source, at_turn, key_data, budget):
        raise NotImplementedError("scripted turns do not fork")

    def finish(self, seq):
        self.sampler.events.append(("finish", seq))
        del self.turns[seq]

    def update_params(self, params):
        pass

    def step(self):
        ended, pushed = [], []
        for seq, turn in sorted(self.turns.items()):
            if not turn.ended:
                new = turn.tokens[turn.emitted:turn.emitted + self.sampler.chunk]
                turn.emitted += len(new)
                pushed.append((seq, new))
        text_stops = ([False] * len(pushed) if self.stop_matcher is None else
                      self.stop_matcher.push_many([seq for seq, _ in pushed], [new for _, new in pushed]))
        for (seq, _), text_stop in zip(pushed, text_stops):
            turn = self.turns[seq]
            if text_stop or turn.emitted == len(turn.tokens):
                turn.ended = True
                tokens, t = turn.tokens[:turn.emitted], self.turn_index[seq]
                logps = [-0.001 * (k + 1) - seq - 0.1 * t for k in range(len(tokens))]
                ended.append((seq, SampledTurn(tokens, logps, bool(tokens) and tokens[-1] in self.sampler.stop_ids)))
        return ended


class FakeRetriever(Retriever):
    """Async retriever over a dict query -> list of contents; queries in `errors` fail with that message."""

    backend = "fake"

    def __init__(self, corpus: dict, errors: Optional[dict] = None, delay_s: float = 0.0,
                 raises: Optional[Exception] = None):
        self.corpus, self.errors, self.delay_s, self.raises = corpus, errors or {}, delay_s, raises
        self.calls: list = []

    async def search(self, queries, k):
        self.calls.append((list(queries), k))
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.raises is not None:
            raise self.raises
        results = []
        for q in queries:
            if q in self.errors:
                results.append(SearchResult([], self.errors[q]))
            else:
                contents = self.corpus.get(q, [])[:k]
                results.append(SearchResult([Document(str(j), c, 0.0) for j, c in enumerate(contents)]))
        return results

    async def check(self):
        pass

    async def close(self):
        pass


@pytest.fixture
def doubles():
    """The test doubles of this file (conftest modules are not importable by name)."""
    return types.SimpleNamespace(ScriptedSampler=ScriptedSampler, FakeRetriever=FakeRetriever)
