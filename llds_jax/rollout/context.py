"""Context policies (`rollout.context_policy`): how a conversation's context is edited between turns, and the
segments a trajectory is trained as.

  none               the context only grows (Search-R1): one segment, the whole trajectory.
  drop_observations  after an information block is appended, if the context holds more than K of them
                     (`rollout.keep_observations`), the text between `<information>` and `</information>` of every
                     older one is replaced by DROPPED_OBSERVATION (the invalid-action message is no information
                     block and stays). Each such edit starts a new segment.

A segment is what the model saw while it sampled: the context as it was when the segment began (the prompt, then
each earlier turn's kept tokens and its observation, dropped or whole as of then), followed by the turns it
sampled and the observations appended, up to the next edit. Re-encoding: an edit releases the sequence from the
engine and re-admits its whole edited context as a new prompt (the driver: `Engine.finish`, then
`Engine.add_request` with the tokens sampled so far, so its PRNG stream goes on); every token of that context is
encoded again (counted in `rollout/context_reencoded_tokens`), the unchanged prefix included (sharing its pages is
a later optimisation).

The segments' starts follow from the turns alone (`segment_starts`), so a finished trajectory rebuilds them
(`trajectory.build_trajectory`) without a record of the edits.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from llds_jax.config.sections import CONTEXT_POLICIES

DROPPED_OBSERVATION = "[observation dropped]"
_OPEN, _CLOSE = "<information>", "</information>"


def dropped_text(observation: str) -> str:
    """`observation` with the text between its first `<information>` and the `</information>` after it (or its end)
    replaced by DROPPED_OBSERVATION (the tags and what surrounds them kept); unchanged without `<information>`."""
    start = observation.find(_OPEN)
    if start < 0:
        return observation
    body = start + len(_OPEN)
    end = observation.find(_CLOSE, body)
    tail = _CLOSE if end < 0 else observation[end:]
    return observation[:body] + DROPPED_OBSERVATION + tail


def is_information(turn) -> bool:
    """Whether `turn` (a `trajectory.Turn`) appended an information block (a search's documents or its error)."""
    return turn.observation is not None and bool(turn.observation_ids) and _OPEN in turn.observation


def segment_starts(turns: Sequence, policy: str, keep: int) -> tuple[int, ...]:
    """The index of the first turn of each segment: (0,) under "none"; under "drop_observations" also every turn
    that follows an information block that made the context hold more than `keep` of them."""
    if policy not in CONTEXT_POLICIES:
        raise ValueError(f"rollout.context_policy must be one of {CONTEXT_POLICIES}, got {policy!r}")
    starts, seen = [0], 0
    if policy == "none":
        return tuple(starts)
    for index, turn in enumerate(turns[:-1]):
        seen += is_information(turn)
        if is_information(turn) and seen > keep:
            starts.append(index + 1)
    return tuple(starts)


def edits_after(turns: Sequence, policy: str, keep: int) -> bool:
    """Whether the context is edited right after the last of `turns` (its observation appended): the next turn
    starts a segment."""
    return policy == "drop_observations" and bool(turns) and is_information(turns[-1]) \
        and sum(map(is_information, turns)) > keep


def context_ids(prompt_ids: Sequence[int], turns: Sequence, start: int, keep: int,
                encode: Callable[[str], list[int]]) -> list[int]:
    """The context of the segment whose first turn is `start` under "drop_observations": the prompt, then each turn
    before `start` with its kept tokens and its observation, dropped (`dropped_text`, tokenized by `encode`) unless
    it is one of the last `keep` information blocks before `start`."""
    information = [i for i in range(start) if is_information(turns[i])]
    dropped = set(information[:max(0, len(information) - keep)])
    ids = list(prompt_ids)
    for i, turn in enumerate(turns[:start]):
        ids += turn.token_ids
        ids += encode(dropped_text(turn.observation)) if i in dropped else turn.observation_ids
    return ids
