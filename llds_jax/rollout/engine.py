"""The rollout engine over a paged KV cache: sequences enter, take turns, are extended, forked and leave; every
`step()` is one device call of a ragged batch at a token budget.

  add_request(seq, prompt_ids, key, budget,  a new conversation; its first turn may sample `budget` tokens.
              sampled=0)                      A prompt another sequence in flight has already encoded is not
                                              encoded again: the new sequence shares its pages (a GRPO group).
                                              `sampled`: tokens the conversation sampled before (a conversation
                                              resumed from its tokens, `rollout.partial`: its KV is recomputed,
                                              its PRNG stream goes on at fold_in(key, sampled)). It takes
                                              pages as it writes (`can_admit` says whether the pool has room).
  step()                                      one device call: the pending tokens of the sequences in flight (a
                                              decoding sequence's last sampled token, prompt and observation chunks
                                              up to the token budget), then up to `decode_chunk` samples of every
                                              sequence whose input is all in. Returns the turns that ended: on a
                                              stop id, at the turn's budget, or once the turn's text holds a stop
                                              string (`StopMatcher`, fed only the new tokens). With overlap (below)
                                              it dispatches the next call, then returns the turns of the call
                                              before. When a sequence needs a page and none is free, the most
                                              recently admitted sequence is preempted (below).
  extend(seq, keep, observation_ids, budget)  after an ended turn: keeps the turn's first `keep` tokens (the rest is
                                              rolled back), appends the observation, starts the next turn.
  fork(seq, source, at_turn, key, budget)     a new sequence whose context is `source`'s at the start of its turn
                                              `at_turn` (a tree's node): a page table, at most one page copied
                                              (its context encoded again if `source` was preempted).
  finish(seq)                                 the sequence leaves; its pages go back to the pool.
  update_params(params)                       the policy for the next steps.

The host beside the device (where the runner is a `step_calls.OverlappingRunner`): each `step()` dispatches call n + 1
before it absorbs call n and returns n's ended turns (the caller works on them while n + 1 runs); a turn that ended
in n has its row of n + 1 dropped (`llds_jax.rollout.step_calls`: how, and why it is exact).

Pages by use, preemption by recompute. A sequence holds the pages of the tokens it has written, no more: admission
(`can_admit`) asks only that the free pages cover the context every admitted sequence has yet to write, the new one's
and a watermark (WATERMARK of the pool), and that no preempted sequence waits. When a step cannot give a decoding
sequence the pages of its next tokens (or can schedule nothing at all), the most recently admitted sequence that
holds pages is preempted: its pages go back to the pool and its tokens stay on the host; it re-encodes its whole
context when it is scheduled again (with its group's shared prompt pages when a sample holds them) and samples on
from where it stopped. Each preemption counts in `EngineCounts.preemptions`. A pool that holds one sequence at
max_context (EngineConfig's check) always makes progress: the oldest sequence is never preempted for a younger one.

Exactness. Sequence s samples its n-th token (n counting every token it sampled, rolled-back ones included, the
samples of a dropped row not) with the PRNG key fold_in(key_s, n), and each turn is sampled in calls of
`decode_chunk` tokens from its own start, the stop strings checked after each call: the tokens a sequence samples do
not depend on which other sequences share its steps, nor on the scheduling policy, nor on preemption (a preempted
decoding sequence stops between calls, so its turn's calls stay aligned to the turn's start), nor on overlap (a
dropped row's samples are discarded whole, and its turn had ended before them). A sequence's K/V written in its
pages are those of a full forward of its tokens, so the logits are a full forward's up to float rounding.

The device side and what it exchanges with the engine: `llds_jax.rollout.step_calls`.
Dimension letters (docs/architecture.md, "Dimension letters"): S sequence slots of a step, T tokens of a step's
ragged batch, C samples of one call, M pages per sequence.
"""
from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Sequence
from typing import Any, Optional

import numpy as np

from llds_jax.rollout.interfaces import SampledTurn, StopMatcher
from llds_jax.rollout.pages import PageCopy, PageTable
from llds_jax.rollout.stats import EngineCounts
from llds_jax.rollout.step_calls import EngineConfig, OverlappingRunner, StepBatch, StepResult, StepRunner

WATERMARK = 0.01  # the share of the pool's pages that admission leaves free for the sequences' growth


class _State(enum.Enum):
    INPUT = "input"      # tokens to write before the next sample (prompt, observation, a re-fed token)
    DECODE = "decode"    # sampling; its last sampled token is the only pending one
    ENDED = "ended"      # its turn ended; waits for extend or finish


@dataclasses.dataclass
class _Sequence:
    tokens: list[int]         # the context: prompt, kept turns and observations, the current turn's samples
    key_data: np.ndarray      # uint32 [2]
    budget: int               # tokens the current turn may still sample
    state: _State = _State.INPUT
    cached: int = 0           # tokens whose K/V are in the pool
    sampled: int = 0          # tokens sampled so far, every turn (the n of fold_in)
    turn_starts: list[int] = dataclasses.field(default_factory=list)  # context length at each turn's start
    turn_logps: list[float] = dataclasses.field(default_factory=list)
    prompt: Optional[bytes] = None  # its prompt's ids as bytes (None for a fork): others with it share its pages
    prompt_len: int = 0
    order: int = 0            # admission order: the most recent is preempted first

    @property
    def turn_start(self) -> int:
        return self.turn_starts[-1]


PENDING = -1  # a token of `_Sequence.tokens` the call in flight samples (known once it is absorbed)


@dataclasses.dataclass
class _Row:
    """A sequence's row of a dispatched call, and its state before it (`Engine._commit`'s assumptions undone)."""
    seq: int
    chunk: int                # tokens it writes
    samples: int              # tokens it may sample
    at: int = 0               # where its samples start in its tokens
    sampled: int = 0          # its `sampled` before the call
    budget: int = 0           # its `budget` before the call
    dropped: bool = False     # its turn ended in the call before, or it left: its samples are not taken


@dataclasses.dataclass
class _Call:
    """A dispatched call: its rows (by sequence too), token bucket, the runner's handle, when it was dispatched."""
    rows: list[_Row]
    by_seq: dict[int, int]
    bucket: int
    handle: Any
    started_s: float


class Engine:
    """The host side of the rollout engine (see the module docstring).

    Args:
      runner: the device side.
      params: the policy's parameters, handed to the runner.
      config: the static shapes.
      stop_matcher: the stop-string check of turn text (None: stop ids and budgets only).
      overlap: whether a step dispatches the next call before it absorbs the one in flight (None: if it can).
    """

    def __init__(self, runner: StepRunner | OverlappingRunner, params: Any, config: EngineConfig,
                 stop_matcher: Optional[StopMatcher] = None, overlap: Optional[bool] = None):
        self.runner, self.params, self.config, self.stop_matcher = runner, params, config, stop_matcher
        self.overlap = hasattr(runner, "dispatch") if overlap is None else overlap
        self._in_flight: Optional[_Call] = None  # the call dispatched and not absorbed yet (overlap)
        self._last_ready = 0.0  # when the device had the last call's results
        self.pages = PageTable(config.num_pages, config.page_size)
        self.counts = EngineCounts()
        self._seqs: dict[int, _Sequence] = {}
        self._stop_ids = frozenset(config.stop_ids)
        self._admitted = 0  # sequences admitted so far (each one's `order`)
        self._preempted: set[int] = set()  # preempted sequences not scheduled again yet
        self._watermark = max(1, round(WATERMARK * (config.num_pages - 1)))

    # The protocol (rollout.interfaces.Engine).

    @property
    def running(self) -> int:
        """Sequences in flight (not ended)."""
        return sum(s.state is not _State.ENDED for s in self._seqs.values())

    @property
    def in_flight(self) -> int:
        """Sequences holding a slot (ended ones included, until extended or finished)."""
        return len(self._seqs)

    def can_admit(self, context_tokens: int) -> bool:
        """Whether a sequence of `context_tokens` tokens to encode may enter now: a free slot, no preempted sequence
        waiting to come back, and free pages for the context every sequence in flight has yet to write, this one's
        and the watermark."""
        if len(self._seqs) == self.config.max_seqs or self._preempted:
            return False
        owed = sum(max(0, self.pages.pages_for(len(s.tokens)) - self.pages.held(seq)) for seq, s in self._seqs.items())
        return owed + self.pages.pages_for(context_tokens) + self._watermark <= self.pages.free_pages

    def add_request(self, seq: int, prompt_ids: Sequence[int], key_data: np.ndarray, budget: int,
                    sampled: int = 0) -> None:
        self._check_new(seq, budget, len(prompt_ids))
        state = _Sequence(list(prompt_ids), np.asarray(key_data, np.uint32).reshape(2), budget, sampled=sampled,
                          prompt=np.asarray(prompt_ids, np.int64).tobytes(), prompt_len=len(prompt_ids))
        state.turn_starts.append(len(state.tokens))
        self._enter(seq, state)
        self.pages.add(seq)
        self._reset_matcher(seq)

    def extend(self, seq: int, keep: int, observation_ids: Sequence[int], budget: int) -> None:
        s = self._seqs[seq]
        if s.state is not _State.ENDED:
            raise ValueError(f"Engine.extend: sequence {seq}'s turn has not ended")
        sampled = len(s.tokens) - s.turn_start
        if not 0 <= keep <= sampled:
            raise ValueError(f"Engine.extend: keep {keep} of sequence {seq}'s {sampled} sampled tokens")
        context = s.turn_start + keep + len(observation_ids)
        if budget < 1 or context + budget > self.config.max_context:
            raise ValueError(f"Engine.extend: sequence {seq}: a turn of {budget} tokens after {context} exceeds the "
                             f"engine's {self.config.max_context}")
        del s.tokens[s.turn_start + keep:]
        s.tokens += list(observation_ids)
        self._roll_back(seq, min(s.cached, s.turn_start + keep))
        s.turn_starts.append(len(s.tokens))
        s.budget, s.state, s.turn_logps = budget, _State.INPUT, []
        self._reset_matcher(seq)

    def fork(self, seq: int, source: int, at_turn: int, key_data: np.ndarray, budget: int) -> None:
        parent = self._seqs[source]
        length = parent.turn_starts[at_turn]
        self._check_new(seq, budget, length)
        state = _Sequence(parent.tokens[:length], np.asarray(key_data, np.uint32).reshape(2), budget,
                          turn_starts=parent.turn_starts[:at_turn + 1])
        self._enter(seq, state)
        if parent.cached >= length - 1:
            self._share(seq, source, length - 1)
        else:  # the parent was preempted: the fork encodes its context itself
            self.pages.add(seq)
        self._reset_matcher(seq)

    def finish(self, seq: int) -> None:
        self._drop(seq)
        del self._seqs[seq]
        self._preempted.discard(seq)
        self.pages.free(seq)
        if self.stop_matcher is not None:
            self.stop_matcher.forget(seq)

    def update_params(self, params: Any) -> None:
        self.params = params

    def context(self, seq: int) -> list[int]:
        """The context of a sequence whose turn has ended (a copy)."""
        return list(self._seqs[seq].tokens)

    def step(self) -> list[tuple[int, SampledTurn]]:
        """One device call: returns (sequence, its turn) for the turns that ended in it, in sequence order. With
        overlap, the call that returns is the one dispatched by the step before (this step dispatches the next one
        first; the first step returns [] once it has dispatched)."""
        previous, self._in_flight = self._in_flight, None
        call = self._launch(previous)
        if self.overlap:
            self._in_flight, call = call, previous
        if call is None:
            if self.running and self._in_flight is None:
                raise RuntimeError(f"Engine.step: nothing can be scheduled while {self.running} sequences run "
                                   f"({self._state()})")
            return []
        return self._absorb(call, self._fetch(call))

    def _launch(self, previous: Optional[_Call]) -> Optional[_Call]:
        """Schedules, builds and dispatches a call (None: nothing to run); `previous`: the call in flight."""
        chosen = self._schedule(speculative=previous is not None)
        if not chosen:
            return None
        batch = self._batch(chosen, previous)
        rows = self._commit(chosen)
        start = time.perf_counter()
        handle = (self.runner.dispatch(self.params, batch, previous and previous.handle) if self.overlap
                  else self.runner.run(self.params, batch))
        return _Call(rows, {row.seq: i for i, row in enumerate(rows)}, len(batch.tokens_t), handle, start)

    def _fetch(self, call: _Call) -> StepResult:
        """The call's results; counts the host's wait for them and the device's seconds (from its dispatch, or the
        end of the call before, to its results)."""
        start = time.perf_counter()
        result = self.runner.fetch(call.handle) if self.overlap else call.handle
        end = time.perf_counter()
        self.counts.wait_s += end - (start if self.overlap else call.started_s)
        ready = result.ready_s if result.ready_s is not None else end
        self.counts.device_s += max(0.0, ready - max(call.started_s, self._last_ready))
        self._last_ready = ready
        return result

    # Scheduling.

    def _schedule(self, speculative: bool) -> list[tuple[int, int, int]]:
        """(sequence, tokens written, samples) of the next step (`_plan`), preempting sequences (`_victim`) while a
        decoding sequence cannot have the pages of its next tokens, or while nothing at all can be scheduled. Each
        preemption leaves one sequence fewer holding pages, so the loop ends. `speculative`: a call is in flight,
        none is preempted: where one would be, nothing is scheduled (the next step, the call absorbed, preempts)."""
        waiting = self._take_shared_prompts()  # once: a sequence preempted below shares nothing again this step
        while True:
            chosen, blocked = self._plan(waiting)
            decoding = [seq for seq in blocked if self._seqs[seq].state is _State.DECODE]
            if not decoding and (chosen or not blocked):
                break
            if speculative:
                return []
            short = min(decoding or blocked, key=lambda seq: self._seqs[seq].order)
            victim = self._victim(short, progressing=bool(chosen))
            if victim is None:
                break
            self._preempt(victim)
        for seq, _, _ in chosen:
            self._preempted.discard(seq)
        return chosen

    def _plan(self, waiting: set[int]) -> tuple[list[tuple[int, int, int]], list[int]]:
        """(the step's (sequence, tokens written, samples): every decoding sequence's pending token, then input
        chunks in sequence order while the token budget, the slots and the pool allow; the sequences that could
        not have their pages). The sequences in `waiting` wait for another's prompt pages (`_take_shared_prompts`)."""
        cfg = self.config
        budget, chosen, blocked, pages_left = cfg.token_budgets[-1], [], [], self.pages.free_pages
        order = sorted(self._seqs.items(), key=lambda item: (item[1].state is not _State.DECODE, item[0]))
        for seq, s in order:
            if s.state is _State.ENDED or len(chosen) == cfg.max_seqs or budget == 0 or seq in waiting:
                continue
            if s.state is _State.DECODE and not s.budget:  # its turn ends in the call in flight
                continue
            pending = len(s.tokens) - s.cached
            chunk = min(pending, budget) if s.state is _State.INPUT else pending
            samples = min(cfg.decode_chunk, s.budget) if chunk == pending else 0
            end = s.cached + chunk + max(samples - 1, 0)
            needed = self.pages.pages_to_write(seq, end)
            if needed > pages_left:
                blocked.append(seq)
                continue
            pages_left -= needed
            budget -= chunk
            chosen.append((seq, chunk, samples))
        return chosen, blocked

    def _victim(self, short: int, progressing: bool) -> Optional[int]:
        """The sequence to preempt for `short`, which cannot have its pages: the most recently admitted sequence
        holding pages that entered after it; else `short` itself when others progress; else (nothing can be
        scheduled) the most recently admitted one whose turn has ended. None: nothing holds pages to give."""
        holders = [(s.order, seq) for seq, s in self._seqs.items() if seq != short and self.pages.held(seq)]
        younger = [(order, seq) for order, seq in holders if order > self._seqs[short].order]
        if younger:
            return max(younger)[1]
        if not progressing:
            ended = [(order, seq) for order, seq in holders if self._seqs[seq].state is _State.ENDED]
            if ended:
                return max(ended)[1]
        return short if self.pages.held(short) else None

    def _preempt(self, seq: int) -> None:
        """Gives back every page of `seq`; its tokens stay, to be encoded again when it is next scheduled (a decoding
        sequence samples on after them; an ended one waits for extend or finish as before)."""
        s = self._seqs[seq]
        self.pages.free(seq)
        self.pages.add(seq)
        s.cached = 0
        if s.state is _State.DECODE:
            s.state = _State.INPUT
        self._preempted.add(seq)
        self.counts.preemptions += 1

    def _take_shared_prompts(self) -> set[int]:
        """Unencoded sequences whose prompt another sequence has encoded take its pages (all but the last prompt
        token, which each encodes itself for its own first logits). Returns the unencoded sequences that wait for
        one added before them with the same prompt, which has not encoded it yet: they take its pages once it has.
        One pass over the sequences, the prompts looked up by their bytes (O(S) per step)."""
        donors: dict[bytes, int] = {}  # a prompt -> a sequence holding its pages
        first: dict[bytes, int] = {}   # a prompt -> the first sequence added with it that will encode it
        unencoded = []
        for seq, s in self._seqs.items():
            if s.prompt is None or s.prompt_len < 2:
                continue
            if s.cached >= s.prompt_len - 1:
                donors.setdefault(s.prompt, seq)
            elif s.state is _State.INPUT:  # (an ended sequence without it was preempted: it encodes nothing now)
                first.setdefault(s.prompt, seq)
                if not s.cached:
                    unencoded.append((seq, s))
        waiting = set()
        for seq, s in unencoded:
            donor = donors.get(s.prompt)
            if donor is not None:
                self._share(seq, donor, s.prompt_len - 1)
                self.counts.shared_prompt_tokens += s.prompt_len - 1
            elif first[s.prompt] != seq:
                waiting.add(seq)
        return waiting

    def _batch(self, chosen: list[tuple[int, int, int]], previous: Optional[_Call]) -> StepBatch:
        """The host arrays of a call of `chosen`; a decoding sequence's token that `previous` (the call in flight)
        samples is named by its row there (`StepBatch.source_s`)."""
        cfg = self.config
        total = sum(chunk for _, chunk, _ in chosen)
        bucket = next(b for b in cfg.token_budgets if b >= total)
        tokens_t = np.zeros(bucket, np.int32)
        cu_q_lens_s = np.full(cfg.max_seqs + 1, total, np.int32)
        kv_lens_s = np.zeros(cfg.max_seqs, np.int32)
        samples_s = np.zeros(cfg.max_seqs, np.int32)
        key_data_s = np.zeros((cfg.max_seqs, 2), np.uint32)
        count_s = np.zeros(cfg.max_seqs, np.int32)
        source_s = np.full(cfg.max_seqs, -1, np.int32)
        copies: list[PageCopy] = []
        at = 0
        for row, (seq, chunk, samples) in enumerate(chosen):
            s = self._seqs[seq]
            copies += self.pages.write(seq, s.cached + chunk + max(samples - 1, 0))
            tokens_t[at:at + chunk] = s.tokens[s.cached:s.cached + chunk]
            if s.tokens[s.cached] == PENDING:  # its last sample in the call in flight (its only batch token)
                source_s[row], tokens_t[at] = previous.by_seq[seq], 0
            cu_q_lens_s[row] = at
            kv_lens_s[row] = s.cached + chunk
            samples_s[row], key_data_s[row], count_s[row] = samples, s.key_data, s.sampled
            at += chunk
        page_copies = np.zeros((cfg.max_copies, 2), np.int32)
        for i, copy in enumerate(copies):
            page_copies[i] = copy.source, copy.target
        self.counts.page_copies += len(copies)
        self.counts.calls[bucket] = self.counts.calls.get(bucket, 0) + 1
        self.counts.batch_tokens[bucket] = self.counts.batch_tokens.get(bucket, 0) + total
        page_table_sm = np.zeros((cfg.max_seqs, cfg.pages_per_seq), np.int32)
        page_table_sm[:len(chosen)] = self.pages.table_array([seq for seq, _, _ in chosen], cfg.pages_per_seq)
        return StepBatch(tokens_t, cu_q_lens_s, kv_lens_s, page_table_sm, len(chosen),
                         samples_s, key_data_s, count_s, page_copies, cfg.decode_chunk, source_s)

    def _commit(self, chosen: list[tuple[int, int, int]]) -> list[_Row]:
        """Takes a dispatched call into the sequences as if every sampling one samples all its tokens and goes on
        (its samples PENDING until absorbed, its last one its pending token): the next call is scheduled from
        that. Returns the call's rows, with what `_absorb` needs to undo it for a turn that ends in the call."""
        rows = []
        for seq, chunk, samples in chosen:
            s = self._seqs[seq]
            s.cached += chunk
            row = _Row(seq, chunk, samples, len(s.tokens), s.sampled, s.budget)
            if samples:
                s.tokens += [PENDING] * samples
                s.cached += samples - 1  # every sample but the last is written by the call's decode steps
                s.sampled += samples
                s.budget -= samples
                s.state = _State.DECODE
            rows.append(row)
        return rows

    def _absorb(self, call: _Call, result: StepResult) -> list[tuple[int, SampledTurn]]:
        """Takes a call's samples into its sequences (`_commit` assumed them); returns the turns that ended. A turn
        that ended before the call's last sample (a stop id), or at it (a stop string, its budget), undoes what
        `_commit` assumed past its end, and its row in the call in flight is dropped (its pages past its context
        given back: that call's writes there are never read)."""
        self.counts.sample_slots += self.config.max_seqs * int(np.max(result.n_s, initial=0))
        sampled: list[tuple[_Row, list[int]]] = []
        n_s, tokens_sc, logps_sc = result.n_s.tolist(), result.tokens_sc.tolist(), result.logps_sc.tolist()
        for i, row in enumerate(call.rows):
            if not row.samples or row.dropped:
                continue
            s, n = self._seqs[row.seq], n_s[i]
            new = tokens_sc[i][:n]
            s.tokens[row.at:row.at + n] = new
            s.turn_logps += logps_sc[i][:n]
            self.counts.sampled_tokens += n
            sampled.append((row, new))
        text_stops = ([False] * len(sampled) if self.stop_matcher is None else
                      self.stop_matcher.push_many([row.seq for row, _ in sampled], [new for _, new in sampled]))
        ended = []
        for (row, new), text_stop in zip(sampled, text_stops):
            n, hit_stop = len(new), new[-1] in self._stop_ids
            if hit_stop or text_stop or row.budget == n:
                s = self._seqs[row.seq]
                self._drop(row.seq)
                del s.tokens[row.at + n:]
                s.sampled, s.budget, s.state = row.sampled + n, row.budget - n, _State.ENDED
                s.cached = row.at + n - 1  # its last sample is not written
                self.pages.truncate(row.seq, s.cached)
                ended.append((row.seq, SampledTurn(s.tokens[s.turn_start:], list(s.turn_logps), hit_stop)))
        return sorted(ended)

    def _drop(self, seq: int) -> None:
        """The sequence's row in the call in flight (if any) is not taken when that call is absorbed (nor its
        tokens counted in the batch's: the token it wrote is written again, or never read)."""
        call = self._in_flight
        if call is not None and seq in call.by_seq and not call.rows[call.by_seq[seq]].dropped:
            row = call.rows[call.by_seq[seq]]
            row.dropped = True
            self.counts.dropped_rows += 1
            self.counts.batch_tokens[call.bucket] -= row.chunk

    # Helpers.

    def _check_new(self, seq: int, budget: int, length: int) -> None:
        if seq in self._seqs:
            raise ValueError(f"Engine: sequence {seq} is already in flight")
        cfg = self.config
        if len(self._seqs) == cfg.max_seqs:
            raise ValueError(f"Engine: all {cfg.max_seqs} sequence slots are taken")
        if length < 1 or budget < 1 or length + budget > cfg.max_context:
            raise ValueError(f"Engine: sequence {seq}: {length} context tokens + a turn of {budget} exceed the "
                             f"engine's {cfg.max_context}")

    def _state(self) -> str:
        """The pool and each sequence in flight: its state, tokens cached of its context, pages held."""
        seqs = "; ".join(f"sequence {seq} {s.state.value} {s.cached}/{len(s.tokens)} tokens cached, "
                         f"{self.pages.held(seq)} pages" for seq, s in self._seqs.items())
        return f"{self.pages.free_pages} of {self.config.num_pages} pages free; {seqs}"

    def _enter(self, seq: int, state: _Sequence) -> None:
        """A new sequence in flight, the most recently admitted."""
        state.order = self._admitted
        self._admitted += 1
        self._seqs[seq] = state

    def _share(self, seq: int, source: int, length: int) -> None:
        if seq in self.pages:
            self.pages.free(seq)
        self.pages.share(seq, source, length)
        self._seqs[seq].cached = length

    def _roll_back(self, seq: int, cached: int) -> None:
        """Keeps `cached` tokens' K/V, at most all but the last context token (whose logits the next sample
        needs: it is written again)."""
        s = self._seqs[seq]
        s.cached = min(cached, len(s.tokens) - 1)
        self.pages.truncate(seq, s.cached)

    def _reset_matcher(self, seq: int) -> None:
        if self.stop_matcher is not None:
            self.stop_matcher.reset(seq)
