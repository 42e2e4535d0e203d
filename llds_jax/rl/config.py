"""Coefficients of the per-micro-batch objective (GRPO + KL + entropy + LLDS) and how a rollout batch becomes
optimizer updates; defaults = the reference code.

See docs/method.md. Every field is validated at construction with an error naming the run key; a field's range
or choices are declared with it (llds_jax.bounds). A field that names an implementation (a loss term, an advantage
estimator, a gate, an answer weighting, a KL estimator, an aggregation) keeps the name only: the implementations'
`llds_jax.registry.Registry` is its set of choices, checked by `llds_jax.checks`. Plain Python (no JAX):
`llds_jax.config` builds these from a run config without loading JAX.
"""
import dataclasses

from llds_jax import bounds
from llds_jax.bounds import AT_LEAST_1, MOMENTUM, NON_NEGATIVE, POSITIVE, ConfigError, Range, field

REFERENCE_DTYPES = ("float32", "bfloat16")
DEFAULT_TIME_CHUNK = 256  # time steps per log-prob chunk (llds_jax.rl.logprobs)


@dataclasses.dataclass(frozen=True)
class LLDSConfig:
    """The likelihood-preserving regularizer.

    Attributes:
      enabled: add the LLDS term to the loss.
      variant: name of the registered loss term that implements it (`llds_jax.rl.terms.LOSS_TERMS`).
      lam: lambda, the weight w on gated tokens (0.2; 0.3 for Qwen2.5-7B-Instruct).
      gate: "action" (default: net delta over the token's action > 0), "response" (over the trajectory), "token"
        (`llds_jax.rl.llds.GATES`).
      answer_weighting: LLDS-MA on the final answer span: "none"; "fixed" (beta = answer_beta); "adaptive" (code:
        beta = adaptive_c * max(V - 1, 0), V = mean search actions per trajectory of the rollout batch);
        "adaptive_paper" (beta = min(V / 2, 1) * lam). Answer tokens get w = min(beta, lam)
        (`llds_jax.rl.llds.ANSWER_WEIGHTINGS`).
      answer_beta: beta of "fixed" (the paper's v1 used 0.05).
      adaptive_c: c of "adaptive".
    """

    SECTION = "objective.llds"  # the run-config section of its fields (llds_jax.bounds)

    enabled: bool = True
    variant: str = "llds"
    lam: float = field(0.2, NON_NEGATIVE)
    gate: str = "action"
    answer_weighting: str = "none"
    answer_beta: float = field(0.05, NON_NEGATIVE)
    adaptive_c: float = field(0.2, NON_NEGATIVE)

    def __post_init__(self):
        bounds.check(self)


@dataclasses.dataclass(frozen=True)
class ObjectiveConfig:
    """The per-micro-batch loss `L = pg - entropy_coef * ent + kl_coef * kl + llds`.

    Attributes:
      clip_ratio: PPO clip epsilon (ratio clipped to [1 - eps, 1 + eps]).
      clip_ratio_high: upper clip epsilon, DAPO's "clip-higher": the ratio is clipped to
        [1 - clip_ratio, 1 + clip_ratio_high]; 0 (default): clip_ratio, the symmetric clip of the reference code.
      ratio_cap: the ratio exp(logp - old_logp) is capped at this value (100 in the reference code).
      tis_cap: truncated importance sampling between the rollout's sampler and the trainer (verl's
        `tis_imp_ratio_cap`): each loss token's clipped policy loss is multiplied by the frozen weight
        min(exp(old_logp - sampler_logp), tis_cap); 0 (default): off; otherwise >= 1.
      entropy_coef: weight of the entropy bonus (subtracted).
      kl_coef: weight of the KL to the reference model (0 disables the term).
      kl_estimator: "low_var_kl" (k3, default), "k1", "abs" or "mse" (`llds_jax.rl.losses.KL_ESTIMATORS`).
      kl_clamp: k3 values are clipped to [-kl_clamp, kl_clamp].
      aggregation: "token-mean" (default: over all loss tokens of the micro-batch) or "seq-mean-token-mean"
        (paper Eq. 1: token mean per trajectory, then mean over trajectories); applies to every term
        (`llds_jax.rl.terms.AGGREGATIONS`).
      temperature: rollout temperature; all log-probs use logits / temperature.
      llds: the LLDS sub-config.
    """

    SECTION = "objective"  # the run-config section of its fields (llds_jax.bounds; temperature comes from
    # rollout.temperature)

    clip_ratio: float = field(0.2, NON_NEGATIVE)
    clip_ratio_high: float = field(0.0, Range(lambda v: v >= 0, ">= 0 (0: objective.clip_ratio)"))
    ratio_cap: float = field(100.0, Range(lambda v: v > 1, "> 1"))
    tis_cap: float = field(0.0, Range(lambda v: v == 0 or v >= 1, "0 (off) or >= 1"))
    entropy_coef: float = field(0.001, NON_NEGATIVE)
    kl_coef: float = field(0.001, NON_NEGATIVE)
    kl_estimator: str = "low_var_kl"
    kl_clamp: float = field(10.0, POSITIVE)
    aggregation: str = "token-mean"
    temperature: float = field(1.0, POSITIVE)
    llds: LLDSConfig = dataclasses.field(default_factory=LLDSConfig)

    def __post_init__(self):
        bounds.check(self)
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
class UpdateConfig:
    """How a rollout batch becomes optimizer updates (defaults: the paper's code).

    Attributes:
      mini_batch_size: trajectories per optimizer update (the batch size must be a multiple).
      micro_batch_size: trajectories per gradient-accumulation micro-batch (divides mini_batch_size; on a mesh, a
        multiple of the data-axes size).
      learning_rate: base learning rate, reached after warmup.
      warmup_steps: rollout batches of linear warmup from 0 (0: constant learning rate).
      max_grad_norm: global gradient norm clip.
      adam_b1, adam_b2, adam_eps, weight_decay: AdamW.
      logp_time_chunk: time steps per log-prob chunk (peak logits memory: micro_batch * chunk * V float32).
      reference_dtype: storage dtype of the frozen reference parameters, "float32" or "bfloat16".
      pack_trajectories: run the forwards (log-probs, updates) on each micro-batch's trajectories packed into fewer
        rows (llds_jax/rl/packing.py); same micro-batches and per-token results, less padding. False: one row each.
      pack_row_tokens: length of a packed row in tokens; 0 (or less than the batch length): the batch length. Rows
        longer than the longest trajectory let more trajectories share one (less padding; attention that skips
        other trajectories' keys, blockwise or splash, keeps their cost near the trajectories' own).
      precompile_row_counts: with packing, the first batch of each length compiles the forwards of every row count
        an update can need (`BatchLayout.row_counts`) before it runs, so later batches do not stop to compile.
    """

    SECTION = "optim"  # the run-config section of its fields (llds_jax.bounds; warmup_steps comes from
    # optim.warmup_ratio)

    mini_batch_size: int = field(256, AT_LEAST_1)
    micro_batch_size: int = field(16, AT_LEAST_1)
    learning_rate: float = field(1e-6, POSITIVE)
    warmup_steps: int = field(0, NON_NEGATIVE)
    max_grad_norm: float = field(1.0, POSITIVE)
    adam_b1: float = field(0.9, MOMENTUM)
    adam_b2: float = field(0.999, MOMENTUM)
    adam_eps: float = field(1e-8, POSITIVE)
    weight_decay: float = field(0.01, NON_NEGATIVE)
    logp_time_chunk: int = field(DEFAULT_TIME_CHUNK, AT_LEAST_1)
    reference_dtype: str = field("bfloat16", choices=REFERENCE_DTYPES)
    pack_trajectories: bool = True
    pack_row_tokens: int = field(0, NON_NEGATIVE)
    precompile_row_counts: bool = True

    def __post_init__(self):
        bounds.check(self)
        if self.mini_batch_size % self.micro_batch_size:
            raise ConfigError(f"optim.mini_batch_size ({self.mini_batch_size}) must be a multiple of "
                              f"optim.micro_batch_size ({self.micro_batch_size})")
