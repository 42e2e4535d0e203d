"""Test doubles for the rollout: a scripted policy with the sampler's session interface, and fake retrievers."""
from __future__ import annotations

import asyncio
import dataclasses
import types
from typing import Optional, Sequence, Union

import pytest

from llds_jax.rollout.interfaces import SampledTurn
from llds_jax.search.types import Document, Retriever, SearchResult

ScriptTurn = Union[str, list]  # turn text, or token ids (e.g. to end with an EOS id)


class ScriptedSampler:
    """Emits fixed turns through the real agent loop.

    scripts[i] lists the turns of sequence i (text or token ids). Like the real sampler, tokens come out in
    chunks of `chunk` and the loop's `turn_finished` is asked between chunks, so tokens after the cut point come
    back too; the session records every end_turn call so tests can check keeps and observations.
    With `report_early`, the session reports finished turns through decode_turn's `on_finished` the way the real
    session does: after each chunk, the sequences whose turn ended in it (else it never calls `on_finished`).
    """

    def __init__(self, tokenizer, scripts: Sequence[Sequence[ScriptTurn]], chunk: int = 4,
                 stop_ids: Sequence[int] = (), report_early: bool = False):
        self.tokenizer, self.scripts, self.chunk, self.stop_ids = tokenizer, scripts, chunk, tuple(stop_ids)
        self.report_early = report_early
        self.sessions: list[ScriptedSession] = []

    def start(self, params, prompts, rng, first_sequence=0):
        del params, rng, first_sequence
        session = ScriptedSession(self, [list(p) for p in prompts])
        self.sessions.append(session)
        return session


@dataclasses.dataclass
class ScriptedSession:
    sampler: ScriptedSampler
    prompts: list
    turn_index: int = 0
    decode_calls: list = dataclasses.field(default_factory=list)   # budgets of each decode_turn
    end_calls: list = dataclasses.field(default_factory=list)      # (keep, observations) of each end_turn
    emitted: list = dataclasses.field(default_factory=list)        # SampledTurns of the last decode_turn
    timing: dict = dataclasses.field(default_factory=lambda: {"prefill_s": 0.0, "decode_s": 0.0})  # no device
    decode_counts: dict = dataclasses.field(default_factory=lambda: {"sampled_tokens": 0, "row_steps": 0})

    def _tokens(self, seq: int) -> list[int]:
        turn = self.sampler.scripts[seq][self.turn_index]
        return list(turn) if isinstance(turn, list) else self.sampler.tokenizer.encode(turn, add_special_tokens=False)

    def decode_turn(self, budgets, turn_finished, on_finished=None):
        self.decode_calls.append(list(budgets))
        out, chunks = [], {}
        for seq, budget in enumerate(budgets):
            if budget == 0:
                out.append(SampledTurn([], [], False))
                continue
            script = self._tokens(seq)
            stop = next((k for k, t in enumerate(script) if t in self.sampler.stop_ids), None)
            script = script[:budget if stop is None else min(budget, stop + 1)]
            n = 0
            while n < len(script):
                n = min(n + self.sampler.chunk, len(script))
                if turn_finished([script[:n]])[0]:
                    break
            tokens = script[:n]
            logps = [-0.001 * (k + 1) - seq - 0.1 * self.turn_index for k in range(n)]
            out.append(SampledTurn(tokens, logps, bool(tokens) and tokens[-1] in self.sampler.stop_ids))
            chunks.setdefault(-(-n // self.sampler.chunk), []).append(seq)
        if self.sampler.report_early and on_finished is not None:
            for _, seqs in sorted(chunks.items()):
                on_finished(seqs, [out[seq] for seq in seqs])
        self.emitted = out
        return out

    def end_turn(self, keep, observations):
        for k, turn in zip(keep, self.emitted):
            assert 0 <= k <= len(turn.token_ids)
        self.end_calls.append((list(keep), [None if o is None else list(o) for o in observations]))
        self.turn_index += 1


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
