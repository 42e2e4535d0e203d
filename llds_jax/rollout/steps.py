"""The protocol's steps the rollout driver (`llds_jax.rollout.driver`) takes for every policy: a conversation's
host-side record, turn budgets, cutting and parsing a turn, appending its observation, and the batched searches with
their failure observation.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Optional, TypeVar

from llds_jax.data.qa import QAExample
from llds_jax import protocol
from llds_jax.rollout import context
from llds_jax.rollout.config import AgentConfig
from llds_jax.rollout.interfaces import SampledTurn
from llds_jax.rollout.stats import RolloutStats
from llds_jax.rollout.stop_strings import StopMatcher
from llds_jax.rollout.trajectory import (END_ANSWER, END_CONTEXT_FULL, END_MAX_TURNS, END_TRAJECTORY_BUDGET,
                                         Lineage, Trajectory, Turn, build_trajectory)
from llds_jax.search.types import Retriever, SearchResult

log = logging.getLogger(__name__)
T = TypeVar("T")

SEARCH_ERROR_OBSERVATION = "\n\n<information>Search failed: {error}</information>\n\n"
MAX_ERROR_CHARS = 200
SEARCH_ABANDONED = "abandoned: the run is stopping"  # the error of a search cut off by a stop request
STOP_POLL_S = 0.1  # how often a search in flight checks for a stop request (seconds)


class SearchAbandoned(Exception):
    """A search in flight was cut off because a stop was requested."""


def search_error_observation(error: str) -> str:
    """The observation of a failed search: an information block with the error's first line (shortened)."""
    line = (error.strip().splitlines() or ["unknown error"])[0]
    if len(line) > MAX_ERROR_CHARS:
        line = line[:MAX_ERROR_CHARS - 3] + "..."
    return SEARCH_ERROR_OBSERVATION.format(error=line)


@dataclasses.dataclass
class Conversation:
    """Host-side record of one sequence while it runs; `lineage` is fixed when it is created.

    Attributes:
      response_len: the kept model and observation tokens of all its turns (what rollout.max_trajectory_tokens
        caps).
      dropped_len: the tokens its context edits removed (`rollout.context`; 0 under context_policy none).
    """
    prompt_ids: list[int]
    lineage: Lineage
    turns: list[Turn] = dataclasses.field(default_factory=list)
    response_len: int = 0
    end_reason: Optional[str] = None
    dropped_len: int = 0

    @property
    def context_len(self) -> int:
        """Tokens of its context now: the prompt and the response as edited."""
        return len(self.prompt_ids) + self.context_response_len

    @property
    def context_response_len(self) -> int:
        """Response tokens in its context now (what rollout.max_response_tokens caps)."""
        return self.response_len - self.dropped_len

    @property
    def sampled(self) -> int:
        """Tokens it sampled so far (discarded ones included): where its PRNG stream goes on."""
        return sum(turn.num_sampled for turn in self.turns)


class AgentSteps:
    """The steps of the protocol: turn budgets, cutting and parsing a turn, appending its observation to the
    conversation, and the batched searches; they count in `stats` (`RolloutStats`) the prompt tokens of the
    conversations started, the observation tokens appended to them, the queries sent, the hits the retriever
    dropped and the retriever calls' seconds.

    `stopping`: whether a stop was requested (the trainer's PreemptionGuard): a search in flight is then abandoned
    (its queries get the observation of a failed search, SEARCH_ABANDONED) and the engines start no new turn; the
    trainer discards the step's rollout."""

    def __init__(self, tokenizer, retriever: Retriever, config: AgentConfig, stats: RolloutStats,
                 stopping: Optional[Callable[[], bool]] = None):
        self.tokenizer, self.retriever, self.config, self.stats = tokenizer, retriever, config, stats
        self._stopping = stopping
        self._prompts: dict[str, tuple[tuple[int, ...], int]] = {}  # question -> fit_prompt's (ids, tokens cut)

    def stopping(self) -> bool:
        """Whether a stop was requested: abandon the rollout."""
        return self._stopping is not None and self._stopping()

    def conversation(self, example: QAExample, lineage: Lineage) -> Conversation:
        """A new conversation of `example`; its prompt's tokens count in the stats' prompt_tokens, and a prompt whose
        question was cut to rollout.max_prompt_tokens in prompts_cut (each conversation counts)."""
        prompt_ids, cut = self._prompt(example.question)
        self.stats.prompt_tokens += len(prompt_ids)
        self.stats.prompt_spread.add(len(prompt_ids))
        self.stats.prompts_cut += bool(cut)
        return Conversation(list(prompt_ids), lineage)

    def prompt_len(self, example: QAExample) -> int:
        """Tokens of `example`'s prompt (fitted once per rollout, as `conversation` takes it; nothing counted)."""
        return len(self._prompt(example.question)[0])

    def _prompt(self, question: str) -> tuple[tuple[int, ...], int]:
        """`protocol.fit_prompt` of `question` (its prompt's token ids, the question's tokens cut), fitted once per
        rollout: a group's samples and any repeat of the question share the fit (fitting an over-long question
        encodes its whole text twice)."""
        if question not in self._prompts:
            ids, cut = protocol.fit_prompt(self.tokenizer, question, self.config.max_prompt_tokens)
            self._prompts[question] = tuple(ids), cut
        return self._prompts[question]

    def budget(self, conv: Conversation) -> int:
        """Tokens the conversation's next turn may sample (0: it is full; `full_reason` says why)."""
        cfg = self.config
        return max(0, min(cfg.max_turn_tokens, cfg.max_context_tokens - conv.context_len,
                          cfg.max_response_tokens - conv.context_response_len, self._trajectory_room(conv)))

    def _trajectory_room(self, conv: Conversation) -> float:
        """Tokens rollout.max_trajectory_tokens leaves the conversation (inf without that cap)."""
        cap = self.config.max_trajectory_tokens
        return cap - conv.response_len if cap else float("inf")

    def full_reason(self, conv: Conversation, extra: int = 1) -> str:
        """Why `extra` more tokens do not fit: trajectory_budget when rollout.max_trajectory_tokens is what they
        exceed, else context_full."""
        return END_TRAJECTORY_BUDGET if extra > self._trajectory_room(conv) else END_CONTEXT_FULL

    def stop_matcher(self) -> StopMatcher:
        """A rollout's own matcher of stop strings (a closing `</search>` or `</answer>`) in each sequence's turn
        text, fed the new tokens only (the engine's, keyed by sequence)."""
        return StopMatcher(self.tokenizer, protocol.STOP_STRINGS)

    def close_turn(self, conv: Conversation, sample: SampledTurn, final: bool
                   ) -> tuple[Turn, bool, Optional[str]]:
        """Cuts and parses a sampled turn (the kept tokens are the Turn's token_ids); sets the conversation's end
        reason when it ends. Returns (the turn, whether it searches, its observation when known: the invalid-action
        message)."""
        body = sample.token_ids[:-1] if sample.hit_stop else sample.token_ids
        cut = protocol.cut_turn_tokens(body, self.tokenizer)
        keep = cut.num_tokens
        action = protocol.parse_action(cut.text)
        turn = Turn(token_ids=tuple(body[:keep]), logps=tuple(sample.logps[:keep]), text=cut.text, action=action,
                    num_sampled=len(sample.token_ids), hit_stop=sample.hit_stop)
        if action.kind == "answer":
            conv.end_reason = END_ANSWER
        elif final:
            conv.end_reason = END_MAX_TURNS
        elif action.kind == "search":
            return turn, True, None
        else:
            return turn, False, protocol.INVALID_ACTION_MESSAGE
        return turn, False, None

    def append_turn(self, conv: Conversation, turn: Turn, observation: Optional[str], error: Optional[str]
                    ) -> tuple[Optional[list[int]], bool]:
        """Appends a closed turn and its observation (text, or None) to the conversation; a failed search's error
        is recorded on the turn. An observation that does not fit the context caps ends the conversation
        (context_full). Returns (the observation's token ids to extend the session with, None when the
        conversation ends; whether the observation was cut to max_observation_tokens)."""
        conv.response_len += len(turn.token_ids)
        obs_ids, truncated = None, False
        if observation is not None:
            # Tokenized from a prefix long enough for the token budget (MAX_CHARS_PER_TOKEN), never the whole text:
            # a document may be huge. The tokens kept are those of the whole text unless one word (a run without a
            # space or punctuation) crosses the cut.
            chars = self.config.max_observation_tokens * protocol.MAX_CHARS_PER_TOKEN
            ids = self.tokenizer.encode(observation[:chars], add_special_tokens=False)
            truncated = len(ids) > self.config.max_observation_tokens or len(observation) > chars
            ids = ids[:self.config.max_observation_tokens]
            if self.fits(conv, len(ids)):
                obs_ids = ids
                conv.response_len += len(ids)
                self.stats.observation_tokens += len(ids)
                self.stats.observation_spread.add(len(ids))
                turn = dataclasses.replace(turn, observation=observation, observation_ids=tuple(ids),
                                           observation_truncated=truncated)
            else:
                conv.end_reason = self.full_reason(conv, len(ids))
        if error is not None:
            turn = dataclasses.replace(turn, search_error=error)
        conv.turns.append(turn)
        return obs_ids, truncated

    def warn_truncations(self, truncations: int) -> None:
        if truncations:
            log.warning("%d observation(s) cut to rollout.max_observation_tokens=%d tokens", truncations,
                        self.config.max_observation_tokens)

    def fits(self, conv: Conversation, extra: int) -> bool:
        cfg = self.config
        return (conv.context_len + extra <= cfg.max_context_tokens
                and conv.context_response_len + extra <= cfg.max_response_tokens
                and extra <= self._trajectory_room(conv))

    def edited_context(self, conv: Conversation) -> Optional[list[int]]:
        """After a turn and its observation were appended: the conversation's edited context when its context
        policy edits it now (`rollout.context`; its dropped_len updated), else None."""
        cfg = self.config
        if not context.edits_after(conv.turns, cfg.context_policy, cfg.keep_observations):
            return None
        ids = context.context_ids(conv.prompt_ids, conv.turns, len(conv.turns), cfg.keep_observations, self.encode)
        conv.dropped_len = len(conv.prompt_ids) + conv.response_len - len(ids)
        return ids

    def encode(self, text: str) -> list[int]:
        """`text`'s token ids (no special tokens)."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    def trajectories(self, examples: Sequence[QAExample], convs: Sequence[Conversation]) -> list[Trajectory]:
        cfg = self.config
        return [build_trajectory(ex, c.prompt_ids, c.turns, c.end_reason, self.tokenizer, c.lineage,
                                 (cfg.context_policy, cfg.keep_observations))
                for ex, c in zip(examples, convs)]

    async def search(self, queries: list[str]) -> list[tuple[str, Optional[str]]]:
        """One batched retriever call; (observation, error message or None) per query (counted in the stats'
        searches)."""
        start = time.perf_counter()
        self.stats.searches += len(queries)
        results: Sequence[SearchResult]
        try:
            results = await self._unless_stopping(asyncio.wait_for(
                self.retriever.search(queries, self.config.retrieval_top_k), timeout=self.config.search_timeout_s))
            if len(results) != len(queries):
                raise RuntimeError(f"retriever returned {len(results)} results for {len(queries)} queries")
            failures = [r.error for r in results]
            self.stats.bad_documents += sum(r.bad_documents for r in results)
        except asyncio.TimeoutError:
            results, failures = [], [f"timed out after {self.config.search_timeout_s:g} s"] * len(queries)
        except SearchAbandoned:
            results, failures = [], [SEARCH_ABANDONED] * len(queries)
        except Exception as e:  # a failing backend must not crash the rollout
            results, failures = [], [f"{type(e).__name__}: {e}"] * len(queries)
        self.stats.search_calls_s += time.perf_counter() - start
        return [(search_error_observation(str(failures[j])), str(failures[j])) if failures[j]
                else (protocol.format_observation([d.contents for d in results[j].docs]), None)
                for j in range(len(queries))]

    async def _unless_stopping(self, call: Awaitable[T]) -> T:
        """Awaits `call`, polling `stopping` every STOP_POLL_S seconds; a stop cancels it and raises
        SearchAbandoned."""
        if self._stopping is None:
            return await call
        task = asyncio.ensure_future(call)
        while True:
            done, _ = await asyncio.wait({task}, timeout=STOP_POLL_S)
            if done:
                return task.result()
            if self.stopping():
                task.cancel()
                raise SearchAbandoned()

