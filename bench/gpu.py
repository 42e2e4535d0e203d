"""One prepared accelerator benchmark: train-step MFU against the measured matmul peak, decode tokens/s of the
rollout engine against the memory-bandwidth roofline. Sized for one H200; tiny shapes on CPU (`--tiny`, automatic when no
GPU is present) so that it runs, and is tested, anywhere.

1. Peaks, measured in this process: an [n, n] @ [n, n] matmul in the compute dtype (FLOP/s) and a device copy of a
   large array (`x + 1`: bytes read + written per second, the HBM bandwidth a kernel can reach).
2. Train step: one optimizer update of `RLTrainStep` (GRPO + LLDS, X micro-batches, AdamW) on a Qwen2.5 shape with
   random weights, bf16 compute and float32 master weights. Model FLOPs = (6 P + 12 L T N H) per token (see
   bench/train_step.py); MFU = FLOP/s over the measured matmul peak. Then the parts alone (forward, decoder stack,
   log-prob/vocabulary, attention).
3. Decode: the rollout engine (`rollout.engine.Engine` over `rollout.runner.DeviceRunner`: ragged steps over a paged
   KV cache, decode chunks of `--decode-chunk` samples), B = `--batch` sequences (128 by default, a pod config's
   rollout rows) of `--prompt-len` prompt tokens, decoding `--new-tokens` each. Decode time = time(prompt + N tokens)
   - time(prompt + 1 token), same compiled programs (one per token bucket, up to `--max-step-tokens`).
   Roofline: each decode step must read every weight once (compute dtype: P_all * bytes) and each row's keys and
   values of its context (2 L K H bytes per token, at the mean context length), so
       roofline tokens/s = B * bandwidth / (weight bytes + KV bytes per step).
   Variants: the rollout's sampling (temperature 1, top-p 0.95) and greedy, each with the float32 master params the
   trainer hands the rollout, and greedy with a bfloat16 copy of the params. The dense-cache sampler measured on
   2026-12-04 (docs/benchmarks.md) is gone (db635b6 is its last commit).

    bench/gpu.sh                                    # = python bench/gpu.py: Qwen2.5-1.5B shapes on the GPU
    python bench/gpu.py --model qwen2.5-0.5b --no-remat
    python bench/gpu.py --tiny                      # tiny shapes (CPU), seconds
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_step as bench_train  # noqa: E402  (bench/train_step.py)

from llds_jax.model import ModelConfig, Transformer, preset  # noqa: E402
from llds_jax.config.sections import ObjectiveConfig, UpdateConfig  # noqa: E402
from llds_jax.rollout.config import SamplingConfig  # noqa: E402
from llds_jax.rollout.driver import sequence_keys  # noqa: E402
from llds_jax.rollout.engine import Engine, EngineConfig  # noqa: E402
from llds_jax.rollout.paged_sampler import token_budgets  # noqa: E402
from llds_jax.rollout.runner import DeviceRunner  # noqa: E402

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
            head_dim=16, qkv_bias=True, tie_word_embeddings=True)
TINY_ARGS = dict(seq=64, micro=2, mini=4, batch=4, prompt_len=16, new_tokens=64, peak_n=1024, copy_mib=64,
                 repeats=2, decode_chunk=16, max_step_tokens=64)


def si(value: float, unit: str) -> str:
    """`value` with a T / G / M / K prefix, e.g. si(7.6e13, "FLOP") == "76.00 TFLOP"."""
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {prefix}{unit}"
    return f"{value:.2f} {unit}"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-1.5b", help="a llds_jax.model preset (random weights)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (the default without an accelerator)")
    p.add_argument("--dtype", default=None, help="compute dtype (default: bfloat16 on GPU, float32 tiny)")
    p.add_argument("--no-remat", action="store_true", help="model.remat off (default on, as in the configs)")
    p.add_argument("--seq", type=int, default=1024, help="train: tokens per trajectory")
    p.add_argument("--micro", type=int, default=8, help="train: trajectories per micro-batch")
    p.add_argument("--mini", type=int, default=16, help="train: trajectories per optimizer update")
    p.add_argument("--chunk", type=int, default=256, help="train: optim.logp_time_chunk")
    p.add_argument("--batch", type=int, default=128, help="decode: sequences (the engine's sequence slots)")
    p.add_argument("--prompt-len", type=int, default=256, help="decode: prompt tokens per sequence")
    p.add_argument("--new-tokens", type=int, default=240, help="decode: tokens decoded per sequence")
    p.add_argument("--decode-chunk", type=int, default=32, help="decode: steps per device call")
    p.add_argument("--page-size", type=int, default=16, help="decode: token slots per page")
    p.add_argument("--max-step-tokens", type=int, default=4096, help="decode: the largest token bucket of a step")
    p.add_argument("--peak-n", type=int, default=8192, help="size of the square matmul of the peak")
    p.add_argument("--copy-mib", type=int, default=4096, help="MiB of the array copied for the bandwidth")
    p.add_argument("--repeats", type=int, default=3, help="interleaved timing rounds (best reported)")
    p.add_argument("--skip-train", action="store_true")
    p.add_argument("--skip-breakdown", action="store_true")
    p.add_argument("--skip-decode", action="store_true")
    args = p.parse_args(argv)
    args.tiny = args.tiny or jax.devices()[0].platform == "cpu"
    if args.tiny:
        defaults = p.parse_args([])
        for key, value in TINY_ARGS.items():  # tiny sizes, unless given on the command line
            if getattr(args, key) == getattr(defaults, key):
                setattr(args, key, value)
    args.dtype = args.dtype or ("float32" if args.tiny else "bfloat16")
    return args


def model_config(args) -> ModelConfig:
    common = dict(dtype=args.dtype, param_dtype="float32", scan_layers=True, remat=not args.no_remat)
    if args.tiny:
        return ModelConfig(**TINY, **common)
    return preset(args.model, **common)


def copy_bandwidth(mib: int, repeats: int) -> float:
    """Bytes/s of an in-place `x + 1` (input donated) on a float32 array of `mib` MiB: every byte read and written
    once, no fresh allocation (on CPU, page faults of new buffers would dominate)."""
    add = jax.jit(lambda a: a + 1.0, donate_argnums=0)
    box = [jnp.zeros((mib * 2**20 // 4,), jnp.float32)]

    def five_adds():
        for _ in range(5):
            box[0] = add(box[0])
        return box[0]

    t = bench_train.measure({"copy": five_adds}, repeats)["copy"]
    return 2 * box[0].nbytes * 5 / t.wall


def train(args, cfg: ModelConfig, peak: bench_train.Timing, peak_flops: float) -> tuple[dict[str, float], object]:
    update = UpdateConfig(mini_batch_size=args.mini, micro_batch_size=args.micro, learning_rate=1e-6,
                          logp_time_chunk=args.chunk)
    batch = bench_train.synthetic_batch(2 * args.mini, args.seq, cfg.vocab_size)
    runner = bench_train.UpdateRunner(cfg, update, batch, ObjectiveConfig())
    flops = bench_train.train_flops(cfg, args.mini, args.seq)
    mem = runner.memory
    print(f"[train] update of {args.mini} x {args.seq} tokens ({args.mini // args.micro} micro-batches of "
          f"{args.micro}), remat {cfg.remat}: {si(flops, 'FLOP')}; compile {runner.lower_s + runner.compile_s:.1f}"
          f" s, memory arguments {mem.argument_size_in_bytes / 2**20:.1f} MiB + temp "
          f"{mem.temp_size_in_bytes / 2**20:.1f} MiB")
    fns = {"update": runner}
    parts = [] if args.skip_breakdown else bench_train.breakdown_parts(cfg, runner.step, runner.step._params,
                                                                       args.micro, args.seq, args.chunk)
    fns.update({part.name: part.fn for part in parts})
    t = bench_train.measure(fns, args.repeats)
    on_cpu = jax.devices()[0].platform == "cpu"
    rows = [("update (jit RLTrainStep)", flops, t["update"], 1)]
    rows += [(p.name, p.flops, t[p.name], p.scale) for p in parts]
    mfu = bench_train.print_table(rows, peak, peak_flops, on_cpu)
    tokens_s = args.mini * args.seq / t["update"].wall
    print(f"[train] {tokens_s:.0f} tokens/s, MFU {mfu[rows[0][0]]:.1%} of the measured {args.dtype} matmul peak "
          f"(model FLOPs; remat recomputation not counted)")
    result = {"train_tokens_s": tokens_s, "train_mfu": mfu[rows[0][0]]}
    result.update({f"part_mfu/{p.name}": mfu[p.name] for p in parts})
    return result, runner.step._params


@dataclasses.dataclass(frozen=True)
class DecodeVariant:
    name: str
    sampling: dict
    params_dtype: str | None  # None: the float32 master params as they are


def decode_roofline(cfg: ModelConfig, args) -> tuple[float, float, float]:
    """(weight bytes, KV bytes) one decode step must read at the mean context, and the mean context length."""
    itemsize = jnp.dtype(cfg.dtype).itemsize
    weights = (bench_train.matmul_params(cfg) + cfg.num_layers * 2 * cfg.hidden_size + cfg.hidden_size) * itemsize
    context = args.prompt_len + args.new_tokens / 2
    kv = 2 * cfg.num_layers * args.batch * context * cfg.num_kv_heads * cfg.head_dim * itemsize
    return weights, kv, context


def decode(args, cfg: ModelConfig, params, bandwidth: float) -> dict[str, float]:
    graphdef = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))[0]  # no weights
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, args.prompt_len).tolist() for _ in range(args.batch)]
    max_context = args.prompt_len + args.new_tokens + 1
    pages_per_seq = -(-max_context // args.page_size)
    shapes = EngineConfig(max_seqs=args.batch, token_budgets=token_budgets(args.batch, max(args.max_step_tokens,
                                                                                              args.batch)),
                          decode_chunk=args.decode_chunk, page_size=args.page_size,
                          num_pages=args.batch * pages_per_seq + 1, max_context=max_context)
    keys = sequence_keys(jax.random.key(0), range(args.batch))
    weights, kv, context = decode_roofline(cfg, args)
    roofline = args.batch * bandwidth / (weights + kv)
    slots = pages_per_seq * args.page_size
    executed = weights * 4 / jnp.dtype(cfg.dtype).itemsize + kv * slots / context
    print(f"[decode] {args.batch} sequences, prompt {args.prompt_len}, {args.new_tokens} new tokens, pages of "
          f"{args.page_size} slots; a step must read {weights / 2**20:.1f} MiB of {cfg.dtype} weights + "
          f"{kv / 2**20:.1f} MiB of keys/values (mean context {context:.0f}): roofline {roofline:.0f} tokens/s at "
          f"{si(bandwidth, 'B/s')}")
    print(f"[decode] reading float32 master weights and every sequence's {slots} page slots instead would be "
          f"{executed / 2**20:.1f} MiB a step: {args.batch * bandwidth / executed:.0f} tokens/s")
    variants = [DecodeVariant("rollout sampling (top-p 0.95), f32 params", dict(temperature=1.0, top_p=0.95), None),
                DecodeVariant("greedy, f32 master params", dict(greedy=True), None)]
    if jnp.dtype(cfg.dtype) != jnp.float32:
        variants.append(DecodeVariant(f"greedy, {cfg.dtype} params copy", dict(greedy=True), cfg.dtype))
    fns = {}
    for variant in variants:
        runner = DeviceRunner(graphdef, cfg, SamplingConfig(decode_chunk=args.decode_chunk, **variant.sampling),
                              shapes)
        p = params if variant.params_dtype is None else jax.tree.map(
            lambda x: x.astype(variant.params_dtype), params)

        def run(new_tokens, runner=runner, p=p):
            def call():
                engine = Engine(runner, p, shapes)
                for seq, prompt in enumerate(prompts):
                    engine.add_request(seq, prompt, keys[seq], new_tokens)
                sampled = 0
                while engine.running:
                    sampled += sum(len(turn.token_ids) for _, turn in engine.step())
                return jnp.asarray(sampled)
            return call

        fns[variant.name + "/1"] = run(1)
        fns[variant.name + "/N"] = run(args.new_tokens)
    t = bench_train.measure(fns, args.repeats)
    result = {}
    print(f"  {'variant':<44}{'decode s':>10}{'tokens/s':>12}{'of roofline':>13}")
    for variant in variants:
        seconds = max(t[variant.name + "/N"].wall - t[variant.name + "/1"].wall, 1e-9)
        tokens_s = args.batch * (args.new_tokens - 1) / seconds
        result[f"decode_tokens_s/{variant.name}"] = tokens_s
        result[f"decode_roofline/{variant.name}"] = tokens_s / roofline
        print(f"  {variant.name:<44}{seconds:>10.3f}{tokens_s:>12.0f}{tokens_s / roofline:>13.1%}")
    return result


def main(argv=None) -> dict[str, float]:
    start = time.perf_counter()
    args = parse_args(argv)
    cfg = model_config(args)
    device = jax.devices()[0]
    print(f"device: {device.platform} ({device.device_kind}) x{jax.device_count()}; "
          f"{'tiny shapes' if args.tiny else args.model}: P = {si(bench_train.matmul_params(cfg), '')} matmul "
          f"weights, {cfg.num_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, compute {cfg.dtype}, "
          f"params {cfg.param_dtype}")
    peak_call = bench_train.matmul_fn(args.dtype, args.peak_n)
    peak = bench_train.measure({"peak": lambda: [peak_call() for _ in range(5)][-1]}, args.repeats)["peak"]
    peak = bench_train.Timing(peak.wall / 5, peak.cpu / 5)
    peak_flops = 2.0 * args.peak_n**3
    bandwidth = copy_bandwidth(args.copy_mib, args.repeats)
    print(f"[peak] {args.peak_n}^3 {args.dtype} matmul {si(peak_flops / peak.wall, 'FLOP/s')}; in-place add on "
          f"{args.copy_mib} MiB {si(bandwidth, 'B/s')}")
    result = {"peak_flops": peak_flops / peak.wall, "bandwidth": bandwidth}
    params = None
    if not args.skip_train:
        train_result, params = train(args, cfg, peak, peak_flops)
        result.update(train_result)
    if not args.skip_decode:
        if params is None:
            params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)[1]
        result.update(decode(args, cfg, params, bandwidth))
    print(f"done in {time.perf_counter() - start:.0f} s")
    return result


if __name__ == "__main__":
    main()
