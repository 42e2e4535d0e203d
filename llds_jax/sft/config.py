"""The warm start's settings (the run config's `sft` section as `llds_jax.sft.stage` takes it).

Plain Python (no JAX): `llds_jax.config` takes the section's defaults from it.
"""
from __future__ import annotations

import dataclasses

from llds_jax import bounds
from llds_jax.bounds import AT_LEAST_1, NON_NEGATIVE, POSITIVE, field
from llds_jax.bounds import ConfigError


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """Settings of the warm start (the `sft` config section).

    Attributes:
      data_files: demonstration JSONL files (llds_jax.sft.demonstrations).
      curriculum_files: demonstration files of the first `curriculum_steps` steps (empty: no curriculum).
      curriculum_steps: steps drawn from `curriculum_files` before `data_files` (part of `steps`).
      output_dir: where the warm-started Hugging Face folder (weights + tokenizer) goes.
      steps: optimizer steps.
      batch_size: demonstrations per step.
      learning_rate: AdamW peak learning rate (linear warmup, then cosine decay to a tenth).
      warmup_steps: steps of the linear warmup.
      weight_decay: AdamW weight decay.
      max_grad_norm: global-norm gradient clipping.
      max_length: demonstrations longer than this many tokens are skipped (and counted).
      max_prompt_tokens: prompts keep their last this many tokens (as in the rollout).
      sequence_bucket: batches are padded to a multiple of this many tokens.
      min_score: skip records scored below this (< 0: keep all).
      logp_time_chunk: time chunk of the log-probs.
      log_every: steps between progress lines.
      seed: data order.
    """

    SECTION = "sft"  # the run-config section of its fields (llds_jax.bounds)

    data_files: tuple[str, ...]
    output_dir: str
    curriculum_files: tuple[str, ...] = ()
    curriculum_steps: int = field(0, NON_NEGATIVE)
    steps: int = field(200, AT_LEAST_1)
    batch_size: int = field(32, AT_LEAST_1)
    learning_rate: float = field(1e-3, POSITIVE)
    warmup_steps: int = field(10, NON_NEGATIVE)
    weight_decay: float = field(0.0, NON_NEGATIVE)
    max_grad_norm: float = field(1.0, POSITIVE)
    max_length: int = field(1024, AT_LEAST_1)
    max_prompt_tokens: int = field(2048, AT_LEAST_1)
    sequence_bucket: int = field(64, AT_LEAST_1)
    min_score: float = -1.0
    logp_time_chunk: int = field(256, AT_LEAST_1)
    log_every: int = field(20, AT_LEAST_1)
    seed: int = 0

    def __post_init__(self):
        if not self.data_files:
            raise ConfigError("sft.data_files lists no demonstration files")
        if not self.output_dir:
            raise ConfigError("sft.output_dir must be set")
        bounds.check(self)
        for key in ("warmup_steps", "curriculum_steps"):
            if getattr(self, key) > self.steps:
                raise ConfigError(f"sft.{key} ({getattr(self, key)}) must be at most sft.steps ({self.steps})")
        if self.curriculum_steps and not self.curriculum_files:
            raise ConfigError(f"sft.curriculum_steps={self.curriculum_steps} but sft.curriculum_files is empty")
