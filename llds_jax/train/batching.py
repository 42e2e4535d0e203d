"""A step's trajectories as the training batch: its length, the packed `RolloutBatch` and the global batch of
several hosts.

Segments (`Trajectory.segments`, rollout.context_policy): a segmented batch's row holds its trajectory's segments one
after another (`RolloutBatch.segment_first_bt` says where each begins), each trained as a sequence of its own with
its trajectory's advantage; groups and rewards stay per trajectory. Without segments a row is the trajectory itself.

Lengths: every trajectory is right-padded to the longest one of the step (over every host), rounded up to
`train.sequence_bucket` (`padded_length`, `round_up`), or to a longer length already compiled (`training_length`), so
the log-probs and updates compile once per length. `round_up` also gives the longest training batch that
--mode=compile compiles and the SFT stage's batch lengths.
"""
from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

from llds_jax.rl.batch import RolloutBatch
from llds_jax.rollout.trajectory import Trajectory
from llds_jax.runtime import distributed


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of `multiple` >= n (n >= 0, multiple >= 1)."""
    return -(-n // multiple) * multiple


def row_tokens(trajectory: Trajectory) -> int:
    """The tokens of a trajectory's row: its segments' (the trajectory's own with one segment)."""
    return sum(len(segment.tokens) for segment in trajectory.segments)


def padded_length(trajectories: Sequence[Trajectory], bucket: int) -> int:
    """The longest row (`row_tokens`) of every host, rounded up to a multiple of `bucket` (a collective on several
    hosts: every process calls it at the same point)."""
    return round_up(distributed.largest(max(row_tokens(t) for t in trajectories)), bucket)


def training_length(needed: int, used: set[int]) -> int:
    """The training batch length for `needed` tokens: the smallest length in `used` (compiled already) that fits,
    else `needed` itself (a new length compiles the log-probs and the updates once more)."""
    return min((length for length in used if length >= needed), default=needed)


def padded_batch(trajectories: Sequence[Trajectory], pad_id: int, length: int, segmented: bool = False
                 ) -> RolloutBatch:
    """The trajectories right-padded to `length` tokens (pad_id after the end), each in the GRPO group its lineage
    names (`Lineage.group`), without rewards or advantages. `segmented`: each row holds its trajectory's segments
    and the batch their starts (`segment_first_bt`); else the trajectories themselves (which must have one segment).
    A row longer than `length` is an error."""
    longest = max(row_tokens(t) for t in trajectories)
    if longest > length:
        raise ValueError(f"padded_batch: a trajectory has {longest} tokens, more than length={length}")
    if not segmented and any(len(t.segments) > 1 for t in trajectories):
        raise ValueError("padded_batch: trajectories of several segments need segmented=True")
    num = len(trajectories)
    tokens_bt = np.full((num, length), pad_id, np.int32)
    action_ids_bt = np.full((num, length), -1, np.int32)
    mask_bt, loss_mask_bt, answer_mask_bt, sampler_logp_bt = (np.zeros((num, length), np.float32) for _ in range(4))
    first_bt = np.broadcast_to(np.arange(length, dtype=np.int32), (num, length)).copy()
    for row, t in enumerate(trajectories):
        start = 0
        for segment in t.segments:
            span = slice(start, start + len(segment.tokens))
            tokens_bt[row, span] = segment.tokens
            mask_bt[row, span] = 1
            loss_mask_bt[row, span] = segment.loss_mask
            action_ids_bt[row, span] = segment.action_ids
            answer_mask_bt[row, span] = segment.answer_mask
            sampler_logp_bt[row, span] = segment.sampler_logp
            first_bt[row, span] = start
            start = span.stop
    return RolloutBatch(tokens_bt=tokens_bt, mask_bt=mask_bt, loss_mask_bt=loss_mask_bt, action_ids_bt=action_ids_bt,
                        answer_mask_bt=answer_mask_bt, sampler_logp_bt=sampler_logp_bt,
                        group_b=np.asarray([t.lineage.group for t in trajectories], np.int32),
                        search_count_b=np.asarray([t.num_valid_searches for t in trajectories], np.float32),
                        segment_first_bt=first_bt if segmented else None)


def global_batch(local: RolloutBatch) -> RolloutBatch:
    """Every host's rows of a batch (equal shapes on every host), concatenated in process order, on every host;
    the local batch itself with one process. A collective."""
    if jax.process_count() == 1:
        return local
    return jax.tree.map(np.asarray, multihost_utils.process_allgather(local, tiled=True))


def global_rows(local_b: np.ndarray) -> np.ndarray:
    """Every host's rows of a per-trajectory array (as many on every host), concatenated in process order, on
    every host (as `global_batch` gathers a batch); the array itself with one process. A collective."""
    if jax.process_count() == 1:
        return local_b
    return np.asarray(multihost_utils.process_allgather(local_b, tiled=True))
