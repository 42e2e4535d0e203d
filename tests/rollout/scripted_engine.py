"""The scripted rollout engine of the tests (`rollout.interfaces.Engine`, and its own `EngineSource`): no model, each
turn's tokens picked by a policy of the conversation, `chunk` per step, so that turns of different lengths end at
different steps (as a real engine's do). Import as `from tests.rollout.scripted_engine import ScriptedEngine`."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Union

from llds_jax.rollout.interfaces import SampledTurn
from llds_jax.rollout.stats import EngineCounts

ScriptTurn = Union[str, list]  # turn text, or token ids (e.g. to end with an EOS id)


@dataclasses.dataclass
class _Seq:
    context: list[int]  # its tokens: those before its current turn, and the turn's once it has ended
    turn_starts: list[int]  # where each of its turns began in its context (the last: the current turn's)
    turn: list[int] = dataclasses.field(default_factory=list)  # the current turn's tokens, cut at budget or stop id
    emitted: int = 0  # of which sampled so far
    ended: bool = False


class ScriptedEngine:
    """A scripted engine: `policy(context_text, seq, turn) -> ScriptTurn` picks turn `turn` (0-based) of sequence
    `seq` from the text of its context so far (`from_scripts` builds one of fixed per-sequence turns).

    Like the real engine, a turn's tokens come out `chunk` per step and the stop matcher (`interfaces.StopMatcher`,
    fed each step's new tokens; None: none) is asked after each step, so tokens after the cut point come back too;
    a stop id ends the turn (returned with it), as does its budget. `slots` bounds the sequences in flight. The
    log-prob of token k of turn t of sequence s is -0.001 (k + 1) - s - 0.1 t.

    Records: `events` ((step, call, seq) for every call of the driver: "add", "extend", "fork" or "finish", step the
    calls to `step` before it), `budgets[seq]` (each turn's budget), `extends[seq]` ((keep, observation ids) of each
    extend), `steps` and `most_in_flight`.

    It is its own engine source (`interfaces.EngineSource`, for `agent.rollout`): `engine(params, stop_matcher)`
    returns it, the rollout's stop matcher set, for one rollout.
    """

    token_budgets = ()

    def __init__(self, tokenizer, policy: Callable[[str, int, int], ScriptTurn], slots: int = 64, chunk: int = 4,
                 stop_ids: Sequence[int] = (), stop_matcher=None):
        self.tokenizer, self.policy, self.slots, self.chunk = tokenizer, policy, slots, chunk
        self.stop_ids, self.stop_matcher = tuple(stop_ids), stop_matcher
        self.counts = EngineCounts()
        self.seqs: dict[int, _Seq] = {}
        self.events: list[tuple[int, str, int]] = []
        self.budgets: dict[int, list[int]] = {}
        self.extends: dict[int, list[tuple[int, list[int]]]] = {}
        self.steps = 0
        self.most_in_flight = 0

    @classmethod
    def from_scripts(cls, tokenizer, scripts: Sequence[Sequence[ScriptTurn]], **kwargs) -> ScriptedEngine:
        """The engine whose sequence i samples scripts[i]'s turns in order (text or token ids)."""
        return cls(tokenizer, lambda text, seq, turn: scripts[seq][turn], **kwargs)

    def engine(self, params, stop_matcher=None) -> ScriptedEngine:
        del params
        assert not self.seqs, "a scripted engine serves one rollout"
        self.stop_matcher = stop_matcher
        return self

    @property
    def running(self) -> int:
        return sum(not s.ended for s in self.seqs.values())

    def can_admit(self, context_tokens: int) -> bool:
        return len(self.seqs) < self.slots

    def _begin(self, seq: int, budget: int) -> None:
        s = self.seqs[seq]
        turn = self.policy(self.tokenizer.decode(s.context), seq, len(s.turn_starts))
        script = list(turn) if isinstance(turn, list) else self.tokenizer.encode(turn, add_special_tokens=False)
        stop = next((k for k, t in enumerate(script) if t in self.stop_ids), None)
        s.turn, s.emitted, s.ended = script[:budget if stop is None else min(budget, stop + 1)], 0, False
        s.turn_starts.append(len(s.context))
        self.budgets.setdefault(seq, []).append(budget)
        self.most_in_flight = max(self.most_in_flight, len(self.seqs))
        if self.stop_matcher is not None:
            self.stop_matcher.reset(seq)

    def add_request(self, seq, prompt_ids, key_data, budget, sampled=0):
        assert seq not in self.seqs and len(self.seqs) < self.slots
        self.events.append((self.steps, "add", seq))
        self.seqs[seq] = _Seq(list(prompt_ids), [])
        self._begin(seq, budget)

    def extend(self, seq, keep, observation_ids, budget):
        s = self.seqs[seq]
        assert s.ended and 0 <= keep <= s.emitted
        self.events.append((self.steps, "extend", seq))
        self.extends.setdefault(seq, []).append((keep, list(observation_ids)))
        s.context = s.context[:s.turn_starts[-1] + keep] + list(observation_ids)
        self._begin(seq, budget)

    def fork(self, seq, source, at_turn, key_data, budget):
        parent = self.seqs[source]
        assert seq not in self.seqs and len(self.seqs) < self.slots
        self.events.append((self.steps, "fork", seq))
        self.seqs[seq] = _Seq(parent.context[:parent.turn_starts[at_turn]], parent.turn_starts[:at_turn])
        self._begin(seq, budget)

    def finish(self, seq):
        self.events.append((self.steps, "finish", seq))
        del self.seqs[seq]

    def update_params(self, params):
        pass

    def step(self):
        self.steps += 1
        pushed = []
        for seq, s in sorted(self.seqs.items()):
            if not s.ended:
                new = s.turn[s.emitted:s.emitted + self.chunk]
                s.emitted += len(new)
                pushed.append((seq, new))
        text_stops = ([False] * len(pushed) if self.stop_matcher is None else
                      self.stop_matcher.push_many([seq for seq, _ in pushed], [new for _, new in pushed]))
        ended = []
        for (seq, _), text_stop in zip(pushed, text_stops):
            s = self.seqs[seq]
            if text_stop or s.emitted == len(s.turn):
                s.ended = True
                tokens, t = s.turn[:s.emitted], len(s.turn_starts) - 1
                s.context += tokens
                logps = [-0.001 * (k + 1) - seq - 0.1 * t for k in range(len(tokens))]
                ended.append((seq, SampledTurn(tokens, logps, bool(tokens) and tokens[-1] in self.stop_ids)))
        return ended
