"""The warm start's settings (the run config's `sft` section as `llds_jax.sft.stage` takes it).

Plain Python (no JAX): `llds_jax.config` takes the section's defaults from it.
"""
from __future__ import annotations

import dataclasses


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

    data_files: tuple[str, ...]
    output_dir: str
    curriculum_files: tuple[str, ...] = ()
    curriculum_steps: int = 0
    steps: int = 200
    batch_size: int = 32
    learning_rate: float = 1e-3
    warmup_steps: int = 10
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    max_length: int = 1024
    max_prompt_tokens: int = 2048
    sequence_bucket: int = 64
    min_score: float = -1.0
    logp_time_chunk: int = 256
    log_every: int = 20
    seed: int = 0

    def __post_init__(self):
        if not self.data_files:
            raise ValueError("sft.data_files lists no demonstration files")
        if not self.output_dir:
            raise ValueError("sft.output_dir must be set")
        for name in ("steps", "batch_size", "max_length", "max_prompt_tokens", "sequence_bucket",
                     "logp_time_chunk", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"sft.{name} must be >= 1, got {getattr(self, name)}")
        if not self.learning_rate > 0:
            raise ValueError(f"sft.learning_rate must be > 0, got {self.learning_rate}")
        if not 0 <= self.warmup_steps <= self.steps:
            raise ValueError(f"sft.warmup_steps must be in [0, sft.steps], got {self.warmup_steps}")
        if not 0 <= self.curriculum_steps <= self.steps:
            raise ValueError(f"sft.curriculum_steps must be in [0, sft.steps], got {self.curriculum_steps}")
        if self.curriculum_steps and not self.curriculum_files:
            raise ValueError(f"sft.curriculum_steps={self.curriculum_steps} but sft.curriculum_files is empty")
