"""Partial rollouts (`rollout.partial`; APRIL, arXiv 2509.18521): a step starts more GRPO groups than it trains on,
ends its rollout once enough of them are complete, and carries the rest into the next steps.

Versions. A turn's `version` is the training step whose rollout sampled it (step k's rollout runs on the params
after step k - 1's updates); a token trained at step k has staleness k - version. A synchronous step trains only
staleness-0 tokens.

One step k (`plan_step`, the driver's cut, then `settle`):
  1. the carried groups (oldest first) whose oldest turn is more than `rollout.max_staleness` versions old are
     dropped: counted (`partial/dropped`, conversations) and logged, never trained; so are, in a run resumed with
     another `data.samples_per_prompt`, the carried groups of the old size that started (`partial/dropped_group_size`;
     one not started is carried on at the new size);
  2. fresh prompts (whole batches of the prompt iterator, in its seeded order) are appended until the step holds
     `ceil(rollout.over_sampling x P)` groups (P: the step's prompts on this host); the step starts those, the rest
     stays pending (not started, no tokens);
  3. the driver resumes the carried conversations first (their positions come first): each is re-admitted to a
     fresh engine with its tokens (prompt, turns, observations) and its PRNG stream's count, so its KV is
     recomputed under the new weights and it samples on from where it stopped (tunix's `update_params`: keep
     tokens, drop KV, re-prefill; cost: its context's tokens encoded again, `partial/reprefill_tokens`);
  4. the rollout ends once P groups are complete (all members ended: `Driver`'s cut, checked after each turn round
     under the barrier policy, after each engine step under the continuous one);
  5. the step trains the first P complete groups in the step's order (carried first, oldest first, then fresh in
     the iterator's order: a fixed, seeded order), renumbered as groups 0..P-1 of this host's share; every other
     group is carried: its finished members whole, its unfinished ones at their last complete turn (a turn in
     flight at the cut, or waiting for its search, is dropped and sampled again, by the same PRNG draws, when the
     conversation resumes), its members never started as prompts.

Which log-probs the loss compares (rl/train_step.py, unchanged): `old_logp` is the training model's at the start
of the step (the proximal policy), recomputed for every token, carried or not; the recorded per-token sampler
log-probs (`Trajectory.sampler_logp`, each from the version that sampled it) are the behaviour policy's. The
clipped ratio is logp / old_logp (its trust region around the step's start, exactly 1 on the first update); the
behaviour correction is objective.tis_cap's truncated weight min(exp(old_logp - sampler_logp), tis_cap), which
`rollout.partial` requires (the decoupled PPO objective). LLDS compares logp with old_logp: the displacement this
step's updates cause, as the paper defines it (and still exactly 0 on the first update).

With `over_sampling` 1 nothing is left unfinished at the cut (it waits for every group): the step is the
synchronous one, bit for bit. The carried groups are part of the checkpoint (`Carry.to_json`).
"""
from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional

import numpy as np

from llds_jax.data.qa import QAExample
from llds_jax.protocol import Action
from llds_jax.rollout.config import PartialConfig
from llds_jax.rollout.steps import Conversation
from llds_jax.rollout.trajectory import Lineage, Trajectory, Turn, build_trajectory

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CarriedConversation:
    """One sample of a carried group.

    Attributes:
      example: its question.
      key_data: its PRNG stream's key data (two uint32); None: never started (it starts as a fresh sample).
      prompt_ids: its prompt's tokens (() when never started).
      turns: its complete turns, each with its kept tokens, their sampler log-probs and its version.
      end_reason: None: unfinished (resumed next); set: finished, waiting for its group.
    """

    example: QAExample
    key_data: Optional[tuple[int, int]] = None
    prompt_ids: tuple[int, ...] = ()
    turns: tuple[Turn, ...] = ()
    end_reason: Optional[str] = None

    @property
    def started(self) -> bool:
        return self.key_data is not None

    @property
    def sampled(self) -> int:
        """Tokens it sampled so far (rolled-back ones included): where its PRNG stream goes on."""
        return sum(turn.num_sampled for turn in self.turns)

    @property
    def context_ids(self) -> list[int]:
        """Its context: prompt, then each turn's kept tokens and observation."""
        ids = list(self.prompt_ids)
        for turn in self.turns:
            ids += turn.token_ids + turn.observation_ids
        return ids

    @property
    def response_len(self) -> int:
        return sum(len(turn.token_ids) + len(turn.observation_ids) for turn in self.turns)


@dataclasses.dataclass(frozen=True)
class CarriedGroup:
    """A GRPO group carried to a later step: its samples, in order."""

    members: tuple[CarriedConversation, ...]

    @property
    def oldest_version(self) -> Optional[int]:
        """The version of its oldest turn (None: no turn sampled yet)."""
        versions = [turn.version for member in self.members for turn in member.turns]
        return min(versions) if versions else None

    @property
    def started(self) -> int:
        """Its conversations that started."""
        return sum(member.started for member in self.members)


@dataclasses.dataclass(frozen=True)
class Carry:
    """What a partial step hands to the next: the carried groups, in the order the next step takes them."""

    groups: tuple[CarriedGroup, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """A JSON-able record (this host's `partial` record in the checkpoint): log-probs as Python floats, which hold
        float32 values exactly."""
        return {"groups": [[_member_to_json(m) for m in group.members] for group in self.groups]}

    @classmethod
    def from_json(cls, record: Mapping[str, Any]) -> Carry:
        """The carry `to_json` recorded (KeyError / TypeError / ValueError on a malformed record)."""
        return cls(tuple(CarriedGroup(tuple(_member_from_json(m) for m in group)) for group in record["groups"]))


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What one partial step's rollout runs.

    Attributes:
      groups: the groups it starts, in the step's order (carried first, then fresh).
      pending: groups drawn but not started (carried on untouched).
      group_size: samples per group (n); the rollout's examples are each group's n members, group after group.
      prompts: P, the groups the step trains on (its cut).
      version: the step (the version its turns get).
      metrics: `partial/dropped` (conversations dropped for staleness), `partial/dropped_group_size` (carried
        conversations dropped because data.samples_per_prompt changed: `_regrouped`), `partial/resumed` (carried
        conversations resumed), `partial/reprefill_tokens` (their contexts' tokens encoded again),
        `partial/groups_started`.
    """

    groups: tuple[CarriedGroup, ...]
    pending: tuple[CarriedGroup, ...]
    group_size: int
    prompts: int
    version: int
    metrics: dict[str, float]

    @property
    def examples(self) -> list[QAExample]:
        return [member.example for group in self.groups for member in group.members]

    @property
    def carried(self) -> dict[int, CarriedConversation]:
        """Position in `examples` -> the carried conversation there, for those that started."""
        return {g * self.group_size + m: member for g, group in enumerate(self.groups)
                for m, member in enumerate(group.members) if member.started}


def plan_step(carry: Carry, draw: Callable[[], Sequence[QAExample]], cfg: PartialConfig, prompts: int,
              group_size: int, version: int) -> StepPlan:
    """Step `version`'s plan (module docstring, 1-2): `carry`'s groups of another size regrouped
    (`_regrouped`), its stale groups dropped, fresh prompts (`draw()`: the next batch of the prompt iterator)
    appended up to ceil(over_sampling x prompts) groups."""
    same_size, dropped_size = _regrouped(carry, group_size, version)
    kept, dropped = [], 0
    for group in same_size:
        oldest = group.oldest_version
        if oldest is not None and version - oldest > cfg.max_staleness:
            dropped += group.started
        else:
            kept.append(group)
    if dropped:
        log.warning("step %d: dropped %d carried conversation(s) older than rollout.max_staleness = %d",
                    version, dropped, cfg.max_staleness)
    started = math.ceil(cfg.over_sampling * prompts)
    while len(kept) < started:
        kept += [CarriedGroup((CarriedConversation(example),) * group_size) for example in draw()]
    groups = tuple(kept[:started])
    resumed = [m for group in groups for m in group.members if m.started and m.end_reason is None]
    return StepPlan(groups=groups, pending=tuple(kept[started:]), group_size=group_size, prompts=prompts,
                    version=version, metrics={
                        "partial/dropped": float(dropped), "partial/dropped_group_size": float(dropped_size),
                        "partial/resumed": float(len(resumed)),
                        "partial/reprefill_tokens": float(sum(len(m.context_ids) for m in resumed)),
                        "partial/groups_started": float(len(groups))})


def _regrouped(carry: Carry, group_size: int, version: int) -> tuple[list[CarriedGroup], int]:
    """`carry`'s groups as groups of `group_size` samples (data.samples_per_prompt), and the conversations dropped.

    A run resumed with another data.samples_per_prompt carries groups of the size it was saved with. A group none
    of whose samples started is its prompt only: it is carried on at the new size. A group with started samples
    cannot be trained as a group of the new size (its samples' advantages are relative to each other): it is
    dropped, its started conversations counted (`partial/dropped_group_size`) and logged in one warning line.
    """
    kept, dropped, groups = [], 0, 0
    for group in carry.groups:
        if len(group.members) == group_size:
            kept.append(group)
        elif group.started:
            dropped, groups = dropped + group.started, groups + 1
        else:
            kept.append(CarriedGroup((CarriedConversation(group.members[0].example),) * group_size))
    if dropped:
        log.warning("step %d: dropped %d carried conversation(s) of %d group(s) sampled as groups of another size "
                    "than data.samples_per_prompt = %d", version, dropped, groups, group_size)
    return kept, dropped


def settle(plan: StepPlan, convs: Mapping[int, Conversation], tokenizer, first_group: int, max_staleness: int
           ) -> tuple[list[Trajectory], Carry, dict[str, float]]:
    """The step's trajectories, the carry and the partial metrics (module docstring, 5).

    Args:
      plan: the step's plan.
      convs: position -> the driver's conversation of every position that started; it has ended when its
        `end_reason` is set.
      tokenizer: builds the trajectories (`trajectory.build_trajectory`).
      first_group: the global number of this host's first trained group (its lineage group; a trajectory's tree is
        its global row).
      max_staleness: the histogram's last bucket.
    Returns:
      (P x n trajectories, group after group, in the order taken; the carry; the metrics: the plan's, with
      `partial/carried` (started conversations carried), `partial/carried_groups`, and over the trained tokens
      `partial/staleness_mean`, `partial/staleness_max`, `partial/stale_token_share` (sampled by an older policy)
      and `partial/staleness_<s>` (the share at staleness s, s = 0..max_staleness)).
    """
    n = plan.group_size
    trajectories, carried = [], []
    for g, group in enumerate(plan.groups):
        positions = range(g * n, (g + 1) * n)
        complete = all(p in convs and convs[p].end_reason is not None for p in positions)
        if complete and len(trajectories) < plan.prompts * n:
            group_id = first_group + len(trajectories) // n
            for m, p in enumerate(positions):
                conv = convs[p]
                lineage = Lineage(group_id, group_id * n + m, conv.lineage.key_data)
                trajectories.append(build_trajectory(group.members[m].example, conv.prompt_ids, conv.turns,
                                                     conv.end_reason, tokenizer, lineage))
        else:
            carried.append(CarriedGroup(tuple(
                _carried(member, convs.get(p)) for member, p in zip(group.members, positions))))
    if len(trajectories) < plan.prompts * n:
        raise RuntimeError(f"partial rollout: {len(trajectories) // n} complete groups, {plan.prompts} needed")
    carry = Carry(tuple(carried) + plan.pending)
    return trajectories, carry, {**plan.metrics, **staleness_metrics(trajectories, plan.version, max_staleness),
                                 "partial/carried": float(sum(group.started for group in carried)),
                                 "partial/carried_groups": float(len(carried))}


def staleness_metrics(trajectories: Sequence[Trajectory], version: int, max_staleness: int) -> dict[str, float]:
    """Over the trained (model) tokens of `trajectories` trained at step `version`: the mean and max staleness,
    the share sampled by an older policy and the histogram `partial/staleness_<s>` (s = 0..max_staleness)."""
    tokens = np.zeros(max_staleness + 1, np.int64)  # trained tokens by staleness
    for trajectory in trajectories:
        for turn in trajectory.turns:
            tokens[version - turn.version] += len(turn.token_ids)
    shares = tokens / max(int(tokens.sum()), 1)
    present = np.flatnonzero(tokens)
    metrics = {"partial/staleness_mean": float(np.arange(max_staleness + 1) @ shares),
               "partial/staleness_max": float(present[-1]) if len(present) else 0.0,
               "partial/stale_token_share": float(shares[1:].sum())}
    metrics.update({f"partial/staleness_{s}": float(shares[s]) for s in range(max_staleness + 1)})
    return metrics


def _carried(member: CarriedConversation, conv: Optional[Conversation]) -> CarriedConversation:
    """`member` after this step: as it was when it did not start (conv None), else the conversation's record."""
    if conv is None:
        return member
    return CarriedConversation(member.example, conv.lineage.key_data, tuple(conv.prompt_ids), tuple(conv.turns),
                               conv.end_reason)


def _member_to_json(member: CarriedConversation) -> dict[str, Any]:
    return dataclasses.asdict(member)  # the example, each turn and its action as dicts


def _member_from_json(record: Mapping[str, Any]) -> CarriedConversation:
    example = dict(record["example"])
    example["golden_answers"] = tuple(example["golden_answers"])
    turns = []
    for turn in record["turns"]:
        turn = dict(turn)
        turn.update(token_ids=tuple(int(t) for t in turn["token_ids"]),
                    logps=tuple(float(np.float32(x)) for x in turn["logps"]),
                    observation_ids=tuple(int(t) for t in turn["observation_ids"]), action=Action(**turn["action"]))
        turns.append(Turn(**turn))
    key = record["key_data"]
    return CarriedConversation(QAExample(**example), None if key is None else (int(key[0]), int(key[1])),
                               tuple(int(t) for t in record["prompt_ids"]), tuple(turns), record["end_reason"])
