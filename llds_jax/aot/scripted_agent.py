"""The scripted side of a rollout run by the real driver (`llds_jax.rollout.driver.Driver`) over the real engine
(`llds_jax.rollout.engine.Engine`), for the step estimate (`llds_jax.aot.rollout_schedule`): what a model, a tokenizer
and a retriever would answer comes from each trajectory's script (`rollout_schedule.Conversation`), everything else
(scheduling, admission, cutting, carrying) is the run's own code.

- `ScriptedRunner`: the engine's device side. A sequence samples its script's turns (a turn that ends on a stop id
  ends with STOP_ID at its length; one a stop string ends, with TEXT_STOP_ID, which `ScriptedStopMatcher` finds as
  the engine's stop-string check would; else it samples until the driver's budget ends it), each sequence its own
  token (so that no two conversations' contexts are alike past their shared prompt); every call is recorded (`Call`).
- `ScriptedSteps`: the protocol's steps (`rollout.steps.AgentSteps`) on scripted text: a turn closes as its script
  says (a search, the invalid-action message, or the answer on its last turn); an observation of n tokens is text of
  n characters, one token each (`ScriptedTokenizer`), cut and fitted by the run's own `append_turn`.
- `ScriptedSearches`: the driver's search queue (one retriever call in flight, as `driver.SearchQueue`), each call
  back `latency` device calls after it was sent, or at once when the driver waits on it with nothing to decode (a
  wait, `Schedule.search_waits`).

Which script a conversation follows: an example's uid is "instance:group" (the instance numbers the group's prompt,
shared by its samples; the group is the script's group in the batch), its sample m = position % group size.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Sequence
from typing import Optional

import numpy as np

from llds_jax import protocol
from llds_jax.data.qa import QAExample
from llds_jax.rollout.config import AgentConfig
from llds_jax.rollout.interfaces import SampledTurn
from llds_jax.rollout.stats import RolloutStats
from llds_jax.rollout.step_calls import Immediate, StepBatch, StepResult
from llds_jax.rollout.steps import AgentSteps, Conversation
from llds_jax.rollout.trajectory import END_ANSWER, END_MAX_TURNS, Lineage, Turn

STOP_ID, TOKEN_ID = 0, 1  # a turn's closing stop id; an observation's tokens
TEXT_STOP_ID = (1 << 24) - 1  # a turn's last token where a stop string ends it (`ScriptedStopMatcher`)
FIRST_PROMPT_ID = 2  # a prompt's tokens are FIRST_PROMPT_ID + its instance
FIRST_SAMPLE_ID = 1 << 24  # a sequence's sampled tokens are FIRST_SAMPLE_ID + its number in the book


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
      searches: turns closed after the call whose observation answers a search: the queries of the retriever call
        the driver sends next (its `SearchQueue`: the queries ready after a call go in one call).
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


class ScriptBook:
    """Which script each sequence follows: by its PRNG key data (what the engine's rows carry), for every
    conversation a rollout started (`ScriptedSteps.conversation`); a conversation a partial step carries keeps its
    key, so one book serves every step of a partial run."""

    def __init__(self, batch: Sequence, group: int):
        self.batch, self.group = list(batch), group
        self._by_key: dict[tuple[int, int], int] = {}  # key data -> index in batch
        self._numbers: dict[tuple[int, int], int] = {}  # key data -> its number (its sampled token)

    def script_index(self, example: QAExample, position: int) -> int:
        """The batch index of the script of `example`'s sample at `position` (the driver's, group-aligned)."""
        return int(example.uid.split(":")[1]) * self.group + position % self.group

    def enter(self, key_data: tuple[int, int], index: int) -> None:
        self._numbers.setdefault(key_data, len(self._numbers))
        self._by_key[key_data] = index

    def script(self, key_data: tuple[int, int]):
        return self.batch[self._by_key[key_data]]

    def sample_id(self, key_data: tuple[int, int]) -> int:
        return FIRST_SAMPLE_ID + self._numbers[key_data]


def examples(instances: Sequence[int], groups: Sequence[int], group: int) -> list[QAExample]:
    """The driver's examples of groups whose prompts are `instances` and whose scripts are the batch's `groups`:
    each group's `group` samples in turn."""
    return [QAExample(f"{i}:{g}", f"{i}:{g}", ("",), "schedule") for i, g in zip(instances, groups)
            for _ in range(group)]


def prompt_ids(example: QAExample, book: ScriptBook) -> list[int]:
    """The prompt of `example`'s group: its script's length, its instance's token."""
    instance, group = (int(x) for x in example.uid.split(":"))
    return [FIRST_PROMPT_ID + instance] * len(book.batch[group * book.group].prompt)


class ScriptedTokenizer:
    """Text of n characters is n tokens of TOKEN_ID (a scripted observation is "x" x n); tokens decode to ""."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        del add_special_tokens
        return [TOKEN_ID] * len(text)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        del ids, skip_special_tokens
        return ""


class ScriptedRunner(Immediate):
    """The engine's device side (module docstring); `engine` is set once the engine is built (its sequences in
    flight are recorded with each call). Overlapping as `runner.DeviceRunner` overlaps: a row whose batch token,
    taken from the call before, is a stop id samples nothing (the engine drops it)."""

    def __init__(self, book: ScriptBook, page_size: int):
        self.book, self.page_size = book, page_size
        self.engine = None
        self.calls: list[Call] = []
        self.rows_in_flight = 0

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
            key = tuple(int(x) for x in batch.key_data_s[row])
            conv = self.book.script(key)
            done, left, turn = int(batch.count_s[row]), 0, 0
            for turn, length in enumerate(conv.turn_tokens):  # the turn this sample belongs to, its tokens left
                if done < length:
                    left = length - done
                    break
                done -= length
            n = min(int(batch.samples_s[row]), max(left, 1))
            n_s[row] = n
            tokens_sc[row] = self.book.sample_id(key)
            if n == left and (conv.stops[turn] or conv.text_stop(turn)):
                tokens_sc[row, n - 1] = STOP_ID if conv.stops[turn] else TEXT_STOP_ID
        self._record(batch, n_s)
        return StepResult(tokens_sc, np.zeros((s, c), np.float32), n_s)

    def _record(self, batch: StepBatch, n_s: np.ndarray) -> None:
        pages = -(-batch.kv_lens_s[:batch.num_seqs] // self.page_size)
        iterations = max(int(n_s.max(initial=0)) - 1, 0)
        # Decode iteration i reads the pages of each sequence still sampling, one slot longer each iteration.
        lens = batch.kv_lens_s[:batch.num_seqs]
        iteration_pages = sum(int(np.sum(-(-(lens + i) // self.page_size) * (n_s[:batch.num_seqs] > i)))
                              for i in range(1, iterations + 1))
        q_lens = np.diff(batch.cu_q_lens_s[:batch.num_seqs + 1])
        in_flight = self.engine.in_flight if self.engine is not None else 0
        self.rows_in_flight = max(self.rows_in_flight, in_flight)
        self.calls.append(Call(len(batch.tokens_t), int(batch.cu_q_lens_s[batch.num_seqs]), int(pages.sum()),
                               iterations, iteration_pages, tuple(q_lens.tolist()), tuple(lens.tolist()),
                               tuple(n_s[:batch.num_seqs].tolist()), in_flight))


class ScriptedStopMatcher:
    """The engine's stop-string check (`rollout.interfaces.StopMatcher`) on scripted turns: a turn's text holds a
    stop string once TEXT_STOP_ID is sampled."""

    def reset(self, seq: int) -> None:
        del seq

    def forget(self, seq: int) -> None:
        del seq

    def push_many(self, seqs: Sequence[int], new_ids: Sequence[Sequence[int]]) -> list[bool]:
        del seqs
        return [TEXT_STOP_ID in ids for ids in new_ids]


class ScriptedSteps(AgentSteps):
    """The protocol's steps on scripted text (module docstring): budgets, fitting and appending are the run's own
    (`AgentSteps`); a conversation's prompt, a turn's action and its observation come from its script."""

    def __init__(self, config: AgentConfig, book: ScriptBook, runner: ScriptedRunner):
        super().__init__(ScriptedTokenizer(), None, config, RolloutStats())
        self.book, self.runner = book, runner

    def conversation(self, example: QAExample, lineage: Lineage) -> Conversation:
        self.book.enter(lineage.key_data, self.book.script_index(example, lineage.tree))
        return Conversation(prompt_ids(example, self.book), lineage)

    def prompt_len(self, example: QAExample) -> int:
        return len(prompt_ids(example, self.book))

    def close_turn(self, conv: Conversation, sample: SampledTurn, final: bool
                   ) -> tuple[Turn, bool, Optional[str]]:
        """The turn as its script has it (its last answers; a search's query is its observation's text); the kept
        tokens as the run keeps them (a closing stop id dropped)."""
        script, t = self.book.script(conv.lineage.key_data), len(conv.turns)
        body = (sample.token_ids[:-1] if sample.hit_stop else sample.token_ids)[:script.kept_tokens(t)]
        search = not final and t + 1 < len(script.turn_tokens) and script.searches[t]
        observation = None if t + 1 >= len(script.turn_tokens) else "x" * script.observation_tokens[t]
        action = protocol.Action("search", observation) if search else protocol.Action(None, "")
        turn = Turn(tuple(body), tuple(sample.logps[:len(body)]), "", action, len(sample.token_ids), sample.hit_stop)
        if observation is None:
            conv.end_reason = END_ANSWER
        elif final:
            conv.end_reason = END_MAX_TURNS
        elif search:
            self.runner.calls[-1] = dataclasses.replace(self.runner.calls[-1],
                                                        searches=self.runner.calls[-1].searches + 1)
            return turn, True, None
        else:
            return turn, False, observation
        return turn, False, None

    def trajectories(self, examples, convs) -> list:
        """None built: the schedule reads the calls."""
        del examples, convs
        return []


class ScriptedSearches:
    """The driver's search queue with scripted answers (module docstring): a query is its observation's text."""

    def __init__(self, runner: ScriptedRunner, latency_calls: int):
        self.runner, self.latency_calls = runner, latency_calls
        self._queued: list[tuple[int, str]] = []
        self._call: Optional[tuple[list[tuple[int, str]], int]] = None  # its queries, the call it is back after
        self.waits = 0

    @property
    def busy(self) -> bool:
        return self._call is not None or bool(self._queued)

    def submit(self, seq: int, query: str) -> None:
        self._queued.append((seq, query))

    def collect(self) -> dict[int, tuple[str, Optional[str]]]:
        results = {}
        if self._call is not None and len(self.runner.calls) >= self._call[1]:
            results = self._back()
        self._send()
        return results

    async def wait(self) -> dict[int, tuple[str, Optional[str]]]:
        """Nothing to decode: the call in flight is back now (counted in `waits`)."""
        results = {}
        if self._call is not None:
            self.waits += 1
            results = self._back()
        self._send()
        return results

    def cancel(self) -> None:
        self._call = None

    def _back(self) -> dict[int, tuple[str, Optional[str]]]:
        queries, self._call = self._call[0], None
        return {seq: (query, None) for seq, query in queries}

    def _send(self) -> None:
        if self._call is None and self._queued:
            self._call, self._queued = (self._queued, len(self.runner.calls) + self.latency_calls), []


class InlineExecutor(concurrent.futures.Executor):
    """Runs each submitted call at once on the caller's thread (the driver's decode thread, for a scripted engine
    whose steps take no time)."""

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as e:  # handed to the awaiting driver, as a thread's would be
            future.set_exception(e)
        return future
