"""Trajectories of the multi-turn rollout: per-token arrays for training, exact-match rewards, batch statistics.

One trajectory is the prompt followed by its turns; each turn is the model tokens kept for training (sampled
tokens up to the one completing the turn's cut, never the stop token) and, after it, the observation appended to
the context (an information block, a search error block or the invalid-action message), which is not trained.

Per-token arrays of a trajectory of T tokens (prompt + response), aligned with `tokens`:
  loss_mask     1 on model tokens, 0 on prompt and observation tokens.
  action_ids    the turn (0, 1, ...) a model token belongs to, -1 elsewhere.
  answer_mask   1 on the model tokens spanning the final answer, the last `<answer>...</answer>` complete inside
                one model turn (tags included; a token straddling a tag boundary counts), 0 elsewhere.
  sampler_logp  log p(token t | tokens < t) under the sampling distribution for model tokens, 0 elsewhere.
The reward (`em_rewards`, a stage of its own after the rollout) is exact match of that final answer (observations are
never scored, and turns are never joined: an answer opened in one turn and closed in the next is no answer, as in
Search-R1); it belongs on the last model token (the last 1 of loss_mask).

Segments (`rollout.context`): the sequences the model saw while it sampled, each with the same per-token arrays
(`Segment`); the trainer trains each as a sequence of its own. Under context_policy none a trajectory is one
segment, its own arrays.
"""
from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Sequence
from typing import Optional

import numpy as np

from llds_jax.data.qa import QAExample
from llds_jax.data.rewards import DEFAULT_EMPTY_ANSWER, em_reward, extract_final_answer, final_answer_turn
from llds_jax.protocol import Action
from llds_jax.rollout import context

# The same pattern as data.rewards.extract_final_answer, whose last match is the final answer.
_ANSWER_SPAN_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)

END_ANSWER = "answer"              # the model gave an answer
END_MAX_TURNS = "max_turns"        # the final turn ended without an answer
END_CONTEXT_FULL = "context_full"  # the next turn or observation would exceed a context cap
END_TRAJECTORY_BUDGET = "trajectory_budget"  # its model + observation tokens reached rollout.max_trajectory_tokens
END_REASONS = (END_ANSWER, END_MAX_TURNS, END_CONTEXT_FULL, END_TRAJECTORY_BUDGET)


@dataclasses.dataclass(frozen=True)
class Turn:
    """One model turn and the observation that followed it.

    Attributes:
      token_ids: the kept (trained) model tokens.
      logps: their sampler log-probs (float32 values).
      text: the turn text cut at the protocol's cut point; the action is parsed from it.
      action: the parsed action (kind None: invalid).
      num_sampled: tokens sampled in the turn, including the discarded ones after the cut and the stop token.
      hit_stop: the turn ended on a stop token (EOS), which is not kept.
      observation: the observation text appended after the turn (None: the trajectory ended with this turn).
      observation_ids: its tokens as appended (after truncation).
      observation_truncated: the observation was cut to the observation token limit.
      search_error: the retriever's error for this turn's search, if any.
      version: the policy version that sampled it: the training step whose rollout ran it (`rollout.partial`
        carries unfinished conversations into later steps, whose turns then come from several versions).
    """

    token_ids: tuple[int, ...]
    logps: tuple[float, ...]
    text: str
    action: Action
    num_sampled: int
    hit_stop: bool = False
    observation: Optional[str] = None
    observation_ids: tuple[int, ...] = ()
    observation_truncated: bool = False
    search_error: Optional[str] = None
    version: int = 0


@dataclasses.dataclass(frozen=True)
class Lineage:
    """Where a sequence comes from, fixed when the rollout creates it (`rollout.driver`).

    Attributes:
      group: its GRPO group, numbered over the whole batch (the global index of its prompt).
      tree: its tree, numbered over the whole batch (a chain is a tree of its own; a fork belongs to its
        parent's tree).
      key_data: the key data (two uint32) of its PRNG stream: its n-th sampled token draws with fold_in(key, n).
    """

    group: int
    tree: int
    key_data: tuple[int, int]


@dataclasses.dataclass(frozen=True)
class Segment:
    """One sequence the model saw (`rollout.context`): its context when the segment began (loss mask 0), then the
    turns it sampled and their observations up to the next edit. Per-token numpy arrays of length L, as
    `Trajectory`'s (action ids are the trajectory's turn numbers)."""

    tokens: np.ndarray        # int32 [L]
    loss_mask: np.ndarray     # int32 [L]
    action_ids: np.ndarray    # int32 [L]
    answer_mask: np.ndarray   # int32 [L]
    sampler_logp: np.ndarray  # float32 [L]


@dataclasses.dataclass(frozen=True)
class Trajectory:
    """A finished conversation with its training arrays (numpy, length T = prompt + response tokens) and its
    lineage (group, tree, PRNG key)."""

    example: QAExample
    prompt_ids: tuple[int, ...]
    turns: tuple[Turn, ...]
    end_reason: str
    tokens: np.ndarray        # int32 [T]
    loss_mask: np.ndarray     # int32 [T]
    action_ids: np.ndarray    # int32 [T]
    answer_mask: np.ndarray   # int32 [T]
    sampler_logp: np.ndarray  # float32 [T]
    model_text: str
    answer_text: str          # the text scored: the model turn holding the final answer ("" without one)
    final_answer: Optional[str]
    lineage: Lineage
    segments: tuple[Segment, ...]  # at least one

    @property
    def uid(self) -> str:
        return self.example.uid

    @property
    def num_turns(self) -> int:
        """Model turns generated (Search-R1's turn statistic counts one less for sequences that ended)."""
        return len(self.turns)

    @property
    def num_valid_actions(self) -> int:
        return sum(t.action.kind is not None for t in self.turns)

    @property
    def num_valid_searches(self) -> int:
        """Turns whose action is a search, the final turn's unexecuted one included (as Search-R1 counts)."""
        return sum(t.action.kind == "search" for t in self.turns)

    @property
    def num_truncated_observations(self) -> int:
        return sum(t.observation_truncated for t in self.turns)

    @property
    def retriever_errors(self) -> list[str]:
        return [t.search_error for t in self.turns if t.search_error is not None]

    @property
    def response_length(self) -> int:
        return len(self.tokens) - len(self.prompt_ids)


def build_trajectory(example: QAExample, prompt_ids: Sequence[int], turns: Sequence[Turn], end_reason: str,
                     tokenizer, lineage: Lineage, context_policy: Optional[tuple[str, int]] = None) -> Trajectory:
    """Assembles the token arrays, the model text, the final answer and the segments of `context_policy`
    (rollout.context_policy and rollout.keep_observations, `rollout.context`; None: one segment)."""
    if end_reason not in END_REASONS:
        raise ValueError(f"end_reason must be one of {END_REASONS}, got {end_reason!r}")
    tokens, loss_mask, action_ids, logp = list(prompt_ids), [0] * len(prompt_ids), [-1] * len(prompt_ids), \
        [0.0] * len(prompt_ids)
    model_positions: list[int] = []
    for turn_id, turn in enumerate(turns):
        if len(turn.logps) != len(turn.token_ids):
            raise ValueError(f"turn {turn_id}: {len(turn.token_ids)} tokens but {len(turn.logps)} log-probs")
        model_positions.extend(range(len(tokens), len(tokens) + len(turn.token_ids)))
        tokens += turn.token_ids
        loss_mask += [1] * len(turn.token_ids)
        action_ids += [turn_id] * len(turn.token_ids)
        logp += turn.logps
        tokens += turn.observation_ids
        loss_mask += [0] * len(turn.observation_ids)
        action_ids += [-1] * len(turn.observation_ids)
        logp += [0.0] * len(turn.observation_ids)
    model_text = tokenizer.decode([t for turn in turns for t in turn.token_ids], skip_special_tokens=True)
    turn_texts = [tokenizer.decode(list(turn.token_ids), skip_special_tokens=True) for turn in turns]
    answer_turn = final_answer_turn(turn_texts)
    answer_text = "" if answer_turn is None else turn_texts[answer_turn]  # the text scored
    answer_mask = np.zeros(len(tokens), np.int32)
    if answer_turn is not None:
        first, last = answer_token_span(turns[answer_turn].token_ids, answer_text, tokenizer)
        offset = sum(len(turn.token_ids) for turn in turns[:answer_turn])  # model tokens before the turn
        answer_mask[[model_positions[offset + i] for i in range(first, last)]] = 1
    whole = Segment(np.asarray(tokens, np.int32), np.asarray(loss_mask, np.int32),
                    np.asarray(action_ids, np.int32), answer_mask, np.asarray(logp, np.float32))
    policy, keep = context_policy or ("none", 1)
    starts = context.segment_starts(turns, policy, keep)
    segments = (whole,) if len(starts) == 1 else _segments(whole, prompt_ids, turns, starts, keep, tokenizer)
    return Trajectory(
        example=example, prompt_ids=tuple(prompt_ids), turns=tuple(turns), end_reason=end_reason,
        tokens=whole.tokens, loss_mask=whole.loss_mask, action_ids=whole.action_ids, answer_mask=answer_mask,
        sampler_logp=whole.sampler_logp, model_text=model_text, answer_text=answer_text,
        final_answer=extract_final_answer(answer_text), lineage=lineage, segments=segments)


def _segments(whole: Segment, prompt_ids: Sequence[int], turns: Sequence[Turn], starts: Sequence[int], keep: int,
              tokenizer) -> tuple[Segment, ...]:
    """The segments beginning at turns `starts` (drop_observations): each one's context (`context.context_ids`)
    followed by the trajectory's arrays from its first turn to the next segment's."""
    offsets = np.cumsum([len(prompt_ids)] + [len(t.token_ids) + len(t.observation_ids) for t in turns])
    encode = functools.lru_cache(maxsize=None)(
        lambda text: tuple(tokenizer.encode(text, add_special_tokens=False)))
    segments = []
    for first, end in zip(starts, list(starts[1:]) + [len(turns)]):
        prefix = context.context_ids(prompt_ids, turns, first, keep, encode)
        span = slice(int(offsets[first]), int(offsets[end]))
        pad = lambda x, value: np.concatenate([np.full(len(prefix), value, x.dtype), x[span]])
        segments.append(Segment(np.concatenate([np.asarray(prefix, np.int32), whole.tokens[span]]),
                                pad(whole.loss_mask, 0), pad(whole.action_ids, -1), pad(whole.answer_mask, 0),
                                pad(whole.sampler_logp, 0.0)))
    return tuple(segments)


def answer_token_span(model_ids: Sequence[int], model_text: str, tokenizer) -> Optional[tuple[int, int]]:
    """[first, last + 1) indices into model_ids of the tokens covering the last `<answer>...</answer>` of model_text.

    model_text must be `tokenizer.decode(model_ids, skip_special_tokens=True)` (build_trajectory passes one turn's
    tokens and text). None without an answer.
    """
    matches = list(_ANSWER_SPAN_RE.finditer(model_text))
    if not matches:
        return None
    start, end = matches[-1].span()
    first = _tokens_reaching(model_ids, model_text[:start + 1], tokenizer) - 1
    last = _tokens_reaching(model_ids, model_text[:end], tokenizer)
    return first, last


def _tokens_reaching(ids: Sequence[int], prefix: str, tokenizer) -> int:
    """The fewest leading tokens whose decoded text starts with `prefix` (which must end in an ASCII char).

    Decoding a token prefix gives a prefix of the full text up to an incomplete trailing UTF-8 character, so
    reaching an ASCII character is monotone in the number of tokens and a binary search applies.
    """
    lo, hi = 0, len(ids)  # not reached with lo tokens (prefix is non-empty); reached with all of them
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if tokenizer.decode(list(ids[:mid]), skip_special_tokens=True).startswith(prefix):
            hi = mid
        else:
            lo = mid
    return hi


def em_score(trajectory: Trajectory, empty_answer: str = DEFAULT_EMPTY_ANSWER) -> float:
    """Exact match (0.0 or 1.0) of the trajectory's final answer (`answer_text`) against its example's gold answers
    (data.rewards.em_reward; `empty_answer`: the run's `reward.empty_answer`)."""
    return em_reward(trajectory.answer_text, trajectory.example.golden_answers, empty_answer)


def em_rewards(trajectories: Sequence[Trajectory], empty_answer: str = DEFAULT_EMPTY_ANSWER) -> np.ndarray:
    """[B] float32 exact-match rewards (`em_score`) of a batch's trajectories."""
    return np.asarray([em_score(t, empty_answer) for t in trajectories], np.float32)


def rollout_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """Batch means of the per-trajectory statistics (turns, valid actions, valid searches, truncated
    observations, retriever errors, response length, context tokens: prompt + kept model + observation tokens,
    `len(tokens)`), the batch's most turns, valid searches and context tokens of one trajectory (`turns_max`,
    `valid_searches_max`, `context_tokens_max`: how long a horizon the rollout reached), the turns' standard
    deviation (`turns_std`) and the share of each end reason."""
    if not trajectories:
        return {}
    mean = lambda values: float(np.mean(list(values)))
    most = lambda values: float(max(values))
    metrics = {
        "turns": mean(t.num_turns for t in trajectories),
        "turns_max": most(t.num_turns for t in trajectories),
        "turns_std": float(np.std([t.num_turns for t in trajectories])),
        "valid_actions": mean(t.num_valid_actions for t in trajectories),
        "valid_searches": mean(t.num_valid_searches for t in trajectories),
        "valid_searches_max": most(t.num_valid_searches for t in trajectories),
        "truncated_observations": mean(t.num_truncated_observations for t in trajectories),
        "retriever_errors": mean(len(t.retriever_errors) for t in trajectories),
        "response_length": mean(t.response_length for t in trajectories),
        "context_tokens": mean(len(t.tokens) for t in trajectories),
        "context_tokens_max": most(len(t.tokens) for t in trajectories),
    }
    for reason in END_REASONS:
        metrics[f"end/{reason}"] = mean(t.end_reason == reason for t in trajectories)
    return metrics
