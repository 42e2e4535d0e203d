"""The rollout batch: one typed value that flows rollout -> rewards -> advantages -> update.

The trainer packs a step's trajectories into a `RolloutBatch` (host numpy arrays: B trajectories, T tokens, left or
right padding), sets its rewards (`with_rewards`: the trainer's reward functions summed, exact match by default),
then its GRPO advantages (`with_advantages`), and the train step checks it (`checked`) and lays it out on the
device(s) for its updates as a `LaidOutBatch` (llds_jax/rl/batch_layout.py: the same fields as [updates U,
micro-batches X, micro, ...] arrays). A RolloutBatch is a JAX pytree: under jit, a micro-batch of the updates is one
(and `jax.lax.scan` takes the X micro-batches of an update as one of [X, micro, ...] arrays).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RolloutBatch:
    """B trajectories of T tokens (per-token arrays `_bt`, per-trajectory arrays `_b`; numpy or jax arrays).

    Attributes:
      tokens_bt: int32 [B, T] prompt + model turns + observations + padding.
      mask_bt: float32 [B, T] attention mask, 1 on real tokens.
      loss_mask_bt: float32 [B, T] 1 on model-generated tokens (whose log-probs are trained); column 0 is 0 (the
        log-prob of token t comes from the hidden state at t - 1).
      action_ids_bt: int32 [B, T] 0-based model turn (action) of each loss token, -1 elsewhere.
      answer_mask_bt: float32 [B, T] 1 on the final `<answer>...</answer>` span's model tokens.
      sampler_logp_bt: float32 [B, T] the sampler's log-probs of model tokens, 0 elsewhere (for the sampler/trainer
        gap metric and, with objective.tis_cap > 0, the truncated importance weights of the policy loss).
      group_b: int32 [B] the GRPO group (prompt) of each trajectory, unique over the whole batch.
      search_count_b: float32 [B] `<search>` actions per trajectory.
      rewards_b: float32 [B] outcome reward (a trajectory is "correct" when it is > 0); None until `with_rewards`.
      advantages_b: float32 [B] per-trajectory advantages; None until `with_advantages`.
      segment_first_bt: int32 [B, T] for a trajectory of several segments (`rollout.context`: each the sequence the
        model saw while it sampled, trained as a sequence of its own), the row's segments one after another and, for
        each token, the index in the row of its segment's first token (on padding: the token's own index); None:
        every row is one sequence (rollout.context_policy none).
    """

    tokens_bt: Any
    mask_bt: Any
    loss_mask_bt: Any
    action_ids_bt: Any
    answer_mask_bt: Any
    sampler_logp_bt: Any
    group_b: Any
    search_count_b: Any
    rewards_b: Optional[Any] = None
    advantages_b: Optional[Any] = None
    segment_first_bt: Optional[Any] = None

    @classmethod
    def zeros(cls, num: int, length: int) -> RolloutBatch:
        """A batch of `num` all-padding trajectories of `length` tokens, rewards and advantages 0 (its arrays have
        the shapes and dtypes of a checked batch: e.g. to ask what a function of a batch returns)."""
        return cls(**{name: np.zeros((num, length) if name.endswith("_bt") else (num,), dtype)
                      for name, dtype in _DTYPES.items() if name != "segment_first_bt"})

    @property
    def num_trajectories(self) -> int:
        """B (the leading axis)."""
        return self.tokens_bt.shape[0]

    def with_rewards(self, rewards_b: Any) -> RolloutBatch:
        """This batch with its [B] outcome rewards."""
        return dataclasses.replace(self, rewards_b=rewards_b)

    def with_advantages(self, advantages_b: Any) -> RolloutBatch:
        """This batch with its [B] advantages."""
        return dataclasses.replace(self, advantages_b=advantages_b)

    def checked(self) -> RolloutBatch:
        """The batch as host numpy arrays of the documented dtypes, after checking shapes and masks; errors name the
        field (`batch.<field>`)."""
        arrays = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        for name in ("rewards_b", "advantages_b"):
            if arrays[name] is None:
                raise ValueError(f"batch.{name} is not set: the trainer sets rewards, then advantages, before the "
                                 "updates (RolloutBatch.with_rewards / with_advantages)")
        tokens_bt = np.asarray(arrays["tokens_bt"])
        if tokens_bt.ndim != 2:
            raise ValueError(f"batch.tokens_bt must be [B, T]; got shape {tokens_bt.shape}")
        out = {}
        for name, value in arrays.items():
            if value is None:  # segment_first_bt of a batch without segments
                out[name] = None
                continue
            out[name] = np.asarray(value).astype(_DTYPES[name])
            shape = tokens_bt.shape if name.endswith("_bt") else tokens_bt.shape[:1]
            if out[name].shape != shape:
                raise ValueError(f"batch.{name} must have shape {shape}; got {out[name].shape}")
        if np.any(out["loss_mask_bt"][:, 0]):
            raise ValueError("batch.loss_mask_bt[:, 0] must be 0: the first token has no prediction")
        if np.any((out["loss_mask_bt"] > 0) & (out["mask_bt"] == 0)):
            raise ValueError("batch.loss_mask_bt is 1 where batch.mask_bt is 0 (a loss token on padding)")
        return RolloutBatch(**out)


_DTYPES = {
    "tokens_bt": np.int32, "mask_bt": np.float32, "loss_mask_bt": np.float32, "action_ids_bt": np.int32,
    "answer_mask_bt": np.float32, "sampler_logp_bt": np.float32, "group_b": np.int32, "search_count_b": np.float32,
    "rewards_b": np.float32, "advantages_b": np.float32, "segment_first_bt": np.int32,
}


def batch_dtype(name: str) -> np.dtype:
    """The dtype of field `name` of a checked batch."""
    return np.dtype(_DTYPES[name])
