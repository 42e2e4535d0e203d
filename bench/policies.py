"""Compile-time and memory policies of the train step, each with its effect measured against a baseline.

Policies and where they are set:
  model.dtype / model.param_dtype  bf16 compute on float32 master weights (params, gradients and AdamW state stay
                                   float32; each block casts its weights to the compute dtype)
  model.remat                      rematerialize each decoder block in the backward pass
  model.scan_layers                `lax.scan` over the stacked layers instead of an unrolled Python loop
  donation                         the jitted update donates the train state (`RLTrainStep`: donate_argnums=0), so
                                   the new params / optimizer state reuse the old buffers (no config key: always on)

1. Checks that bf16 compute really keeps float32 master weights: dtypes of the train state's params and optimizer
   state, of a checkpoint loaded by `hf_io.load_model(..., dtype="bfloat16", param_dtype="float32")`, and the operand
   dtypes of the dot products in the lowered update.
2. One row per policy against the baseline (float32 compute, scan, no remat, donated): trace + lower and XLA compile
   seconds of the update, XLA's compiled memory (`memory_analysis()`: temporaries, and peak = arguments + outputs +
   temporaries - donated aliases) and the best update time (interleaved rounds, wall and process CPU seconds).
3. Compile time against depth: the update of a narrow model (compile time depends on depth, not width) with
   L = 4, 14, 28 layers, scan on and off.

    python bench/policies.py
    python bench/policies.py --hidden 512 --vocab 16384 --depths 4 14 28
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import tempfile
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_step as bench_train  # noqa: E402  (bench/train_step.py)

from llds_jax.model import ModelConfig, Transformer, hf_io  # noqa: E402
from llds_jax.config.sections import ObjectiveConfig, UpdateConfig  # noqa: E402

MIB = 2**20


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=704)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--mini", type=int, default=4)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2, help="interleaved timing rounds (best reported)")
    p.add_argument("--depths", type=int, nargs="*", default=[4, 14, 28], help="layers of the compile-time sweep")
    p.add_argument("--sweep-hidden", type=int, default=64, help="hidden size of the compile-time sweep")
    p.add_argument("--sweep-rounds", type=int, default=2, help="rounds of the compile-time sweep (best reported)")
    args = p.parse_args(argv)
    args.dtype, args.remat = "float32", False
    return args


def dot_operand_dtypes(lowered) -> dict[str, int]:
    """Counts the dot products of a lowered (StableHLO) program by their operand dtypes."""
    counts: dict[str, int] = {}
    for line in lowered.as_text().splitlines():
        if "stablehlo.dot_general" not in line:
            continue
        operands = re.search(r":\s*\((tensor<[^>]*>),\s*(tensor<[^>]*>)\)", line)
        kinds = "?" if operands is None else "/".join(
            sorted({re.search(r"x?([a-z]+\d+)>$", t).group(1) for t in operands.groups()}))
        counts[kinds] = counts.get(kinds, 0) + 1
    return counts


def compiled_dot_dtypes(compiled) -> dict[str, int]:
    """Counts the dot instructions of a compiled (optimized HLO) program by their operand dtypes."""
    text = compiled.as_text()
    shapes = dict(re.findall(r"(%[\w.\-]+) = (\w+)\[", text))
    counts: dict[str, int] = {}
    for operands in re.findall(r"= \w+\[[^\]]*\][^=]*? dot\(([^)]*)\)", text):
        names = re.findall(r"%[\w.\-]+", operands)
        kinds = "/".join(sorted({shapes.get(name, "?") for name in names}))
        counts[kinds] = counts.get(kinds, 0) + 1
    return counts


def check_master_weights(cfg: ModelConfig, runner: bench_train.UpdateRunner) -> None:
    """Prints the dtypes that show bf16 compute keeps float32 master weights."""
    state = runner.state
    param_dtypes = {str(x.dtype) for x in jax.tree.leaves(state.params)}
    opt_dtypes = {str(x.dtype) for x in jax.tree.leaves(state.opt_state) if jnp.ndim(x) > 0}
    print(f"[bf16] model.dtype={cfg.dtype} model.param_dtype={cfg.param_dtype}: train-state params {param_dtypes}, "
          f"AdamW moments {opt_dtypes}; dot products of the update by operand dtype: as lowered (our program) "
          f"{dot_operand_dtypes(runner.lowered)}, as compiled for {jax.devices()[0].platform} "
          f"{compiled_dot_dtypes(runner.compiled)}")
    with tempfile.TemporaryDirectory() as folder:
        small = cfg.replace(num_layers=1, vocab_size=64, hidden_size=32, intermediate_size=64, num_heads=2,
                            num_kv_heads=1, head_dim=16)
        hf_io.save_model(Transformer(small, rngs=nnx.Rngs(0)), folder, dtype="bfloat16")
        loaded = hf_io.load_model(folder, dtype="bfloat16", param_dtype="float32")
        loaded_dtypes = {str(x.dtype) for x in jax.tree.leaves(nnx.state(loaded, nnx.Param))}
        print(f"[bf16] hf_io.load_model(bf16 checkpoint, dtype='bfloat16', param_dtype='float32'): params "
              f"{loaded_dtypes}, compute dtype {loaded.cfg.dtype}")


def policy_table(args) -> dict[str, dict[str, float]]:
    base = bench_train.model_config(args)
    update = UpdateConfig(mini_batch_size=args.mini, micro_batch_size=args.micro, learning_rate=1e-6,
                          logp_time_chunk=args.chunk)
    batch = bench_train.synthetic_batch(2 * args.mini, args.seq, args.vocab)
    policies = {
        "baseline: f32, scan, no remat, donated": (base, True),
        "bf16 compute, f32 master (model.dtype)": (base.replace(dtype="bfloat16"), True),
        "remat (model.remat=True)": (base.replace(remat=True), True),
        "unrolled layers (scan_layers=False)": (base.replace(scan_layers=False), True),
        "no donation of the train state": (base, False),
        "TPU configs: bf16, remat, scan, donated": (base.replace(dtype="bfloat16", remat=True), True),
    }
    small = ModelConfig.tiny(num_layers=1)  # compiles once first, so that no row pays the process's first compile
    bench_train.UpdateRunner(small, UpdateConfig(mini_batch_size=2, micro_batch_size=2), bench_train.synthetic_batch(
        4, 16, small.vocab_size), ObjectiveConfig(llds=dataclasses.replace(ObjectiveConfig().llds, enabled=False)),
        frozen_logp=False)
    runners = {}
    for name, (cfg, donate) in policies.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            runners[name] = bench_train.UpdateRunner(cfg, update, batch, ObjectiveConfig(), donate=donate)
        unusable = [w for w in caught if "donated" in str(w.message)]
        if unusable:
            print(f"[warning] {name}: {unusable[0].message}")
    check_master_weights(policies["bf16 compute, f32 master (model.dtype)"][0],
                         runners["bf16 compute, f32 master (model.dtype)"])
    t = bench_train.measure(runners, args.repeats)
    tokens = args.mini * args.seq
    print(f"[policies] update of {args.mini} x {args.seq} tokens ({args.mini // args.micro} micro-batches), "
          f"{args.layers} layers, hidden {args.hidden}, vocab {args.vocab}; ratios against the baseline")
    print(f"  {'policy':<42}{'lower s':>8}{'compile s':>10}{'(CPU)':>7}{'temp MiB':>10}{'peak MiB':>10}"
          f"{'alias MiB':>10}{'update s':>10}{'(CPU)':>7}{'tokens/s':>10}")
    out = {}
    base_name = next(iter(policies))
    for name, runner in runners.items():
        mem = runner.memory
        peak = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
                - mem.alias_size_in_bytes)
        out[name] = dict(lower_s=runner.lower_s, compile_s=runner.compile_s, compile_cpu=runner.compile_cpu,
                         temp=mem.temp_size_in_bytes, peak=peak, alias=mem.alias_size_in_bytes, wall=t[name].wall,
                         cpu=t[name].cpu)
        print(f"  {name:<42}{runner.lower_s:>8.1f}{runner.compile_s:>10.1f}{runner.compile_cpu:>7.1f}"
              f"{mem.temp_size_in_bytes / MIB:>10.0f}{peak / MIB:>10.0f}{mem.alias_size_in_bytes / MIB:>10.0f}"
              f"{t[name].wall:>10.2f}{t[name].cpu:>7.2f}{tokens / t[name].wall:>10.0f}")
    b = out[base_name]
    print("  effect (policy / baseline):")
    for name, row in out.items():
        if name != base_name:
            print(f"  {name:<42}compile {row['compile_cpu'] / b['compile_cpu']:.2f}x (CPU s), temp "
                  f"{row['temp'] / b['temp']:.2f}x, peak {row['peak'] / b['peak']:.2f}x, update time "
                  f"{row['wall'] / b['wall']:.2f}x wall, {row['cpu'] / b['cpu']:.2f}x CPU")
    return out


def depth_sweep(args) -> dict[tuple[int, bool], float]:
    """Trace + lower and compile seconds of the update against depth, scan on and off (best of `--sweep-rounds`)."""
    update = UpdateConfig(mini_batch_size=4, micro_batch_size=2, learning_rate=1e-6, logp_time_chunk=64)
    batch = bench_train.synthetic_batch(8, 64, 512)
    print(f"[compile vs depth] the update of a narrow model (hidden {args.sweep_hidden}, vocab 512, 4 x 64 tokens): "
          f"trace + lower and XLA compile, best of {args.sweep_rounds} rounds, wall (CPU) seconds")
    best: dict[tuple[int, bool], list[float]] = {}
    for _ in range(args.sweep_rounds):
        for depth in args.depths:
            for scan in (True, False):
                cfg = ModelConfig(vocab_size=512, hidden_size=args.sweep_hidden,
                                  intermediate_size=2 * args.sweep_hidden, num_layers=depth, num_heads=4,
                                  num_kv_heads=2, head_dim=args.sweep_hidden // 4, qkv_bias=True, scan_layers=scan)
                r = bench_train.UpdateRunner(cfg, update, batch, ObjectiveConfig(), frozen_logp=False)
                times = [r.lower_s, r.lower_cpu, r.compile_s, r.compile_cpu]
                best[depth, scan] = [min(a, b) for a, b in zip(best.get((depth, scan), times), times)]
                del r
    print(f"  {'layers':>6}{'scan: lower':>16}{'compile':>14}{'unrolled: lower':>20}{'compile':>14}"
          f"{'unrolled / scan':>17}")
    pair = lambda wall, cpu: f"{wall:.1f} ({cpu:.1f})"  # noqa: E731
    total = {key: value[0] + value[2] for key, value in best.items()}
    for depth in args.depths:
        s, u = best[depth, True], best[depth, False]
        print(f"  {depth:>6}{pair(s[0], s[1]):>16}{pair(s[2], s[3]):>14}{pair(u[0], u[1]):>20}{pair(u[2], u[3]):>14}"
              f"{total[depth, False] / total[depth, True]:>16.1f}x")
    first, last = args.depths[0], args.depths[-1]
    cpu = {key: value[1] + value[3] for key, value in best.items()}
    print(f"  {first} -> {last} layers, trace + lower + compile: scan {total[last, True] / total[first, True]:.2f}x "
          f"wall ({cpu[last, True] / cpu[first, True]:.2f}x CPU), unrolled "
          f"{total[last, False] / total[first, False]:.2f}x wall ({cpu[last, False] / cpu[first, False]:.2f}x CPU)")
    return total


def main(argv=None) -> None:
    args = parse_args(argv)
    print(f"devices: {jax.devices()[0].platform} x{jax.device_count()}, {os.cpu_count()} CPUs")
    policy_table(args)
    if args.depths:
        depth_sweep(args)


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
