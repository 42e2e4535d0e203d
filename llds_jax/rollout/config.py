"""The rollout's settings: the multi-turn protocol's limits (`AgentConfig`, llds_jax.rollout.agent) and how the
sampler draws tokens (`SamplingConfig`, llds_jax.rollout.sampler).

Plain Python (no JAX): `llds_jax.config` builds these from a run config without loading JAX.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class AgentConfig:
    """The multi-turn protocol's limits (Search-R1 defaults).

    Attributes:
      max_turns: turns whose search is executed; one final turn (search not executed) follows.
      max_turn_tokens: new tokens per turn.
      max_observation_tokens: observation tokens kept (the first ones).
      max_prompt_tokens: the prompt keeps its last this many tokens.
      max_context_tokens: cap on prompt + response tokens of a sequence.
      max_response_tokens: cap on response tokens (model and observation) of a sequence.
      retrieval_top_k: documents per search.
      search_timeout_s: timeout of one batched retriever call.
      max_batch_size: sequences per sampler session (0: all at once); larger inputs run in several sessions.
      continuous_batching: instead of sessions that run their rows turn by turn, one device batch of
        max_batch_size rows (0: all sequences) that sequences enter and leave between any two decode chunks, each
        row on its own turn (`llds_jax.rollout.continuous`); needs `sampler.Sampler`. The same tokens are sampled.
    """

    max_turns: int = 3
    max_turn_tokens: int = 500
    max_observation_tokens: int = 500
    max_prompt_tokens: int = 2048
    max_context_tokens: int = 4096
    max_response_tokens: int = 4096
    retrieval_top_k: int = 3
    search_timeout_s: float = 60.0
    max_batch_size: int = 0
    continuous_batching: bool = False

    def __post_init__(self):
        positive = ("max_turn_tokens", "max_observation_tokens", "max_prompt_tokens", "max_context_tokens",
                    "max_response_tokens", "retrieval_top_k")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"agent.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_turns < 0:
            raise ValueError(f"agent.max_turns must be >= 0, got {self.max_turns}")
        if self.max_batch_size < 0:
            raise ValueError(f"agent.max_batch_size must be >= 0 (0: all), got {self.max_batch_size}")
        if not self.search_timeout_s > 0:
            raise ValueError(f"agent.search_timeout_s must be > 0, got {self.search_timeout_s}")
        if self.max_prompt_tokens >= self.max_context_tokens:
            raise ValueError(f"agent.max_prompt_tokens ({self.max_prompt_tokens}) must be below "
                             f"agent.max_context_tokens ({self.max_context_tokens})")


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How tokens are drawn and how the decode loop is shaped.

    Attributes:
      temperature: logits are divided by it before sampling (and for the reported log-probs); > 0.
      top_p: nucleus sampling mass in (0, 1]; 1 disables it. Without top_k it sorts the whole vocabulary every
        step; with top_k only the k candidates are sorted.
      top_k: sample among the k most likely tokens; 0 disables it.
      greedy: take the argmax (temperature, top_p, top_k ignored; log-probs at temperature 1).
      stop_ids: token ids that end a row's turn (EOS); the stop token itself is returned with the turn.
      decode_chunk: decode steps per device call between host checks of the turn text.
      min_prompt_bucket, min_capacity_bucket, min_observation_bucket, min_batch_bucket: smallest buckets.
      compact: move the unfinished rows into a smaller batch bucket when enough rows have finished.
      max_extend_rows: continuous batching: the most rows one extend call appends to (prompts or observations;
        more go in several calls), a power of two; 0: any number. Such a call holds its rows' cache beside the
        batch's (a pod's 128-row batch cannot hold a second copy: docs/tpu.md).
      shared_prompt_prefill: a session's prefill encodes each distinct prompt once and copies its cache to every
        row that holds it (a GRPO group's samples share their prompt: n times less prefill compute); the rows
        sample as they would otherwise. Sessions only: continuous batching appends prompts row by row, without it.
    """

    temperature: float = 1.0
    top_p: float = 0.95
    top_k: int = 0
    greedy: bool = False
    stop_ids: tuple[int, ...] = ()
    decode_chunk: int = 32
    min_prompt_bucket: int = 16
    min_capacity_bucket: int = 128
    min_observation_bucket: int = 16
    min_batch_bucket: int = 1
    compact: bool = True
    max_extend_rows: int = 0
    shared_prompt_prefill: bool = False

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"sampling.temperature must be > 0 (use sampling.greedy for argmax), got "
                             f"{self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"sampling.top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.decode_chunk < 1:
            raise ValueError(f"sampling.decode_chunk must be >= 1, got {self.decode_chunk}")
        for name in ("min_prompt_bucket", "min_capacity_bucket", "min_observation_bucket", "min_batch_bucket"):
            if getattr(self, name) < 1:
                raise ValueError(f"sampling.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_extend_rows < 0 or self.max_extend_rows & (self.max_extend_rows - 1):
            raise ValueError(f"rollout.max_extend_rows must be 0 (any) or a power of two, got {self.max_extend_rows}")
        object.__setattr__(self, "stop_ids", tuple(int(i) for i in self.stop_ids))
