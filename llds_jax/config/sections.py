"""Every run-config key, declared once: one frozen dataclass per section (`llds_jax.bounds.Section`), each field with
its default, its range or choices and a one-line doc (`bounds.field`), the section's own rules in its `__post_init__`,
and `RunConfig`, the whole config with the rules across sections.

The components take their sections as they are (`ObjectiveConfig`, `UpdateConfig` and `SFTConfig`, with the fields
the run sets on them: `ObjectiveConfig.temperature`, `UpdateConfig.warmup_steps`, the warm start's prompt cut, chunk
and seed) or through views that take a key's declaration (`bounds.same`: `llds_jax.rollout.config`'s `AgentConfig`,
`SamplingConfig` and `PagingConfig`; `llds_jax.model.config.ModelConfig`'s numerics). A field that names an
implementation (a loss term, an advantage estimator, a gate, an answer weighting, a KL estimator, an aggregation)
keeps the name only: the implementations' `llds_jax.registry.Registry` is its set of choices, checked by
`llds_jax.checks`.

Plain Python on the lowest floors (it imports only leaves): no JAX.
"""
from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Mapping
from typing import Any

from llds_jax import bounds
from llds_jax.bounds import (AT_LEAST_1, MOMENTUM, NON_NEGATIVE, POSITIVE, PROBABILITY_MASS, UNIT_INTERVAL,
                             ConfigError, Range, field, same, section)
from llds_jax.data.rewards import DEFAULT_EMPTY_ANSWER, EMPTY_ANSWER_RULES

ATTENTION_CHOICES = ("auto", "xla", "blockwise", "splash", "cudnn")  # model.attention: llds_jax.model.attention
MODEL_DTYPES = ("float32", "bfloat16", "float16")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# "": no fallback: the tokenizer's own template, or none (the raw Search-R1 prompt). A Qwen2.5 fallback applies only
# to a tokenizer with Qwen2.5's chat markers (llds_jax.model.tokenizer.load_tokenizer).
CHAT_TEMPLATES = ("base", "instruct", "")
TREE_SELECTIONS = ("uniform", "entropy")
CONTEXT_POLICIES = ("none", "drop_observations")  # rollout.context_policy: llds_jax.rollout.context
ROLLOUT_PARAMS_DTYPES = ("float32", "bfloat16")
REFERENCE_DTYPES = ("float32", "bfloat16")
DEFAULT_INDEX_DIR = "indexes/wiki18_bm25"  # retriever.index_dir
DEFAULT_TIME_CHUNK = 256  # time steps per log-prob chunk (llds_jax.rl.logprobs)


def tree_leaves(trees: int, tree_rounds: int, tree_forks: int) -> int:
    """Trajectories a prompt's trees give: M x (1 + L x N) (M trees, L rounds, N forks); 0 without trees."""
    return trees * (1 + tree_rounds * tree_forks)


def pool_pages(sequences: int, max_context_tokens: int, page_size: int) -> int:
    """Pages of a paged KV pool (llds_jax.rollout.pages) that holds `sequences` sequences of `max_context_tokens`
    tokens each in pages of `page_size` slots, beside the padding page: what the rollout engine reserves."""
    return sequences * -(-max_context_tokens // page_size) + 1


@dataclasses.dataclass(frozen=True)
class ModelRunConfig(bounds.Section):
    """The run config's `model` section: the checkpoint a run starts from and how the run computes with it (the
    architecture is the checkpoint's, `ModelConfig`)."""

    SECTION = "model"

    path: str = field("", doc="Hugging Face checkpoint folder (local or gs://)")
    tokenizer_path: str = field("", doc="the tokenizer's folder (\"\": model.path)")
    chat_template: str = field("base", choices=CHAT_TEMPLATES,
                               doc="the shipped Qwen2.5 template (base / instruct) a Qwen tokenizer without one "
                                   "gets (\"\": none)")
    dtype: str = field("bfloat16", choices=MODEL_DTYPES, doc="compute dtype of the matmuls (norms, softmax, "
                                                             "log-softmax and RoPE stay float32)")
    param_dtype: str = field("float32", choices=MODEL_DTYPES, doc="storage dtype of the parameters (master weights)")
    scan_layers: bool = field(True, doc="run the layer stack with lax.scan (compile time independent of depth)")
    remat: bool = field(True, doc="rematerialize each decoder block in the backward pass")
    attention: str = field("auto", choices=ATTENTION_CHOICES,
                           doc="the full forwards' attention: auto / xla (dense) / blockwise (online softmax) / "
                               "splash (TPU) / cudnn (GPU)")
    attention_query_block: int = field(512, AT_LEAST_1, doc="largest blockwise tile's queries (splash: its block, "
                                                            "x 128)")
    attention_key_block: int = field(512, AT_LEAST_1, doc="largest blockwise tile's keys (splash: its block, x 128)")
    mlp_chunks: int = field(1, AT_LEAST_1, doc="the MLP runs over this many slices of its width in turn (1: all at "
                                               "once)")
    preset: str = field("", doc="a named architecture (model.PRESETS): --mode=compile reads no checkpoint; a run "
                                "checks the checkpoint against it")


@dataclasses.dataclass(frozen=True)
class MeshConfig(bounds.Section):
    """The `mesh` section: the training device mesh (llds_jax.parallel)."""

    SECTION = "mesh"

    data: int = field(1, doc="data-parallel axis")
    fsdp: int = field(-1, doc="fully sharded data-parallel axis (-1: the rest of the devices)")
    tensor: int = field(1, doc="tensor-parallel axis")
    topology: str = field("", doc="the run's TPU slice (e.g. v4:2x2x4): what --mode=compile compiles for")


@dataclasses.dataclass(frozen=True)
class DistributedConfig(bounds.Section):
    """The `distributed` section: a multi-process job without TPU auto-detection (TPU pods are detected)."""

    SECTION = "distributed"

    coordinator_address: str = field("", doc="the coordinator's host:port, e.g. 10.0.0.2:1234")
    num_processes: int = field(0, NON_NEGATIVE, doc="processes of the job (0: detected)")
    process_id: int = field(-1, Range(lambda v: v >= -1, ">= 0 (or -1: detected)"),
                            doc="this process's index (-1: detected)")


@dataclasses.dataclass(frozen=True)
class DataConfig(bounds.Section):
    """The `data` section. File lists are tuples: on the command line comma-separated paths, repeated flags or a
    tuple literal (llds_jax.config.loader); a config file may assign a list."""

    SECTION = "data"

    train_files: tuple[str, ...] = field(("data/nq_hotpotqa_train/train.parquet",),
                                         doc="training questions (Search-R1 parquet or JSONL)")
    eval_files: tuple[str, ...] = field(("data/nq_hotpotqa_train/test.parquet",), doc="evaluation questions")
    prompts_per_step: int = field(512, AT_LEAST_1, doc="prompts per training step (P)")
    samples_per_prompt: int = field(5, AT_LEAST_1, doc="samples per prompt (n, the GRPO group size)")


@dataclasses.dataclass(frozen=True)
class RewardConfig(bounds.Section):
    """The `reward` section (llds_jax.data.rewards)."""

    SECTION = "reward"

    empty_answer: str = field(DEFAULT_EMPTY_ANSWER, choices=EMPTY_ANSWER_RULES,
                              doc="an answer that normalizes to nothing: search_r1 scores it by exact match (the "
                                  "paper's code), zero never rewards it (and skips such QA rows)")
    functions: tuple[str, ...] = field(("exact_match",), doc="the training rewards by name (llds_jax.train.rewards."
                                       "REWARDS; an application registers its own), summed; with several, each "
                                       "one's batch mean is logged as reward/ and its name")


@dataclasses.dataclass(frozen=True)
class RetrieverConfig(bounds.Section):
    """The `retriever` section: the backend and its index; the other keys are the backend's options, which each
    backend declares beside its code and checks (llds_jax.search.options; the README has a block per backend)."""

    SECTION = "retriever"

    backend: str = field("bm25", doc="bm25 / faiss / e5_device / elasticsearch / http")
    index_dir: str = field(DEFAULT_INDEX_DIR, doc="the index folder (local or gs://)")
    # Every key but `backend` as the run config gives it (a read-only mapping; a backend without an index folder
    # leaves out index_dir), typed and checked by llds_jax.search.options.resolve, which `given()` feeds.
    options: Mapping[str, Any] = dataclasses.field(
        default_factory=lambda: types.MappingProxyType({"index_dir": DEFAULT_INDEX_DIR}))

    def __post_init__(self):
        super().__post_init__()
        if self.options.get("index_dir", self.index_dir) != self.index_dir:
            raise ConfigError(f"retriever.index_dir ({self.index_dir!r}) and the options' "
                              f"({self.options['index_dir']!r}) differ: give it in `options`, as the run config does")

    def given(self) -> dict[str, Any]:
        """The section as the run config gives it: the backend and its options."""
        return {"backend": self.backend, **self.options}


@dataclasses.dataclass(frozen=True)
class RolloutConfig(bounds.Section):
    """The `rollout` section: the agent loop's limits (Search-R1 defaults), sampling, the paged engine and tree
    rollouts (Tree-GRPO; rollout/tree.py, docs/tree-rollouts.md)."""

    SECTION = "rollout"

    max_turns: int = field(3, NON_NEGATIVE, doc="turns whose search is executed; one final turn (no search) follows")
    max_turn_tokens: int = field(500, AT_LEAST_1, doc="new tokens per turn")
    max_observation_tokens: int = field(500, AT_LEAST_1, doc="observation tokens kept (the first ones)")
    max_prompt_tokens: int = field(2048, AT_LEAST_1, doc="a prompt's most tokens (below max_context_tokens), in "
                                   "the rollout and in SFT (protocol.fit_prompt): an over-long question loses its "
                                   "start, never the instruction or the template (counted in rollout/prompts_cut; a "
                                   "ValueError when they alone are longer); questions are cut to their last 2 x "
                                   "this x 128 characters as they are read")
    max_context_tokens: int = field(4096, AT_LEAST_1, doc="cap on a sequence's prompt + response tokens")
    max_response_tokens: int = field(4096, AT_LEAST_1,
                                     doc="cap on a sequence's response tokens (model and observations) in its context")
    max_trajectory_tokens: int = field(0, NON_NEGATIVE, doc="cap on a conversation's kept model + observation tokens "
                                                            "over all its segments (ends it: end/trajectory_budget; "
                                                            "0: none beside the context caps)")
    context_policy: str = field("none", choices=CONTEXT_POLICIES,
                                doc="how the context is edited between turns: none, or drop_observations (all but the "
                                    "last keep_observations information blocks replaced by a marker; "
                                    "rollout/context.py)")
    keep_observations: int = field(2, AT_LEAST_1, doc="with context_policy drop_observations: the information blocks "
                                                      "kept whole (K)")
    retrieval_top_k: int = field(3, AT_LEAST_1, doc="documents per search")
    search_timeout_s: float = field(60.0, POSITIVE, doc="timeout of one batched retriever call")
    max_batch_size: int = field(0, NON_NEGATIVE, doc="sequences per sampler session and the engine's sequence "
                                                     "slots (0: the host's whole rollout batch)")
    temperature: float = field(1.0, POSITIVE, doc="logits are divided by it before sampling and for every log-prob")
    top_p: float = field(0.95, PROBABILITY_MASS, doc="nucleus sampling mass (1: off); among the top_k with top_k")
    top_k: int = field(0, NON_NEGATIVE, doc="sample among the k most likely tokens (0: off)")
    decode_chunk: int = field(32, AT_LEAST_1, doc="decode steps per device call between host checks of the turn")
    page_size: int = field(16, AT_LEAST_1, doc="token slots per page of the paged KV cache")
    max_step_tokens: int = field(512, AT_LEAST_1, doc="the most tokens one engine step's ragged batch holds (step "
                                                      "programs compiled at the sequence slots doubling up to it)")
    num_pages: int = field(0, NON_NEGATIVE, doc="pages in the pool (0: every sequence slot's worst case)")
    kv_pages_per_block: int = field(0, NON_NEGATIVE, doc="pages of keys per block of the paged attention (the TPU "
                                                         "kernel's tile) in a step's ragged forward above the slots' "
                                                         "bucket (0: its default)")
    queries_per_block: int = field(0, NON_NEGATIVE, doc="query tokens per block there (0: its default)")
    decode_kv_pages_per_block: int = field(0, NON_NEGATIVE, doc="pages of keys per block of the paged attention in "
                                                                "decode iterations and the slots' bucket (0: its "
                                                                "default)")
    decode_queries_per_block: int = field(0, NON_NEGATIVE, doc="query tokens per block there (0: its default)")
    params_dtype: str = field("float32", choices=ROLLOUT_PARAMS_DTYPES,
                              doc="the rollout's copy of the params, cast once per step (no wider than "
                                  "model.param_dtype)")
    tensor_parallel: int = field(0, Range(lambda v: v >= -1, ">= 1 (or -1: all of a host's chips, 0: the "
                                                             "training layout)"),
                                 doc="chips splitting the rollout copy's heads and MLP (-1: a host's; 0: training's "
                                     "layout; llds_jax/rollout/layout.py)")
    continuous_batching: bool = field(False, doc="a sequence enters as soon as the engine has a slot for it "
                                                 "(policy continuous, rollout/driver.py); same tokens")
    compile_grid: bool = field(True, doc="after the first rollout, compile the step program at every token bucket")
    search_failure_rate: float = field(0.5, UNIT_INTERVAL, doc="a step whose searches failed more often than this "
                                                               "is a failing step")
    max_failed_search_steps: int = field(3, NON_NEGATIVE, doc="failing steps in a row that end the run (saved; 0: "
                                                              "never)")
    trees: int = field(0, NON_NEGATIVE, doc="each prompt's group grows as this many trees (M; 0: chains); "
                                            "data.samples_per_prompt = M x (1 + L x N)")
    tree_rounds: int = field(1, AT_LEAST_1, doc="expansion rounds of each tree (L)")
    tree_forks: int = field(1, AT_LEAST_1, doc="agent-step boundaries each tree forks at per round (N)")
    tree_select: str = field("uniform", choices=TREE_SELECTIONS,
                             doc="how a round picks its forks: uniform (Tree-GRPO) or entropy (ARPO-like)")
    tree_entropy_tokens: int = field(8, AT_LEAST_1, doc="first sampled tokens after a node that score it for "
                                                        "entropy")
    partial: bool = field(False, doc="partial rollouts: train a step's first complete groups, carry the rest "
                                     "(needs objective.tis_cap; docs/partial-rollouts.md)")
    over_sampling: float = field(2.0, Range(lambda v: v >= 1, ">= 1"),
                                 doc="with partial: groups started per step, ceil(over_sampling x the step's prompts)")
    max_staleness: int = field(1, NON_NEGATIVE, doc="with partial: policy versions a carried group may lag before "
                                                    "it is dropped (counted)")

    def __post_init__(self):
        super().__post_init__()
        group = tree_leaves(self.trees, self.tree_rounds, self.tree_forks)
        if self.trees and self.continuous_batching:
            raise ConfigError("rollout.trees needs turn-synchronous sessions: set rollout.continuous_batching False")
        if self.trees and self.max_batch_size % group:
            raise ConfigError(f"rollout.max_batch_size ({self.max_batch_size}) must be a multiple of a prompt's "
                              f"tree leaves rollout.trees x (1 + rollout.tree_rounds x rollout.tree_forks) = "
                              f"{group}: a session holds whole trees")
        if self.max_prompt_tokens >= self.max_context_tokens:
            raise ConfigError(f"rollout.max_prompt_tokens ({self.max_prompt_tokens}) must be below "
                              f"rollout.max_context_tokens ({self.max_context_tokens})")
        if self.partial and self.trees:
            raise ConfigError("rollout.partial carries chains, not trees: set rollout.trees 0 or rollout.partial False")
        if self.context_policy != "none" and (self.partial or self.trees):
            raise ConfigError(f"rollout.context_policy {self.context_policy!r} edits a conversation's context, which "
                              "rollout.partial and rollout.trees do not carry: set rollout.context_policy none")
        one = pool_pages(1, self.max_context_tokens, self.page_size)
        if 0 < self.num_pages < one:
            raise ConfigError(f"rollout.num_pages ({self.num_pages}) cannot hold one sequence of "
                              f"rollout.max_context_tokens ({self.max_context_tokens}): it needs at least {one} pages "
                              f"({one - 1} of rollout.page_size {self.page_size} slots and the padding page; 0: sized "
                              "to fit)")


@dataclasses.dataclass(frozen=True)
class LLDSConfig(bounds.Section):
    """The `objective.llds` section: the likelihood-preserving regularizer. Answer weighting (LLDS-MA) on the final
    answer span: "fixed" (beta = answer_beta); "adaptive" (code: beta = adaptive_c * max(V - 1, 0), V = mean search
    actions per trajectory of the rollout batch); "adaptive_paper" (beta = min(V / 2, 1) * lam); answer tokens get
    w = min(beta, lam) (`llds_jax.rl.llds.ANSWER_WEIGHTINGS`)."""

    SECTION = "objective.llds"

    enabled: bool = field(True, doc="add the LLDS term to the loss")
    variant: str = field("llds", doc="the registered loss term that implements it (llds_jax.rl.terms.LOSS_TERMS)")
    lam: float = field(0.2, NON_NEGATIVE, doc="lambda, the weight w on gated tokens (0.3 for Qwen2.5-7B-Instruct)")
    gate: str = field("action", doc="the tokens it holds: action (net delta over the token's action > 0), response "
                                    "(over the trajectory) or token")
    answer_weighting: str = field("none", doc="LLDS-MA on the final answer: none / fixed / adaptive / "
                                              "adaptive_paper")
    answer_beta: float = field(0.05, NON_NEGATIVE, doc="beta of answer_weighting fixed (the paper's v1: 0.05)")
    adaptive_c: float = field(0.2, NON_NEGATIVE, doc="c of answer_weighting adaptive")


@dataclasses.dataclass(frozen=True)
class ObjectiveConfig(bounds.Section):
    """The `objective` section: the per-micro-batch loss `L = pg - entropy_coef * ent + kl_coef * kl + llds`.

    Attributes:
      temperature: the rollout temperature (`rollout.temperature`); all log-probs use logits / temperature.
    """

    SECTION = "objective"

    advantages: str = field("grpo", doc="grpo (rewards normalized in each prompt's group) or tree_grpo (and in "
                                        "each tree; the same on chains)")
    clip_ratio: float = field(0.2, NON_NEGATIVE, doc="PPO clip epsilon: the ratio is clipped to [1 - eps, 1 + eps]")
    clip_ratio_high: float = field(0.0, Range(lambda v: v >= 0, ">= 0 (0: objective.clip_ratio)"),
                                   doc="upper clip epsilon, DAPO's clip-higher (0: clip_ratio, symmetric)")
    ratio_cap: float = field(100.0, Range(lambda v: v > 1, "> 1"), doc="the ratio exp(logp - old_logp) is capped "
                                                                       "at this (the reference code's 100)")
    tis_cap: float = field(0.0, Range(lambda v: v == 0 or v >= 1, "0 (off) or >= 1"),
                           doc="truncated importance sampling (verl): each token's policy loss times the frozen "
                               "min(exp(old_logp - sampler_logp), tis_cap); 0: off")
    entropy_coef: float = field(0.001, NON_NEGATIVE, doc="weight of the entropy bonus (subtracted)")
    kl_coef: float = field(0.001, NON_NEGATIVE, doc="weight of the KL to the reference model (0: no term)")
    kl_estimator: str = field("low_var_kl", doc="low_var_kl (k3) / k1 / abs / mse (llds_jax.rl.losses)")
    kl_clamp: float = field(10.0, POSITIVE, doc="k3 values are clipped to [-kl_clamp, kl_clamp]")
    aggregation: str = field("token-mean", doc="token-mean (over the micro-batch's loss tokens) or "
                                               "seq-mean-token-mean (paper Eq. 1); every term")
    llds: LLDSConfig = section(LLDSConfig, doc="the LLDS regularizer")
    temperature: float = same(RolloutConfig, "temperature")

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.llds, LLDSConfig):
            raise TypeError(f"objective.llds must be an LLDSConfig; got {type(self.llds).__name__}")

    def clip_range(self) -> tuple[float, float]:
        """(low, high) bounds of the clipped ratio: 1 - clip_ratio, 1 + (clip_ratio_high, or clip_ratio when 0)."""
        return 1.0 - self.clip_ratio, 1.0 + (self.clip_ratio_high or self.clip_ratio)

    def weighted_terms(self) -> tuple[tuple[str, float], ...]:
        """(registered term name, coefficient) pairs whose weighted sum is the loss; zero-weight terms are left out."""
        terms = [("policy", 1.0)]
        if self.entropy_coef:
            terms.append(("entropy", -self.entropy_coef))
        if self.kl_coef:
            terms.append(("kl", self.kl_coef))
        if self.llds.enabled:
            terms.append((self.llds.variant, 1.0))
        return tuple(terms)


@dataclasses.dataclass(frozen=True)
class UpdateConfig(bounds.Section):
    """The `optim` section: how a rollout batch becomes optimizer updates (defaults: the paper's code).

    Attributes:
      warmup_steps: rollout batches of linear warmup from 0 (0: constant learning rate), which the update's
        schedule takes: a run's is optim.warmup_ratio x train.total_steps (`RunConfig`).
    """

    SECTION = "optim"

    mini_batch_size: int = field(256, AT_LEAST_1, doc="trajectories per optimizer update (10 updates per "
                                                      "2560-trajectory batch)")
    micro_batch_size: int = field(16, AT_LEAST_1, doc="trajectories per gradient-accumulation micro-batch (on a "
                                                      "mesh, a multiple of data x fsdp)")
    learning_rate: float = field(1e-6, POSITIVE, doc="base learning rate, reached after warmup")
    warmup_ratio: float = field(0.285, UNIT_INTERVAL, doc="linear warmup from 0 over this share of "
                                                          "train.total_steps")
    max_grad_norm: float = field(1.0, POSITIVE, doc="global gradient norm clip")
    adam_b1: float = field(0.9, MOMENTUM, doc="AdamW beta1")
    adam_b2: float = field(0.999, MOMENTUM, doc="AdamW beta2")
    adam_eps: float = field(1e-8, POSITIVE, doc="AdamW epsilon")
    weight_decay: float = field(0.01, NON_NEGATIVE, doc="AdamW weight decay")
    logp_time_chunk: int = field(DEFAULT_TIME_CHUNK, AT_LEAST_1, doc="time steps per log-prob chunk (peak logits "
                                                                     "memory: micro_batch x chunk x V float32)")
    reference_dtype: str = field("bfloat16", choices=REFERENCE_DTYPES,
                                 doc="storage dtype of the frozen reference parameters")
    pack_trajectories: bool = field(True, doc="the forwards run on each micro-batch's trajectories packed into "
                                              "fewer rows (rl/packing.py; same results, less padding)")
    pack_row_tokens: int = field(0, NON_NEGATIVE, doc="a packed row's length in tokens (0: the batch length)")
    precompile_row_counts: bool = field(True, doc="the first batch of a length compiles the forwards of every "
                                                  "packed-row count its updates can need")
    max_skipped_updates: int = field(20, NON_NEGATIVE, doc="updates skipped in a row (non-finite loss or "
                                                           "gradient) that end a run; 0: never")
    warmup_steps: int = 0

    def __post_init__(self):
        super().__post_init__()
        if self.mini_batch_size % self.micro_batch_size:
            raise ConfigError(f"optim.micro_batch_size ({self.micro_batch_size}) must divide "
                              f"optim.mini_batch_size ({self.mini_batch_size})")


@dataclasses.dataclass(frozen=True)
class TrainConfig(bounds.Section):
    """The `train` section: the training loop's schedule."""

    SECTION = "train"

    total_steps: int = field(1005, AT_LEAST_1, doc="training steps (rollout batches)")
    checkpoint_every: int = field(20, AT_LEAST_1, doc="steps between checkpoints")
    keep_checkpoints: int = field(3, AT_LEAST_1, doc="checkpoints kept")
    lld_every: int = field(10, NON_NEGATIVE, doc="post-update Delta_traj / LLD rate every k steps (one extra "
                                                 "forward; 0: never)")
    eval_every: int = field(50, NON_NEGATIVE, doc="steps between periodic evaluations (the paper's schedule; 0: "
                                                  "none)")
    eval_max_examples: int = field(512, NON_NEGATIVE, doc="a periodic evaluation's fixed subset, equal shares per "
                                                          "data_source (0: all)")
    transcripts_every: int = field(20, NON_NEGATIVE, doc="steps between TensorBoard text summaries of transcripts")
    num_transcripts: int = field(2, NON_NEGATIVE, doc="transcripts per summary")
    final_eval: bool = field(True, doc="evaluate data.eval_files (eval.max_examples) when training ends")
    sequence_bucket: int = field(256, AT_LEAST_1, doc="training batches are padded to a multiple of this many "
                                                      "tokens")
    eval_at_start: bool = field(False, doc="evaluate the starting policy (eval.max_examples) before step 1")
    stop_within_step: bool = field(True, doc="a stop signal ends the step between sessions / updates and saves the "
                                             "state from before it (docs/reliability.md)")
    storage_timeout_s: float = field(120.0, POSITIVE, doc="a checkpoint or metrics write or read that takes longer "
                                                          "ends the run (exit 2)")
    hooks: tuple[str, ...] = field((), doc="what else runs after each step, by name, in order "
                                           "(llds_jax.train.step_hooks.STEP_HOOKS; an application registers its "
                                           "own): after the evaluation, before the metrics record")


@dataclasses.dataclass(frozen=True)
class SFTConfig(bounds.Section):
    """The `sft` section; cached by its settings (`llds_jax.sft.stage.fingerprint`).

    Attributes:
      max_prompt_tokens: a prompt's most tokens, its question cut from the start, as in the rollout
        (`rollout.max_prompt_tokens`).
      logp_time_chunk: time chunk of the log-probs (`optim.logp_time_chunk`).
      seed: data order (the run's `seed`, which `RunConfig` sets).
    """

    SECTION = "sft"

    enabled: bool = field(False, doc="run the warm start before RL; its output becomes model.path")
    data_files: tuple[str, ...] = field((), doc="demonstration JSONL files (llds_jax.sft.demonstrations; the demo "
                                                "fills in its own)")
    curriculum_files: tuple[str, ...] = field((), doc="the demonstrations of the first curriculum_steps (the "
                                                      "demo: its searching ones)")
    curriculum_steps: int = field(0, NON_NEGATIVE, doc="steps drawn from curriculum_files first, part of steps "
                                                       "(0: no curriculum)")
    output_dir: str = field("", doc="the warm-started Hugging Face folder (weights + tokenizer); \"\": "
                                    "<run_dir>/warm_start")
    steps: int = field(200, AT_LEAST_1, doc="optimizer steps")
    batch_size: int = field(32, AT_LEAST_1, doc="demonstrations per step")
    learning_rate: float = field(1e-3, POSITIVE, doc="AdamW peak learning rate (linear warmup, then cosine decay "
                                                     "to a tenth)")
    warmup_steps: int = field(10, NON_NEGATIVE, doc="steps of the linear warmup")
    weight_decay: float = field(0.0, NON_NEGATIVE, doc="AdamW weight decay")
    max_grad_norm: float = field(1.0, POSITIVE, doc="global-norm gradient clipping")
    max_length: int = field(1024, AT_LEAST_1, doc="longer demonstrations (in tokens) are skipped and counted")
    sequence_bucket: int = field(64, AT_LEAST_1, doc="batches are padded to a multiple of this many tokens")
    min_score: float = field(-1.0, doc="skip records scored below this (< 0: keep all)")
    log_every: int = field(20, AT_LEAST_1, doc="steps between progress lines")
    max_prompt_tokens: int = same(RolloutConfig, "max_prompt_tokens")
    logp_time_chunk: int = same(UpdateConfig, "logp_time_chunk")
    seed: int = 0

    def __post_init__(self):
        super().__post_init__()
        for key in ("warmup_steps", "curriculum_steps"):
            if getattr(self, key) > self.steps:
                raise ConfigError(f"sft.{key} ({getattr(self, key)}) must be at most sft.steps ({self.steps})")

    def check_runnable(self) -> None:
        """What the warm start needs once the run is prepared (an application may fill the files in): its
        demonstrations, its output folder and, with a curriculum, the curriculum's files."""
        if not self.data_files:
            raise ConfigError("sft.data_files lists no demonstration files")
        if not self.output_dir:
            raise ConfigError("sft.output_dir must be set")
        if self.curriculum_steps and not self.curriculum_files:
            raise ConfigError(f"sft.curriculum_steps={self.curriculum_steps} but sft.curriculum_files is empty")


@dataclasses.dataclass(frozen=True)
class EvalConfig(bounds.Section):
    """The `eval` section: evaluation rollouts (greedy)."""

    SECTION = "eval"

    max_turns: int = field(4, NON_NEGATIVE, doc="turns with search of an evaluation rollout")
    max_examples: int = field(0, NON_NEGATIVE, doc="0: every example of data.eval_files; else a fixed stratified "
                                                   "subset")
    batch_size: int = field(256, AT_LEAST_1, doc="questions per rollout call")


@dataclasses.dataclass(frozen=True)
class RunConfig(bounds.Section):
    """A whole run config, typed: the top-level keys, one field per section and the rules across sections. Its
    defaults are the paper's (docs/method.md): GRPO + LLDS as the reference code runs it.

    The fields of its sections that are the run's (`run_owned`: `objective.temperature` = rollout.temperature,
    `optim.warmup_steps` = optim.warmup_ratio x train.total_steps rounded down, and the warm start's prompt cut,
    log-prob chunk and seed = rollout.max_prompt_tokens, optim.logp_time_chunk, seed) are set when it is built:
    build one with `RunConfig.of(...)` (or `replaced`), which sets them; the constructor refuses sections whose
    run-owned fields disagree. Derived values are its properties, each computed here alone.
    """

    run_dir: str = field("runs/default", doc="local folder or gs://bucket/path: checkpoints, events, metrics, config")
    seed: int = field(0, NON_NEGATIVE, doc="the data order, sampling, the demo's world and model")
    app: str = field("", doc="an application's module (llds_jax.application; e.g. llds_jax.apps.demo); \"\": none")
    compilation_cache_dir: str = field("", doc="JAX's persistent compilation cache (local or gs://); \"\": JAX's own "
                                               "setting (docs/gcs.md)")
    model: ModelRunConfig = section(ModelRunConfig, doc="the checkpoint and the run's numerics")
    mesh: MeshConfig = section(MeshConfig, doc="the device mesh")
    distributed: DistributedConfig = section(DistributedConfig, doc="the job's processes")
    data: DataConfig = section(DataConfig, doc="questions and the step's size")
    reward: RewardConfig = section(RewardConfig, doc="the reward")
    retriever: RetrieverConfig = section(RetrieverConfig, doc="the search backend")
    rollout: RolloutConfig = section(RolloutConfig, doc="the agent loop, sampling, the engine")
    objective: ObjectiveConfig = section(ObjectiveConfig, doc="the loss")
    optim: UpdateConfig = section(UpdateConfig, doc="the updates")
    train: TrainConfig = section(TrainConfig, doc="the training loop")
    sft: SFTConfig = section(SFTConfig, doc="the supervised warm start (llds_jax.sft)")
    eval: EvalConfig = section(EvalConfig, doc="evaluation")

    def __post_init__(self):
        super().__post_init__()
        if not self.run_dir:
            raise ConfigError("run_dir must be set")
        r, o = self.rollout, self.optim
        if DTYPE_BYTES[r.params_dtype] > DTYPE_BYTES[self.model.param_dtype]:
            raise ConfigError(f"rollout.params_dtype ({r.params_dtype!r}) must not be wider than model.param_dtype "
                              f"({self.model.param_dtype!r}): the rollout's copy would take more memory than the "
                              "params")
        leaves = tree_leaves(r.trees, r.tree_rounds, r.tree_forks)
        if r.trees and self.data.samples_per_prompt != leaves:
            raise ConfigError(f"data.samples_per_prompt ({self.data.samples_per_prompt}) must equal the leaves of a "
                              f"prompt's trees, rollout.trees x (1 + rollout.tree_rounds x rollout.tree_forks) = "
                              f"{leaves}")
        if r.partial and not self.objective.tis_cap:
            raise ConfigError("rollout.partial trains tokens sampled by older policies: set objective.tis_cap > 0 (e.g. "
                              "2.0), the truncated weight exp(old_logp - sampler_logp) that corrects for their "
                              "behaviour policy")
        if r.context_policy != "none" and not o.pack_trajectories:
            raise ConfigError(f"rollout.context_policy {r.context_policy!r} trains each segment as a sequence of its "
                              "own in packed rows: set optim.pack_trajectories true")
        batch = self.data.prompts_per_step * self.data.samples_per_prompt
        if batch % o.mini_batch_size:
            raise ConfigError(f"optim.mini_batch_size ({o.mini_batch_size}) must divide the rollout batch "
                              f"data.prompts_per_step x data.samples_per_prompt = {batch}")
        for name, want in run_owned(self).items():
            if getattr(self, name) != want:
                raise ConfigError(f"{name}: its run-owned fields must be the run's (build the config with "
                                  "RunConfig.of or RunConfig.replaced, which set them)")

    @classmethod
    def of(cls, **fields: Any) -> RunConfig:
        """The run config of `fields` (sections at their defaults where left out), its sections' run-owned fields
        set from the run's keys."""
        draft = dict(_default_fields(cls), **fields)
        return cls(**{**draft, **run_owned(types.SimpleNamespace(**draft))})

    def replaced(self, **changes: Any) -> RunConfig:
        """This config with some fields (whole sections) replaced, the run-owned fields set again."""
        return RunConfig.of(**{**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}, **changes})

    @property
    def rollout_batch_size(self) -> int:
        """Trajectories per training step: data.prompts_per_step x data.samples_per_prompt."""
        return self.data.prompts_per_step * self.data.samples_per_prompt

    @property
    def updates_per_step(self) -> int:
        """Optimizer updates per training step: the rollout batch in mini-batches of optim.mini_batch_size."""
        return self.rollout_batch_size // self.optim.mini_batch_size

    def rollout_sequences(self, process_count: int = 1) -> int:
        """Conversations one host's rollout starts per step: its share of the batch, or with rollout.partial
        ceil(rollout.over_sampling x its prompts) groups' worth."""
        prompts = self.data.prompts_per_step // process_count
        if self.rollout.partial:
            prompts = math.ceil(self.rollout.over_sampling * prompts)
        return prompts * self.data.samples_per_prompt

    def engine_slots(self, sequences: int) -> int:
        """Sequence slots of an engine that runs `sequences` conversations: rollout.max_batch_size caps them
        (0: no cap)."""
        return min(sequences, self.rollout.max_batch_size or sequences)


def _default_fields(cls: type) -> dict[str, Any]:
    return {f.name: f.default_factory() if f.default is dataclasses.MISSING else f.default
            for f in dataclasses.fields(cls)}


def run_owned(run: Any) -> dict[str, Any]:
    """The sections of `run` (a RunConfig, or its fields as attributes) with their run-owned fields set from the
    run's keys: objective, optim and sft."""
    r, o = run.rollout, run.optim
    return {
        "objective": dataclasses.replace(run.objective, temperature=r.temperature),
        "optim": dataclasses.replace(o, warmup_steps=int(math.floor(o.warmup_ratio * run.train.total_steps))),
        "sft": dataclasses.replace(run.sft, max_prompt_tokens=r.max_prompt_tokens,
                                   logp_time_chunk=o.logp_time_chunk, seed=run.seed),
    }
