"""Update throughput and MFU of our jit GRPO + LLDS train step, against the machine's matmul peak and a PyTorch step.

One optimizer update of `RLTrainStep` (the jitted mini-batch update: X micro-batches of forward + backward with
gradient accumulation, global-norm clip, AdamW) is timed on a synthetic multi-turn rollout batch, and compared with:

1. the machine's measured peak: the best of a few large square matmuls (`--peak-n`) in the compute dtype, timed in
   the same process; achieved model FLOP/s over that peak is the MFU;
2. an equivalent PyTorch step: the same random Qwen2 as a `transformers` `Qwen2ForCausalLM`, the same batch and
   micro-batching, the same loss re-implemented in torch (clipped ratio, k3 KL, entropy bonus, LLDS with the action
   gate, token-mean: `torch_objective_loss`, which tests/rl/test_torch_objective.py checks against ours, values and
   gradients), `clip_grad_norm_` and `torch.optim.AdamW`. Its first two update losses are compared with ours (a
   check that both sides compute the same thing).

FLOPs are counted analytically (model FLOPs: rematerialization is not counted):
    train FLOPs / token = 6 * P + 12 * L * T * N * H
where P = L * (D*N*H + 2*D*K*H + N*H*D + 3*D*F) + D*V counts the weights every token multiplies (the projections
and the unembedding; the embedding lookup, norms and biases are left out), and 12 * L * T * N * H the attention
scores and values (2 matmuls of 2*T*N*H FLOPs per token and layer, forward 1x + backward 2x, dense T x T as
executed). A forward alone is a third of that.

Unless `--no-breakdown`, the parts of the update are timed alone at one micro-batch's shape, each against the
peak: the forward (log-probs, no gradient), the decoder stack forward + backward without the vocabulary, the
log-prob / entropy part (chunked over time, rematerialized) forward + backward, and attention forward + backward.

Every call is timed in interleaved rounds (peak, ours, torch, parts, then again), best of `--repeats` rounds after a
warm-up call, as wall time and as process CPU time (the seconds our threads ran: what other jobs sharing the cores
disturb least). MFU(CPU) compares FLOPs per CPU-second with the peak matmul's FLOPs per CPU-second.

    python bench/train_step.py                                  # hidden 512, 4 layers, vocab 16384, seq 512
    python bench/train_step.py --layers 8 --vocab 32768 --skip-torch
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from llds_jax.model import ModelConfig, Transformer
from llds_jax.model.attention import attention
from llds_jax.rl.advantages import grpo_advantages
from llds_jax.rl.batch import RolloutBatch
from llds_jax.config.sections import ObjectiveConfig, UpdateConfig
from llds_jax.rl.llds import action_ids_from_loss_mask
from llds_jax.rl.logprobs import token_logp_entropy
from llds_jax.rl.train_step import RLTrainStep

GIGA = 1e9


# ----- shared by bench/gpu.py and bench/policies.py -------------------------------------------------------------------
@dataclasses.dataclass
class Timing:
    """Best wall seconds and best process CPU seconds (all threads) of one measured call."""

    wall: float = math.inf
    cpu: float = math.inf


def measure(fns: dict[str, Callable[[], Any]], repeats: int, warmup: bool = True) -> dict[str, Timing]:
    """Times each fn (blocked on) in `repeats` interleaved rounds after one warm-up call each; best of the rounds.

    Interleaving spreads the load of other jobs on the machine over every measurement alike; process CPU time
    (time.process_time: the seconds our threads actually ran) is the measure that other jobs disturb least on a
    shared CPU machine.
    """
    if warmup:
        for fn in fns.values():
            jax.block_until_ready(fn())
    best = {name: Timing() for name in fns}
    for _ in range(max(repeats, 1)):
        for name, fn in fns.items():
            wall, cpu = time.perf_counter(), time.process_time()
            jax.block_until_ready(fn())
            best[name].wall = min(best[name].wall, time.perf_counter() - wall)
            best[name].cpu = min(best[name].cpu, time.process_time() - cpu)
    return best


def best_seconds(fn: Callable[[], Any], repeats: int) -> float:
    """Best wall time of `repeats` calls of fn (each blocked on), after one warm-up call."""
    return measure({"fn": fn}, repeats)["fn"].wall


def matmul_fn(dtype: str = "float32", n: int = 2048) -> Callable[[], jax.Array]:
    """A jitted [n, n] @ [n, n] matmul in `dtype` (2 n^3 FLOPs), ready to call."""
    keys = jax.random.split(jax.random.key(0), 2)
    a, b = (jax.random.normal(k, (n, n), jnp.float32).astype(dtype) for k in keys)
    matmul = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.dtype(dtype)))
    return lambda: matmul(a, b)


def matmul_peak(dtype: str = "float32", n: int = 2048, repeats: int = 3) -> float:
    """Measured matmul FLOP/s: best wall time of an [n, n] @ [n, n] jitted matmul in `dtype`."""
    return 2 * n**3 / best_seconds(matmul_fn(dtype, n), repeats)


def matmul_params(cfg: ModelConfig) -> int:
    """P: weights every token multiplies (all projections and the unembedding; no embedding, norms or biases)."""
    d, n, k, h, f = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    return cfg.num_layers * (d * n * h + 2 * d * k * h + n * h * d + 3 * d * f) + d * cfg.vocab_size


def forward_flops(cfg: ModelConfig, rows: int, seq: int) -> float:
    """Model FLOPs of a forward over rows x seq tokens: (2 P + 4 L T N H) per token."""
    per_token = 2 * matmul_params(cfg) + 4 * cfg.num_layers * seq * cfg.num_heads * cfg.head_dim
    return float(per_token) * rows * seq


def train_flops(cfg: ModelConfig, rows: int, seq: int) -> float:
    """Model FLOPs of forward + backward over rows x seq tokens: (6 P + 12 L T N H) per token."""
    return 3 * forward_flops(cfg, rows, seq)


def synthetic_batch(rows: int, seq: int, vocab: int, seed: int = 0, group: int = 4) -> RolloutBatch:
    """A multi-turn rollout batch with no padding (every row holds `seq` real tokens), its rewards and GRPO
    advantages set.

    Each row: a prompt of seq/4 tokens, then model turns (loss mask 1, ~seq/8 tokens each) separated by
    observations (~seq/8 tokens, loss mask 0) up to the end; the last 4 tokens of the last turn are the answer span.
    Groups of `group` rows share a uid and have mixed rewards; the action ids are the maximal runs of the loss mask.
    """
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (rows, seq)).astype(np.int32)
    loss_mask = np.zeros((rows, seq), np.float32)
    answer = np.zeros((rows, seq), np.float32)
    searches = np.zeros(rows, np.float32)
    unit = max(seq // 8, 2)
    for row in range(rows):
        pos, last = max(seq // 4, 1), None
        while pos < seq:
            length = min(int(rng.integers(unit // 2, 3 * unit // 2 + 1)), seq - pos)
            loss_mask[row, pos:pos + length] = 1
            last = (pos, pos + length)
            pos += length + int(rng.integers(unit // 2, 3 * unit // 2 + 1))
            searches[row] += pos < seq
        if last is not None:
            answer[row, max(last[1] - 4, last[0]):last[1]] = 1
    rewards = rng.integers(0, 2, rows).astype(np.float32)
    rewards[::group] = 1.0
    rewards[1::group] = 0.0
    group_b = (np.arange(rows) // group).astype(np.int32)
    return RolloutBatch(tokens_bt=tokens, mask_bt=np.ones((rows, seq), np.float32), loss_mask_bt=loss_mask,
                        action_ids_bt=np.asarray(jax.jit(action_ids_from_loss_mask)(loss_mask)),
                        answer_mask_bt=answer, sampler_logp_bt=np.zeros((rows, seq), np.float32), group_b=group_b,
                        search_count_b=searches, rewards_b=rewards,
                        advantages_b=np.asarray(jax.jit(grpo_advantages)(rewards, group_b)))


def model_config(args: argparse.Namespace, **overrides: Any) -> ModelConfig:
    fields = dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                  num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
                  rope_theta=1_000_000.0, qkv_bias=True, tie_word_embeddings=False, dtype=args.dtype,
                  param_dtype="float32", scan_layers=True, remat=args.remat, attention=args.attention)
    fields.update(overrides)
    return ModelConfig(**fields)


class UpdateRunner:
    """Our jitted mini-batch update on a prepared batch, compiled ahead of time; each call runs the next update.

    Attributes after construction: lower_s, compile_s (wall) and lower_cpu, compile_cpu (process CPU seconds), lowered,
    compiled, memory (compiled memory_analysis()), num_updates, step, state (donated by each call: the latest),
    losses (of the first two calls).
    """

    def __init__(self, cfg: ModelConfig, update: UpdateConfig, batch: RolloutBatch,
                 objective: ObjectiveConfig | None = None, donate: bool = True, seed: int = 0,
                 frozen_logp: bool = True):
        """donate: the step's own jit (state donated) or the same function without donation. frozen_logp: compute
        old_logp / ref_logp with the model (else zeros of their shape, e.g. when only compiling)."""
        self.step = RLTrainStep(Transformer(cfg, rngs=nnx.Rngs(seed)), objective or ObjectiveConfig(), update)
        self.state = self.step.init_state()
        prepared = self.step.prepare_batch(batch)
        self.prepared, self.batch, self.stats = prepared, prepared.batch, prepared.batch_stats
        self.num_updates = prepared.num_updates
        if frozen_logp:
            ref = self.step.reference_params(self.state.params)
            self.old_logp = self.step.sequence_logp(self.state.params, prepared)
            self.ref_logp = self.step.sequence_logp(ref, prepared)
        else:
            self.old_logp = self.ref_logp = jnp.zeros(prepared.batch.tokens_uxbt.shape, jnp.float32)
        if donate:
            jitted = self.step._jitted_update(self.state)
        else:
            shardings = jax.tree.map(lambda x: x.sharding, self.state)
            jitted = jax.jit(self.step._update_impl, out_shardings=(shardings, None))
        wall, cpu = time.perf_counter(), time.process_time()
        self.lowered = jitted.lower(self.state, self.batch, prepared.update_rows(0), self.stats, self.old_logp,
                                    self.ref_logp, jnp.int32(0))
        self.lower_s, self.lower_cpu = time.perf_counter() - wall, time.process_time() - cpu  # trace + lower
        wall, cpu = time.perf_counter(), time.process_time()
        self.compiled = self.lowered.compile()
        self.compile_s, self.compile_cpu = time.perf_counter() - wall, time.process_time() - cpu  # XLA compilation
        self.memory = self.compiled.memory_analysis()
        self.index = 0
        self.losses: list[float] = []

    def __call__(self):
        index = self.index % self.num_updates
        self.state, metrics = self.compiled(self.state, self.batch, self.prepared.update_rows(index), self.stats,
                                            self.old_logp, self.ref_logp, jnp.int32(index))
        self.index += 1
        if len(self.losses) < 2:
            self.losses.append(float(metrics["actor/loss"]))
        return self.state.params


# ----- the PyTorch reference step -------------------------------------------------------------------------------------
def torch_qwen2(cfg: ModelConfig, params: nnx.State):
    """A transformers Qwen2ForCausalLM holding our weights (the mapping of bench/rollout.py)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from rollout import hf_model  # noqa: E402  (bench/rollout.py)

    return hf_model(cfg, params, "cpu").train()


def torch_objective_loss(obj: ObjectiveConfig, logp, entropy, old, ref, advantages_b, mask, action_ids):
    """The per-micro-batch loss of docs/method.md in PyTorch, written from the spec (not from our code): the default
    objective only (token-mean aggregation, k3 KL, LLDS with the action gate, no answer weighting).

    Args: torch tensors; logp, entropy [B, T] float32 (differentiated), old, ref [B, T] float32, advantages_b [B],
    mask [B, T] float32 loss mask, action_ids [B, T] int64 (-1 off actions). Returns the scalar loss.
    """
    import torch

    agg = lambda x: (x * mask).sum() / mask.sum().clamp(min=1.0)  # noqa: E731
    a = advantages_b[:, None]
    ratio = torch.exp(torch.clamp(logp - old, max=math.log(obj.ratio_cap)))
    policy = agg(torch.maximum(-a * ratio, -a * torch.clamp(ratio, 1 - obj.clip_ratio, 1 + obj.clip_ratio)))
    d = ref - logp
    kl = agg(torch.clamp(torch.exp(torch.clamp(d, max=20.0)) - d - 1.0, -obj.kl_clamp, obj.kl_clamp))
    delta = old - logp
    time_ = logp.shape[1]
    valid = (mask > 0) & (action_ids >= 0)
    slot = torch.where(valid, action_ids, torch.full_like(action_ids, time_))
    sums = torch.zeros(logp.shape[0], time_ + 1).scatter_add_(
        1, slot, torch.where(valid, delta.detach() * mask, torch.zeros_like(delta)))
    fired = (sums.gather(1, slot) > 0) & (slot < time_)
    gate = mask * (advantages_b >= 0)[:, None].float() * fired.float()
    llds = agg(gate * obj.llds.lam * torch.relu(delta))
    loss = policy + obj.kl_coef * kl - obj.entropy_coef * agg(entropy)
    return loss + llds if obj.llds.enabled else loss


class TorchStep:
    """The same update in PyTorch: full-logits log-probs, the loss terms re-implemented, accumulation, clip, AdamW.

    Supports the default objective (token-mean aggregation, k3 KL, LLDS with the action gate, no answer weighting).
    """

    def __init__(self, cfg: ModelConfig, params: nnx.State, objective: ObjectiveConfig, update: UpdateConfig,
                 batch: RolloutBatch):
        import torch

        llds = objective.llds
        if (objective.aggregation, objective.kl_estimator, llds.gate, llds.answer_weighting) != (
                "token-mean", "low_var_kl", "action", "none"):
            raise ValueError("the torch reference implements the default objective only")
        self.torch, self.objective, self.update_cfg = torch, objective, update
        self.model = torch_qwen2(cfg, params)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=update.learning_rate,
                                     betas=(update.adam_b1, update.adam_b2), eps=update.adam_eps,
                                     weight_decay=update.weight_decay)
        rows, seq = batch.tokens_bt.shape
        micro, per_update = update.micro_batch_size, update.mini_batch_size // update.micro_batch_size
        layout = (rows // update.mini_batch_size, per_update, micro)
        t = lambda x, dtype: torch.from_numpy(np.asarray(x).astype(dtype).reshape(layout + x.shape[1:]))  # noqa
        self.tokens, self.mask = t(batch.tokens_bt, np.int64), t(batch.mask_bt, np.int64)
        self.loss_mask, self.advantages = t(batch.loss_mask_bt, np.float32), t(batch.advantages_b, np.float32)
        self.action_ids = t(batch.action_ids_bt, np.int64)
        with torch.no_grad():  # old_logp and ref_logp: the reference starts as a copy of the policy
            self.old_logp = torch.stack([torch.stack([self.token_logp(self.tokens[u, k], self.mask[u, k])[0]
                                                      for k in range(per_update)]) for u in range(layout[0])])
        self.ref_logp = self.old_logp.clone()
        self.index = 0
        self.losses: list[float] = []

    def token_logp(self, tokens, mask):
        """(logp, entropy) [B, T] aligned to tokens (column 0 = 0), from full float32 logits / temperature."""
        torch = self.torch
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        logits = self.model(input_ids=tokens, attention_mask=mask, position_ids=positions).logits[:, :-1]
        logp_btv = torch.log_softmax(logits.float() / self.objective.temperature, dim=-1)
        logp = logp_btv.gather(-1, tokens[:, 1:, None])[..., 0]
        entropy = -(logp_btv.exp() * logp_btv).sum(-1)
        zero = torch.zeros_like(logp[:, :1])
        return torch.cat([zero, logp], 1), torch.cat([zero, entropy], 1)

    def __call__(self):
        torch = self.torch
        u = self.index % self.tokens.shape[0]
        per_update = self.tokens.shape[1]
        self.opt.zero_grad(set_to_none=True)
        total = 0.0
        for k in range(per_update):
            logp, entropy = self.token_logp(self.tokens[u, k], self.mask[u, k])
            old = self.old_logp[u, k]
            if self.index == 0:  # first update: logp == old_logp by definition (as ours)
                logp = old + (logp - logp.detach())
            loss = torch_objective_loss(self.objective, logp, entropy, old, self.ref_logp[u, k], self.advantages[u, k],
                                        self.loss_mask[u, k], self.action_ids[u, k]) / per_update
            loss.backward()
            total += loss.item()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.update_cfg.max_grad_norm)
        if math.isfinite(total) and torch.isfinite(norm):
            self.opt.step()
        self.index += 1
        if len(self.losses) < 2:
            self.losses.append(total)
        return total


# ----- the breakdown ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Part:
    """One measured piece: `fn()` runs it once; `flops` are its model FLOPs; its time counts `scale` times."""

    name: str
    flops: float
    fn: Callable[[], Any]
    scale: int = 1


def breakdown_parts(cfg: ModelConfig, step: RLTrainStep, params, micro: int, seq: int, chunk: int) -> list[Part]:
    """The parts of one micro-batch's update, each jitted alone at that shape.

    forward only: what `sequence_logp` runs (decoder + chunked log-probs, no gradient); decoder stack: the layers'
    forward + backward without the vocabulary; log-prob/vocab: the chunked, rematerialized log-prob + entropy
    forward + backward on given hidden states; attention: one layer's grouped-query attention forward + backward
    (its time counted once per layer).
    """
    dt = jnp.dtype(cfg.dtype)
    keys = jax.random.split(jax.random.key(1), 6)
    tokens = jax.random.randint(keys[0], (micro, seq), 0, cfg.vocab_size)
    mask = jnp.ones((micro, seq), jnp.float32)
    graphdef, rest = step.graphdef, step._rest
    layer_p = matmul_params(cfg) - cfg.hidden_size * cfg.vocab_size
    attn_fwd = 4.0 * cfg.num_layers * seq * cfg.num_heads * cfg.head_dim * micro * seq

    forward = jax.jit(lambda p: step._token_logp(p, tokens, mask, None)[0])

    def stack_loss(p):
        return jnp.mean(nnx.merge(graphdef, p, rest).hidden(tokens, mask).astype(jnp.float32) ** 2)

    stack = jax.jit(jax.grad(stack_loss))
    hidden = jax.random.normal(keys[1], (micro, seq, cfg.hidden_size), jnp.float32).astype(dt)
    w_dv = (jax.random.normal(keys[2], (cfg.hidden_size, cfg.vocab_size)) * 0.02).astype(dt)

    def vocab_loss(h, w):
        logp, ent = token_logp_entropy(h, w, tokens, time_chunk=chunk)
        return jnp.mean(logp) + 1e-3 * jnp.mean(ent)

    vocab = jax.jit(jax.grad(vocab_loss, argnums=(0, 1)))
    n, k, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q = jax.random.normal(keys[3], (micro, seq, n, h)).astype(dt)
    kk = jax.random.normal(keys[4], (micro, seq, k, h)).astype(dt)
    v = jax.random.normal(keys[5], (micro, seq, k, h)).astype(dt)
    query_slot = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (micro, seq))
    key_valid = jnp.ones((micro, seq), bool)

    def attn_loss(q, kk, v):
        out = attention(q, kk, v, query_slot, key_valid, implementation=cfg.attention,
                        query_block=cfg.attention_query_block, key_block=cfg.attention_key_block)
        return jnp.sum(out.astype(jnp.float32))

    attn = jax.jit(jax.grad(attn_loss, argnums=(0, 1, 2)))
    return [
        Part("forward only (log-probs)", forward_flops(cfg, micro, seq), lambda: forward(params)),
        Part("decoder stack fwd+bwd", 6.0 * layer_p * micro * seq + 3 * attn_fwd, lambda: stack(params)),
        Part("log-prob/vocab fwd+bwd", 6.0 * cfg.hidden_size * cfg.vocab_size * micro * seq,
             lambda: vocab(hidden, w_dv)),
        Part(f"attention fwd+bwd (x{cfg.num_layers})", 3 * attn_fwd / cfg.num_layers, lambda: attn(q, kk, v),
             scale=cfg.num_layers),
    ]


def print_table(rows: list[tuple[str, float, Timing, float]], peak: Timing, peak_flops: float, on_cpu: bool,
                reference_s: float | None = None) -> dict[str, float]:
    """Prints (name, FLOPs, timing, scale) rows against the peak; returns name -> wall MFU (and CPU-time MFU)."""
    peak_wall, peak_cpu = peak_flops / peak.wall, peak_flops / peak.cpu
    head = f"  {'':<34}{'GFLOP':>9}{'wall s':>9}{'GFLOP/s':>9}{'MFU':>7}"
    head += f"{'CPU s':>8}{'MFU(CPU)':>10}" if on_cpu else ""
    print(head + (f"{'share':>7}" if reference_s else ""))
    out = {}
    for name, flops, t, scale in rows:
        line = (f"  {name:<34}{flops * scale / GIGA:>9.1f}{t.wall * scale:>9.3f}{flops / t.wall / GIGA:>9.1f}"
                f"{flops / t.wall / peak_wall:>7.1%}")
        out[name] = flops / t.wall / peak_wall
        if on_cpu:
            line += f"{t.cpu * scale:>8.2f}{flops / t.cpu / peak_cpu:>10.1%}"
            out[name + " (CPU time)"] = flops / t.cpu / peak_cpu
        if reference_s:
            line += f"{t.wall * scale / reference_s:>7.0%}"
        print(line)
    return out


# ----- main -------------------------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=1408)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--seq", type=int, default=512, help="tokens per trajectory")
    p.add_argument("--micro", type=int, default=2, help="trajectories per micro-batch")
    p.add_argument("--mini", type=int, default=4, help="trajectories per optimizer update (a multiple of --micro)")
    p.add_argument("--updates", type=int, default=2, help="optimizer updates per rollout batch")
    p.add_argument("--chunk", type=int, default=256, help="optim.logp_time_chunk")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="compute dtype")
    p.add_argument("--remat", action="store_true", help="model.remat (rematerialize decoder blocks)")
    p.add_argument("--attention", default="auto", choices=("auto", "xla", "blockwise"), help="model.attention")
    p.add_argument("--repeats", type=int, default=2, help="interleaved timing rounds (best reported)")
    p.add_argument("--peak-n", type=int, default=2048, help="size of the square matmul of the peak")
    p.add_argument("--skip-torch", action="store_true", help="no PyTorch comparison")
    p.add_argument("--no-breakdown", action="store_true", help="no per-part timings")
    return p.parse_args(argv)


def main(argv=None) -> dict[str, float]:
    args = parse_args(argv)
    cfg = model_config(args)
    on_cpu = jax.devices()[0].platform == "cpu"
    update = UpdateConfig(mini_batch_size=args.mini, micro_batch_size=args.micro, learning_rate=1e-5,
                          logp_time_chunk=args.chunk)
    objective = ObjectiveConfig()
    batch = synthetic_batch(args.mini * args.updates, args.seq, args.vocab)
    tokens_per_update = args.mini * args.seq
    flops_update = train_flops(cfg, args.mini, args.seq)
    print(f"model: P = {matmul_params(cfg) / 1e6:.1f}M matmul weights ({cfg.num_params() / 1e6:.1f}M params), "
          f"{cfg.num_layers} layers, hidden {cfg.hidden_size}, MLP {cfg.intermediate_size}, heads {cfg.num_heads}/"
          f"{cfg.num_kv_heads}x{cfg.head_dim}, vocab {cfg.vocab_size}, compute {cfg.dtype}, remat {cfg.remat}")
    print(f"update: {args.mini} trajectories x {args.seq} tokens ({args.mini // args.micro} micro-batches of "
          f"{args.micro}), {flops_update / GIGA:.1f} GFLOP = (6 P + 12 L T N H) x tokens; devices: "
          f"{jax.devices()[0].platform} x{jax.device_count()}, {os.cpu_count()} CPUs")

    peak_call = matmul_fn(args.dtype, args.peak_n)
    fns = {"peak": lambda: [peak_call() for _ in range(3)][-1]}
    ours = UpdateRunner(cfg, update, batch, objective)
    fns["ours"] = ours
    print(f"[ours] trace + lower {ours.lower_s:.1f} s, compile {ours.compile_s:.1f} s, temp memory "
          f"{ours.memory.temp_size_in_bytes / 2**20:.0f} MiB")
    ref = None
    if not args.skip_torch:
        import torch

        ref = TorchStep(cfg, ours.step._params, objective, update, batch)
        fns["torch"] = ref
    parts = [] if args.no_breakdown else breakdown_parts(cfg, ours.step, ours.step._params, args.micro, args.seq,
                                                         args.chunk)
    fns.update({part.name: part.fn for part in parts})
    t = measure(fns, args.repeats)
    peak_t = Timing(t["peak"].wall / 3, t["peak"].cpu / 3)
    peak_flops = 2.0 * args.peak_n**3
    result = {"peak_flops": peak_flops / peak_t.wall, "ours_s": t["ours"].wall,
              "ours_tokens_s": tokens_per_update / t["ours"].wall}
    print(f"[peak] {args.peak_n}^3 {args.dtype} matmul: {peak_flops / peak_t.wall / GIGA:.1f} GFLOP/s wall"
          + (f", {peak_flops / peak_t.cpu / GIGA:.1f} GFLOP per CPU-second" if on_cpu else ""))
    rows = [("ours: update (jit RLTrainStep)", flops_update, t["ours"], 1)]
    if ref is not None:
        rows.append(("torch: update (transformers)", flops_update, t["torch"], 1))
    mfu = print_table(rows, peak_t, peak_flops, on_cpu)
    result["ours_mfu"] = mfu[rows[0][0]]
    if on_cpu:
        result["ours_mfu_cpu"] = mfu[rows[0][0] + " (CPU time)"]
    print(f"[ours] {result['ours_tokens_s']:.0f} tokens/s; MFU {result['ours_mfu']:.1%} of the measured matmul peak"
          + (f" ({result['ours_mfu_cpu']:.1%} in CPU time)" if on_cpu else ""))
    if ref is not None:
        result.update(torch_s=t["torch"].wall, torch_tokens_s=tokens_per_update / t["torch"].wall,
                      speedup=t["torch"].wall / t["ours"].wall)
        diffs = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ours.losses, ref.losses)]
        print(f"[torch] torch {torch.__version__}, {torch.get_num_threads()} threads, transformers Qwen2 "
              f"({ref.model.config._attn_implementation} attention), full [micro, T, V] logits: "
              f"{result['torch_tokens_s']:.0f} tokens/s")
        print(f"[torch] losses of updates 1-2: ours {[f'{x:.6f}' for x in ours.losses]}, torch "
              f"{[f'{x:.6f}' for x in ref.losses]}: max relative difference {max(diffs):.1e}")
        print(f"[ratio] update throughput ours / torch: {result['speedup']:.2f}x wall"
              + (f", {t['torch'].cpu / t['ours'].cpu:.2f}x CPU time" if on_cpu else ""))
    if parts:
        per_micro = t["ours"].wall / (args.mini // args.micro)
        print(f"[breakdown] one micro-batch ({args.micro} x {args.seq} tokens) per part; share = part time / one "
              f"micro-batch's share of the update ({per_micro:.2f} s)")
        mfu = print_table([(p.name, p.flops, t[p.name], p.scale) for p in parts], peak_t, peak_flops, on_cpu,
                          per_micro)
        result.update({f"part/{name}": value for name, value in mfu.items()})
    return result


if __name__ == "__main__":
    main()
