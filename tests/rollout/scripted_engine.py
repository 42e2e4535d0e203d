"""A scripted rollout engine (`rollout.interfaces.Engine`) for the driver's tests: no model, turns chosen by a
policy of the context text, each taking ceil(tokens / chunk) steps so that turns of different lengths end at
different steps (as a real engine's do). Import as `from tests.rollout.scripted_engine import ScriptedEngine`."""
from __future__ import annotations

import dataclasses

from llds_jax.rollout.interfaces import SampledTurn


@dataclasses.dataclass
class _Seq:
    context: list[int]
    budget: int
    turn: list[int]        # the current turn's scripted tokens
    emitted: int = 0       # of which sampled so far
    turn_start: int = 0
    turn_starts: list = dataclasses.field(default_factory=list)
    ended: bool = False


class ScriptedEngine:
    """`policy(context_text, seq) -> turn text` picks each turn; `slots` bounds the sequences in flight; `events`
    logs (step, call, seq) for every call the driver makes."""

    def __init__(self, tokenizer, policy, slots: int = 64, chunk: int = 4):
        self.tokenizer, self.policy, self.slots, self.chunk = tokenizer, policy, slots, chunk
        self.seqs: dict[int, _Seq] = {}
        self.events: list[tuple[int, str, int]] = []
        self.steps = 0
        self.most_in_flight = 0

    @property
    def running(self) -> int:
        return sum(not s.ended for s in self.seqs.values())

    def can_admit(self, context_tokens: int) -> bool:
        return len(self.seqs) < self.slots

    def _begin(self, seq: int) -> None:
        s = self.seqs[seq]
        text = self.policy(self.tokenizer.decode(s.context), seq)
        s.turn, s.emitted, s.ended = self.tokenizer.encode(text, add_special_tokens=False)[:s.budget], 0, False
        s.turn_start = len(s.context)
        s.turn_starts.append(s.turn_start)
        self.most_in_flight = max(self.most_in_flight, len(self.seqs))

    def add_request(self, seq, prompt_ids, key_data, budget, sampled=0):
        assert seq not in self.seqs and len(self.seqs) < self.slots
        self.events.append((self.steps, "add", seq))
        self.seqs[seq] = _Seq(list(prompt_ids), budget, [])
        self._begin(seq)

    def extend(self, seq, keep, observation_ids, budget):
        s = self.seqs[seq]
        assert s.ended and 0 <= keep <= s.emitted
        self.events.append((self.steps, "extend", seq))
        s.context = s.context[:s.turn_start + keep] + list(observation_ids)
        s.budget = budget
        self._begin(seq)

    def fork(self, seq, source, at_turn, key_data, budget):
        parent = self.seqs[source]
        self.events.append((self.steps, "fork", seq))
        self.seqs[seq] = _Seq(parent.context[:parent.turn_starts[at_turn]], budget, [],
                              turn_starts=parent.turn_starts[:at_turn])
        self._begin(seq)

    def finish(self, seq):
        self.events.append((self.steps, "finish", seq))
        del self.seqs[seq]

    def update_params(self, params):
        pass

    def step(self):
        self.steps += 1
        ended = []
        for seq, s in sorted(self.seqs.items()):
            if s.ended:
                continue
            s.emitted = min(len(s.turn), s.emitted + self.chunk)
            if s.emitted == len(s.turn):
                s.ended = True
                s.context += s.turn
                ended.append((seq, SampledTurn(list(s.turn), [-0.5] * len(s.turn), False)))
        return ended
