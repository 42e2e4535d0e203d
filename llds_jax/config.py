"""Run configuration: the paper's code-exact defaults, schema validation, and typed views for each component.

`default_config()` is the schema: a run config may change values, never add keys (except retriever options,
which `llds_jax.search.factory` validates per backend, and the sections of the application its `app` key names,
llds_jax.application) or change a value's type.

On the lowest floors of the package: it imports only leaves and the typed views' plain dataclasses
(llds_jax.rl.config, llds_jax.rollout.config, llds_jax.sft.config, which import only the leaf llds_jax.bounds), whose
defaults are the schema's and whose fields declare their keys' ranges and choices, so importing it loads no JAX.
`check` covers what this module knows; `llds_jax.checks` (above the components) validates a whole run config
against them.
"""
from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import ml_collections

from llds_jax import bounds
from llds_jax.runtime import redaction
from llds_jax.bounds import ConfigError
from llds_jax.data.rewards import DEFAULT_EMPTY_ANSWER, EMPTY_ANSWER_RULES
from llds_jax.rl.config import LLDSConfig, ObjectiveConfig, UpdateConfig
from llds_jax.rollout.config import AgentConfig, PagingConfig, PartialConfig, SamplingConfig
from llds_jax.sft.config import SFTConfig


def default_config() -> ml_collections.ConfigDict:
    """Paper defaults (docs/method.md): GRPO + LLDS as the reference code runs it."""
    c = ml_collections.ConfigDict()
    c.run_dir = "runs/default"          # local folder or gs://bucket/path: checkpoints, events, metrics, config
    c.seed = 0                          # >= 0: the data order, sampling, the demo's world and model
    c.app = ""                          # an application's module (llds_jax.application; e.g. llds_jax.apps.demo)
    c.compilation_cache_dir = ""        # JAX's persistent compilation cache (local or gs://): a resumed or later run
    #                                     reads its programs back instead of compiling them; "" leaves JAX's own
    #                                     setting (the JAX_COMPILATION_CACHE_DIR environment variable)

    c.model = ml_collections.ConfigDict()
    c.model.path = ""                   # Hugging Face checkpoint folder (local or gs://)
    c.model.tokenizer_path = ""         # defaults to model.path
    c.model.chat_template = "base"      # shipped Qwen2.5 template used when a Qwen tokenizer has none
    c.model.dtype = "bfloat16"          # compute dtype
    c.model.param_dtype = "float32"     # master weights
    c.model.scan_layers = True
    c.model.remat = True
    c.model.attention = "auto"          # auto / xla (dense) / blockwise (online softmax) / splash (TPU) / cudnn (GPU)
    c.model.attention_query_block = 512  # largest blockwise tile (splash: its block, x 128): queries ...
    c.model.attention_key_block = 512   # ... x keys
    c.model.mlp_chunks = 1              # the MLP over this many slices of its width in turn (1: all at once)
    c.model.preset = ""                 # named architecture (model.PRESETS): --mode=compile reads no checkpoint

    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = 1
    c.mesh.fsdp = -1                    # -1: the rest of the devices
    c.mesh.tensor = 1
    c.mesh.topology = ""                # TPU slice of the run (e.g. v4:2x2x4): what --mode=compile compiles for

    c.distributed = ml_collections.ConfigDict()
    c.distributed.coordinator_address = ""   # multi-process without TPU auto-detection, e.g. "10.0.0.2:1234"
    c.distributed.num_processes = 0
    c.distributed.process_id = -1

    c.data = ml_collections.ConfigDict()
    # File lists are tuples: on the command line comma-separated paths
    # (`--config.data.train_files=a.parquet,b.parquet`), repeated flags or a tuple literal (llds_jax.launch); a config
    # file may still assign a list.
    c.data.train_files = ("data/nq_hotpotqa_train/train.parquet",)
    c.data.eval_files = ("data/nq_hotpotqa_train/test.parquet",)
    c.data.prompts_per_step = 512       # P
    c.data.samples_per_prompt = 5       # n: GRPO group size

    c.reward = ml_collections.ConfigDict()
    # an answer that normalizes to nothing ("a", "The."): "search_r1" scores it by exact match, as the paper's code
    # (1 against a gold answer that normalizes to nothing too; such QA rows are kept); "zero" never rewards it
    # (and skips those rows)
    c.reward.empty_answer = DEFAULT_EMPTY_ANSWER

    c.retriever = ml_collections.ConfigDict()
    c.retriever.backend = "bm25"
    c.retriever.index_dir = "indexes/wiki18_bm25"

    c.rollout = ml_collections.ConfigDict()
    c.rollout.max_turns = AgentConfig.max_turns  # turns with search; one final turn follows
    c.rollout.max_turn_tokens = AgentConfig.max_turn_tokens
    c.rollout.max_observation_tokens = AgentConfig.max_observation_tokens
    c.rollout.max_prompt_tokens = AgentConfig.max_prompt_tokens
    c.rollout.max_context_tokens = AgentConfig.max_context_tokens
    c.rollout.max_response_tokens = AgentConfig.max_response_tokens
    c.rollout.retrieval_top_k = AgentConfig.retrieval_top_k
    c.rollout.search_timeout_s = AgentConfig.search_timeout_s
    c.rollout.max_batch_size = AgentConfig.max_batch_size  # sequences per sampler session (0: the whole rollout batch)
    c.rollout.temperature = SamplingConfig.temperature
    c.rollout.top_p = SamplingConfig.top_p
    c.rollout.top_k = SamplingConfig.top_k
    c.rollout.decode_chunk = SamplingConfig.decode_chunk
    c.rollout.page_size = PagingConfig.page_size  # token slots per page of the rollout's paged KV cache
    c.rollout.max_step_tokens = PagingConfig.max_step_tokens  # the most tokens one step's ragged batch holds
    c.rollout.num_pages = PagingConfig.num_pages  # pages in the pool (0: every sequence's worst case)
    c.rollout.params_dtype = "float32"  # the rollout's copy of the params (cast once per step): float32 / bfloat16
    c.rollout.tensor_parallel = 0       # chips splitting the rollout copy's heads and MLP (-1: a host's; 0: training's)
    # a sequence enters as soon as the engine has a slot for it (policy "continuous", rollout/driver.py)
    c.rollout.continuous_batching = AgentConfig.continuous_batching
    c.rollout.compile_grid = True       # after the first rollout, compile the step program at every token bucket
    c.rollout.search_failure_rate = 0.5  # a step whose searches failed more often than this is a failing step ...
    c.rollout.max_failed_search_steps = 3  # ... and this many in a row end the run (saved; 0: never)
    # Tree rollouts (Tree-GRPO; rollout/tree.py, docs/tree-rollouts.md): each prompt's group grows as `trees` trees
    # (0: chains), each forked at `tree_forks` agent-step boundaries in each of `tree_rounds` rounds, the forks
    # copied in the KV cache: data.samples_per_prompt must be trees x (1 + tree_rounds x tree_forks).
    c.rollout.trees = AgentConfig.trees
    c.rollout.tree_rounds = AgentConfig.tree_rounds
    c.rollout.tree_forks = AgentConfig.tree_forks
    c.rollout.tree_select = AgentConfig.tree_select  # "uniform" (Tree-GRPO) or "entropy" (ARPO-like)
    c.rollout.tree_entropy_tokens = AgentConfig.tree_entropy_tokens  # first tokens after a node that score it
    # ----- partial rollouts (issue 59; rollout/partial.py, docs/partial-rollouts.md): start
    # ceil(over_sampling x prompts) groups, train the first complete ones, carry the rest (needs objective.tis_cap > 0);
    # a carried group whose oldest turn lags more than max_staleness policy versions is dropped (counted, logged).
    c.rollout.partial = PartialConfig.partial
    c.rollout.over_sampling = PartialConfig.over_sampling
    c.rollout.max_staleness = PartialConfig.max_staleness
    # ----- end of partial rollouts

    c.objective = ml_collections.ConfigDict()
    # "grpo": rewards normalized within each prompt's group; "tree_grpo": plus within each tree of a tree rollout
    # (Tree-GRPO; llds_jax.rl.advantages). Chains are trees of one leaf, for which both are the same.
    c.objective.advantages = "grpo"
    c.objective.clip_ratio = ObjectiveConfig.clip_ratio
    c.objective.clip_ratio_high = ObjectiveConfig.clip_ratio_high  # upper clip (DAPO clip-higher); 0: clip_ratio
    c.objective.ratio_cap = ObjectiveConfig.ratio_cap
    # cap of the sampler -> trainer importance weight on the policy loss (verl's TIS); 0: off, else >= 1
    c.objective.tis_cap = ObjectiveConfig.tis_cap
    c.objective.entropy_coef = ObjectiveConfig.entropy_coef
    c.objective.kl_coef = ObjectiveConfig.kl_coef
    c.objective.kl_estimator = ObjectiveConfig.kl_estimator
    c.objective.kl_clamp = ObjectiveConfig.kl_clamp
    c.objective.aggregation = ObjectiveConfig.aggregation
    c.objective.llds = ml_collections.ConfigDict()
    c.objective.llds.enabled = LLDSConfig.enabled
    c.objective.llds.variant = LLDSConfig.variant
    c.objective.llds.lam = LLDSConfig.lam
    c.objective.llds.gate = LLDSConfig.gate
    c.objective.llds.answer_weighting = LLDSConfig.answer_weighting
    c.objective.llds.answer_beta = LLDSConfig.answer_beta
    c.objective.llds.adaptive_c = LLDSConfig.adaptive_c

    c.optim = ml_collections.ConfigDict()
    # trajectories per optimizer update (10 updates per 2560-trajectory batch)
    c.optim.mini_batch_size = UpdateConfig.mini_batch_size
    c.optim.micro_batch_size = UpdateConfig.micro_batch_size
    c.optim.learning_rate = UpdateConfig.learning_rate
    c.optim.warmup_ratio = 0.285       # of train.total_steps
    c.optim.max_grad_norm = UpdateConfig.max_grad_norm
    c.optim.adam_b1 = UpdateConfig.adam_b1
    c.optim.adam_b2 = UpdateConfig.adam_b2
    c.optim.adam_eps = UpdateConfig.adam_eps
    c.optim.weight_decay = UpdateConfig.weight_decay
    c.optim.logp_time_chunk = UpdateConfig.logp_time_chunk
    c.optim.reference_dtype = UpdateConfig.reference_dtype
    # forwards on each micro-batch's trajectories packed into fewer rows
    c.optim.pack_trajectories = UpdateConfig.pack_trajectories
    # packed rows' length; 0: the batch length (its longest trajectory)
    c.optim.pack_row_tokens = UpdateConfig.pack_row_tokens
    # a new batch length compiles every packed-row count ahead
    c.optim.precompile_row_counts = UpdateConfig.precompile_row_counts
    c.optim.max_skipped_updates = 20    # updates skipped in a row (non-finite loss/gradient) that end a run; 0: never

    c.train = ml_collections.ConfigDict()
    c.train.total_steps = 1005
    c.train.checkpoint_every = 20
    c.train.keep_checkpoints = 3
    c.train.lld_every = 10              # post-update Delta_traj / LLD rate every k steps (one extra forward)
    c.train.eval_every = 50             # the paper's schedule (its checkpoints chosen by these); 0: none
    c.train.eval_max_examples = 512     # periodic evaluation: a fixed subset, equal shares per data_source; 0: all
    c.train.transcripts_every = 20      # TensorBoard text summaries of a few transcripts
    c.train.num_transcripts = 2
    c.train.final_eval = True           # evaluate data.eval_files (eval.max_examples) when training ends
    c.train.sequence_bucket = 256       # training batches are padded to a multiple of this many tokens
    c.train.eval_at_start = False       # evaluate the starting policy (eval.max_examples) before step 1
    c.train.stop_within_step = True     # a stop signal ends the step between sessions / updates and saves the state
                                        # from before it (kept in host memory: params + optimizer state)
    c.train.storage_timeout_s = 120.0   # a checkpoint/metrics write or read that takes longer ends the run (exit 2)

    c.sft = ml_collections.ConfigDict()    # supervised warm start before RL (llds_jax.sft); cached by settings
    c.sft.enabled = False
    c.sft.data_files = ()               # demonstration JSONL files (the demo fills in its own)
    # the first curriculum_steps draw from these (the demo: its searching ones)
    c.sft.curriculum_files = SFTConfig.curriculum_files
    c.sft.curriculum_steps = SFTConfig.curriculum_steps  # part of sft.steps; 0: no curriculum
    c.sft.output_dir = ""               # default <run_dir>/warm_start; becomes model.path for RL
    c.sft.steps = SFTConfig.steps
    c.sft.batch_size = SFTConfig.batch_size
    c.sft.learning_rate = SFTConfig.learning_rate
    c.sft.warmup_steps = SFTConfig.warmup_steps
    c.sft.weight_decay = SFTConfig.weight_decay
    c.sft.max_grad_norm = SFTConfig.max_grad_norm
    c.sft.max_length = SFTConfig.max_length  # longer demonstrations are skipped (counted)
    c.sft.sequence_bucket = SFTConfig.sequence_bucket
    c.sft.min_score = SFTConfig.min_score  # skip records scored below this; < 0: keep all
    c.sft.log_every = SFTConfig.log_every

    c.eval = ml_collections.ConfigDict()
    c.eval.max_turns = 4
    c.eval.max_examples = 0             # 0: every example of data.eval_files; else a fixed stratified subset
    c.eval.batch_size = 256             # questions per rollout call
    return c


_FREE_FORM = ("retriever",)  # sub-configs whose keys depend on a choice inside them


def _type_name(value: Any) -> str:
    return type(value).__name__


def schema(app: Any = None) -> ml_collections.ConfigDict:
    """The schema of a run config: `default_config()` and the sections of its application (`app`: the module
    `llds_jax.application.load` returns for the config's `app` key; None: no application)."""
    c = default_config()
    if app is not None:
        for name, section in app.config_sections().items():
            if name in c:
                raise ConfigError(f"app {app.__name__!r} declares the config section {name!r}, which is the "
                                  f"library's")
            c[name] = section
    return c


# Keys a run config may still set from an older release, and why they went (said in the unknown-key error).
_PAGED_ONLY = "the paged engine is now the only rollout engine"
REMOVED_KEYS = {
    "rollout.engine": _PAGED_ONLY,
    "rollout.min_capacity_bucket": f"{_PAGED_ONLY} (its pool: rollout.num_pages, rollout.page_size)",
    "rollout.min_observation_bucket": f"{_PAGED_ONLY} (observations go in its ragged steps: rollout.max_step_tokens)",
    "rollout.reuse_buckets": f"{_PAGED_ONLY}: its step programs are compiled once per token bucket "
                             "(rollout.compile_grid)",
    "rollout.extend_chunk": f"{_PAGED_ONLY} (observations go in its ragged steps: rollout.max_step_tokens)",
    "rollout.cache_block": f"{_PAGED_ONLY}: its attention reads a sequence's pages alone",
    "rollout.max_extend_rows": f"{_PAGED_ONLY} (observations go in its ragged steps: rollout.max_step_tokens)",
    "rollout.shared_prompt_prefill": f"{_PAGED_ONLY}: a GRPO group's samples share their prompt's pages",
}


def check_schema(cfg: ml_collections.ConfigDict, schema: ml_collections.ConfigDict | None = None,
                 prefix: str = "") -> None:
    """Raises ConfigError for a key the schema lacks or a value of another type (an int is a valid float)."""
    schema = default_config() if schema is None else schema
    for key, value in cfg.items():
        name = f"{prefix}{key}"
        if key not in schema:
            if name in REMOVED_KEYS:
                raise ConfigError(f"unknown config key {name!r}: removed, {REMOVED_KEYS[name]}")
            raise ConfigError(f"unknown config key {name!r} (known at this level: {', '.join(sorted(schema))})")
        expected = schema[key]
        if isinstance(expected, ml_collections.ConfigDict):
            if not isinstance(value, ml_collections.ConfigDict):
                raise ConfigError(f"config key {name!r} must be a section, got {_type_name(value)}")
            if key not in _FREE_FORM or prefix:
                check_schema(value, expected, name + ".")
            continue
        if isinstance(expected, (list, tuple)):  # the schema's only sequences are file lists
            if not (isinstance(value, (list, tuple)) and all(isinstance(path, str) for path in value)):
                raise ConfigError(f"{name} must be a tuple of paths (str), got {value!r}")
            continue
        ok = isinstance(value, type(expected)) or (isinstance(expected, float) and isinstance(value, int)
                                                    and not isinstance(value, bool))
        if not ok or (isinstance(value, bool) != isinstance(expected, bool)):
            raise ConfigError(f"config key {name!r} must be {_type_name(expected)}, got {_type_name(value)} "
                              f"{value!r}")


# Words of a key whose value is a secret ("es_password", "access_token", ...); "key" only after api/access/private.
_SECRET_WORDS = frozenset({"password", "passwd", "secret", "token", "apikey", "credential", "credentials", "auth"})
_KEY_QUALIFIERS = frozenset({"api", "access", "private"})
REDACTED = redaction.REDACTED


def _is_secret_key(key: str) -> bool:
    words = set(re.split(r"[^a-z0-9]+", key.lower()))
    return bool(words & _SECRET_WORDS) or ("key" in words and bool(words & _KEY_QUALIFIERS))


def _redact(key: str, value: Any) -> Any:
    if isinstance(value, (ml_collections.ConfigDict, dict)):
        return {k: _redact(k, v) for k, v in value.items()}
    if _is_secret_key(key) and value not in (None, "", (), []):
        return REDACTED
    if isinstance(value, str):
        return redaction.redact(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_redact(key, v) for v in value)
    return value


def redacted(cfg: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """A copy of `cfg` safe to print or save: the user info of every URL in a string value (also inside lists, e.g.
    `retriever.hosts = "https://elastic:PASSWORD@host:9200"`; a password may hold unencoded `/ # ? @ :` and
    spaces, `llds_jax.redaction`) becomes `***@`, and the value of every key named like
    a secret (password, token, secret, api_key, credentials, auth, ...) becomes `***`."""
    return ml_collections.ConfigDict(_redact("", cfg))


def redacted_argument(arg: str) -> str:
    """A command-line argument safe to print or log, as `redacted` makes a config: in `KEY=VALUE` (e.g.
    `--config.retriever.password=...`) the value of a key named like a secret becomes `***`, and the user info of
    any URL becomes `***@`."""
    key, sep, value = arg.partition("=")
    if sep and value and _is_secret_key(key):
        return f"{key}={REDACTED}"
    return redaction.redact(arg)


def summary(cfg: ml_collections.ConfigDict) -> str:
    """A few lines on what a run of `cfg` trains (secrets redacted): where, the model, the data and the step, the
    objective, the retriever. The whole config goes to the run folder's config.json."""
    c = redacted(cfg)
    llds = c.objective.llds
    objective = (f"GRPO + LLDS (lambda {llds.lam:g}, {llds.gate} gate)" if llds.enabled else "GRPO (LLDS off)")
    retriever = ", ".join(f"{k} {v}" for k, v in c.retriever.items() if k != "backend" and v not in ("", None, ()))
    r = c.rollout
    trees = (f" ({r.trees} tree(s) x (1 + {r.tree_rounds} x {r.tree_forks}) leaves, {r.tree_select} forks)"
             if r.trees else "")
    return "\n".join([
        f"run {c.run_dir} (seed {c.seed}{', app ' + c.app if c.app else ''}); the whole config: "
        "<run_dir>/config.json, or --print_config",
        f"  model {c.model.preset or c.model.path} in {c.model.param_dtype} (compute {c.model.dtype})",
        f"  step: {c.data.prompts_per_step} prompts x {c.data.samples_per_prompt} samples{trees}, "
        f"{updates_per_step(cfg)} update(s) of {c.optim.mini_batch_size} at lr {c.optim.learning_rate:g}; "
        f"{c.train.total_steps} steps",
        f"  objective {objective}, KL {c.objective.kl_coef:g}, advantages {c.objective.advantages}",
        f"  retriever {c.retriever.backend}{' (' + retriever + ')' if retriever else ''}",
    ])


def rollout_batch_size(cfg: ml_collections.ConfigDict) -> int:
    """Trajectories per training step: prompts_per_step x samples_per_prompt."""
    return cfg.data.prompts_per_step * cfg.data.samples_per_prompt


def updates_per_step(cfg: ml_collections.ConfigDict) -> int:
    return rollout_batch_size(cfg) // cfg.optim.mini_batch_size


MODEL_DTYPES = ("float32", "bfloat16", "float16")
ROLLOUT_PARAMS_DTYPES = ("float32", "bfloat16")
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# "": no fallback: the tokenizer's own template, or none (the raw Search-R1 prompt). A Qwen2.5 fallback applies only
# to a tokenizer with Qwen2.5's chat markers (llds_jax.tokenizer.load_tokenizer).
CHAT_TEMPLATES = ("base", "instruct", "")

# The typed views whose fields declare their own run keys' ranges and choices (llds_jax.bounds); `check` reads those
# declarations, so each bounded key is declared once: there, or below for the keys of no view.
VIEWS = (AgentConfig, SamplingConfig, PagingConfig, PartialConfig, ObjectiveConfig, LLDSConfig, UpdateConfig,
         SFTConfig)

# (keys, test, what the value must be): the bounds of the keys of no view, which a run would otherwise crash on (or
# fail late) without naming the key. Every bounded number must also be finite.
_BOUNDS: tuple[tuple[tuple[str, ...], Any, str], ...] = (
    (("data.prompts_per_step", "data.samples_per_prompt", "model.attention_query_block", "model.attention_key_block",
      "model.mlp_chunks", "train.total_steps", "train.checkpoint_every", "train.keep_checkpoints",
      "train.sequence_bucket", "eval.batch_size"),
     lambda v: v >= 1, ">= 1"),
    (("seed", "train.lld_every", "train.eval_every", "train.eval_max_examples", "train.transcripts_every",
      "train.num_transcripts", "eval.max_turns", "eval.max_examples", "distributed.num_processes",
      "rollout.max_failed_search_steps", "optim.max_skipped_updates"),
     lambda v: v >= 0, ">= 0"),
    (("train.storage_timeout_s",), lambda v: v > 0, "> 0"),
    (("optim.warmup_ratio", "rollout.search_failure_rate"), lambda v: 0 <= v <= 1, "in [0, 1]"),
    (("distributed.process_id",), lambda v: v >= -1, ">= 0 (or -1: detected)"),
    (("rollout.tensor_parallel",), lambda v: v >= -1, ">= 1 (or -1: all of a host's chips, 0: the training layout)"),
)


# The keys of no view that name one of a fixed set of values this module knows, and those values (the choices that
# components register, loss terms and attention kernels, are checked by llds_jax.checks).
_CHOICES: dict[str, tuple[str, ...]] = {
    "model.dtype": MODEL_DTYPES, "model.param_dtype": MODEL_DTYPES, "model.chat_template": CHAT_TEMPLATES,
    "rollout.params_dtype": ROLLOUT_PARAMS_DTYPES, "reward.empty_answer": EMPTY_ANSWER_RULES}


def check_views(cfg: ml_collections.ConfigDict) -> None:
    """Raises ConfigError naming the key of the first run-config value out of the range or choices a view declares
    for it (llds_jax.bounds)."""
    for view in VIEWS:
        for key, _, rule in bounds.declared(view):
            if has(cfg, key):
                message = bounds.problem(key, value(cfg, key), rule)
                if message:
                    raise ConfigError(message)


def check_choice(cfg: ml_collections.ConfigDict, key: str, choices: Sequence[str]) -> None:
    """Raises ConfigError naming `key` unless its value is one of `choices`."""
    if value(cfg, key) not in choices:
        raise ConfigError(f"{key} must be one of {', '.join(map(repr, choices))}, got {value(cfg, key)!r}")


def value(cfg: ml_collections.ConfigDict, key: str) -> Any:
    """The value of a dotted run-config key ("rollout.top_p")."""
    for part in key.split("."):
        cfg = cfg[part]
    return cfg


def has(cfg: ml_collections.ConfigDict, key: str) -> bool:
    """Whether the dotted key is one of the run config's."""
    for part in key.split("."):
        if not isinstance(cfg, ml_collections.ConfigDict) or part not in cfg:
            return False
        cfg = cfg[part]
    return True


def check_bounds(cfg: ml_collections.ConfigDict, rules: Sequence[tuple[Sequence[str], Any, str]]) -> None:
    """Raises ConfigError naming the key unless every number of `rules` ((keys, test, what it must be), ...) is
    finite and passes its test (the views' checker, `bounds.problem`)."""
    for keys, test, what in rules:
        for key in keys:
            message = bounds.problem(key, value(cfg, key), bounds.Range(test, what))
            if message:
                raise ConfigError(message)


def check(cfg: ml_collections.ConfigDict, app: Any = None) -> None:
    """Schema, bounds, choices and the combinations of this module's keys; each error names the run-config key.

    `app`: the application module the config's `app` key names (`llds_jax.application.load`), whose sections the
    schema accepts and whose own checks run here. The checks against components (loss terms, retriever backends,
    model presets, TPU topologies, the device mesh) are `llds_jax.checks.validate`'s, which loads the application
    and runs this first."""
    if cfg.get("app", "") and app is None:
        raise ConfigError(f"app {cfg.app!r} is set: check the config with llds_jax.checks.validate, which loads it")
    check_schema(cfg, schema(app))
    check_views(cfg)
    check_bounds(cfg, _BOUNDS)
    for key, choices in _CHOICES.items():
        check_choice(cfg, key, choices)
    if app is not None:
        app.check_config(cfg)
    if not cfg.run_dir:
        raise ConfigError("run_dir must be set")
    # An application may set model.path when the run starts (the demo: its generated policy).
    if not cfg.model.path and "model.path" not in (app.provided_keys(cfg) if app is not None else ()):
        raise ConfigError("model.path must name a Hugging Face checkpoint folder")
    r, o = cfg.rollout, cfg.optim
    if _DTYPE_BYTES[r.params_dtype] > _DTYPE_BYTES[cfg.model.param_dtype]:
        raise ConfigError(f"rollout.params_dtype ({r.params_dtype!r}) must not be wider than model.param_dtype "
                          f"({cfg.model.param_dtype!r}): the rollout's copy would take more memory than the params")
    if r.max_prompt_tokens >= r.max_context_tokens:
        raise ConfigError(f"rollout.max_prompt_tokens ({r.max_prompt_tokens}) must be below "
                          f"rollout.max_context_tokens ({r.max_context_tokens})")
    tree_leaves = r.trees * (1 + r.tree_rounds * r.tree_forks)
    if r.trees and cfg.data.samples_per_prompt != tree_leaves:
        raise ConfigError(f"data.samples_per_prompt ({cfg.data.samples_per_prompt}) must equal the leaves of a "
                          f"prompt's trees, rollout.trees x (1 + rollout.tree_rounds x rollout.tree_forks) = "
                          f"{tree_leaves}")
    batch = rollout_batch_size(cfg)
    if batch % o.mini_batch_size:
        raise ConfigError(f"optim.mini_batch_size ({o.mini_batch_size}) must divide the rollout batch "
                          f"data.prompts_per_step x data.samples_per_prompt = {batch}")
    if o.mini_batch_size % o.micro_batch_size:
        raise ConfigError(f"optim.micro_batch_size ({o.micro_batch_size}) must divide optim.mini_batch_size "
                          f"({o.mini_batch_size})")
    try:  # the rollout view's combinations (tree rollouts), named by their run keys
        agent_config(cfg)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    check_partial(cfg)
    for key in ("warmup_steps", "curriculum_steps"):
        if cfg.sft[key] > cfg.sft.steps:
            raise ConfigError(f"sft.{key} ({cfg.sft[key]}) must be at most sft.steps ({cfg.sft.steps})")


# ----- partial rollouts (issue 59) ----------------------------------------------------------------------------------
def check_partial(cfg: ml_collections.ConfigDict) -> None:
    """rollout.partial's combinations: a behaviour correction for its older tokens, and chains (no trees)."""
    r = cfg.rollout
    if not r.partial:
        return
    if not cfg.objective.tis_cap:
        raise ConfigError("rollout.partial trains tokens sampled by older policies: set objective.tis_cap > 0 (e.g. "
                          "2.0), the truncated weight exp(old_logp - sampler_logp) that corrects for their behaviour "
                          "policy")
    if r.trees:
        raise ConfigError("rollout.partial carries chains, not trees: set rollout.trees 0 or rollout.partial False")


def partial_config(cfg: ml_collections.ConfigDict) -> PartialConfig:
    r = cfg.rollout
    return PartialConfig(partial=r.partial, over_sampling=r.over_sampling, max_staleness=r.max_staleness)


def rollout_sequences(cfg: ml_collections.ConfigDict, process_count: int = 1) -> int:
    """Conversations one host's rollout starts per step (its engine's sequence slots without rollout.max_batch_size):
    its share of the batch, or with rollout.partial ceil(rollout.over_sampling x its prompts) groups' worth."""
    prompts = cfg.data.prompts_per_step // process_count
    if cfg.rollout.partial:
        prompts = math.ceil(cfg.rollout.over_sampling * prompts)
    return prompts * cfg.data.samples_per_prompt
# ----- end of partial rollouts


def objective_config(cfg: ml_collections.ConfigDict) -> ObjectiveConfig:
    o = cfg.objective
    return ObjectiveConfig(
        clip_ratio=o.clip_ratio, clip_ratio_high=o.clip_ratio_high, ratio_cap=o.ratio_cap, tis_cap=o.tis_cap,
        entropy_coef=o.entropy_coef, kl_coef=o.kl_coef, kl_estimator=o.kl_estimator, kl_clamp=o.kl_clamp,
        aggregation=o.aggregation,
        temperature=cfg.rollout.temperature, llds=LLDSConfig(**o.llds.to_dict()))


def update_config(cfg: ml_collections.ConfigDict) -> UpdateConfig:
    u = dict(cfg.optim.to_dict())
    u.pop("max_skipped_updates")  # the trainer's watchdog, not the update's
    warmup_steps = int(math.floor(u.pop("warmup_ratio") * cfg.train.total_steps))
    return UpdateConfig(warmup_steps=warmup_steps, **u)


def agent_config(cfg: ml_collections.ConfigDict, evaluation: bool = False) -> AgentConfig:
    r = cfg.rollout
    return AgentConfig(
        max_turns=cfg.eval.max_turns if evaluation else r.max_turns, max_turn_tokens=r.max_turn_tokens,
        max_observation_tokens=r.max_observation_tokens, max_prompt_tokens=r.max_prompt_tokens,
        max_context_tokens=r.max_context_tokens, max_response_tokens=r.max_response_tokens,
        retrieval_top_k=r.retrieval_top_k, search_timeout_s=r.search_timeout_s, max_batch_size=r.max_batch_size,
        continuous_batching=r.continuous_batching, trees=0 if evaluation else r.trees, tree_rounds=r.tree_rounds,
        tree_forks=r.tree_forks, tree_select=r.tree_select, tree_entropy_tokens=r.tree_entropy_tokens)


def paging_config(cfg: ml_collections.ConfigDict) -> PagingConfig:
    r = cfg.rollout
    return PagingConfig(page_size=r.page_size, max_step_tokens=r.max_step_tokens, num_pages=r.num_pages)


def sampling_config(cfg: ml_collections.ConfigDict, stop_ids: tuple[int, ...],
                    evaluation: bool = False) -> SamplingConfig:
    """Training samples at the rollout temperature / top-p / top-k; evaluation is greedy."""
    r = cfg.rollout
    return SamplingConfig(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, greedy=evaluation,
                          stop_ids=stop_ids, decode_chunk=r.decode_chunk)
