"""The pod rollout's step program (its largest token bucket) in the training layout against the tensor-parallel one,
compiled by XLA's TPU compiler for the config's topology (no TPU needed) and compared by the roofline of their HLO
(an ESTIMATE, not a run: llds_jax.aot.roofline): all-gathered bytes, HBM bytes, estimated time per call (its decode
loop counted once) and the ratio.

    python bench/rollout_layout.py --config configs/qwen7b_v4.py --baseline-rows 16

The baseline is `rollout.tensor_parallel = 0` at `--baseline-rows` sequence slots, the other the config as it is.
(The rows of docs/benchmarks.md before 2026-12-06 measured the removed dense engine's decode chunk.)
"""
from __future__ import annotations

import argparse

import jax

from llds_jax import checks, topologies
from llds_jax.aot import compile_check, roofline
from llds_jax.config.loader import load_config
from llds_jax.programs import Role


def largest_step(config: str, overrides: list[str]):
    """(run config, program, cost) of the config's rollout step program at its largest token bucket, compiled for
    its topology."""
    cfg = load_config(config, overrides)
    devices, _ = compile_check.topology_devices(cfg.mesh.topology)
    run = checks.validate(cfg, len(devices))
    program = [p for p in compile_check.build_programs(run, devices)
               if p.role is Role.ROLLOUT_STEP and not p.name.startswith("eval ")][-1]
    row = compile_check.compile_row(program)
    if row.error:
        raise SystemExit(f"{program.name} ({program.shapes}) does not compile: {row.error}")
    return run, program, row.cost


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/qwen7b_v4.py")
    p.add_argument("--baseline-rows", type=int, default=16)
    args = p.parse_args()
    jax.config.update("jax_platforms", "cpu")
    seconds = []
    for label, overrides in (("training layout", ["rollout.tensor_parallel=0",
                                                  f"rollout.max_batch_size={args.baseline_rows}"]),
                             ("as configured", [])):
        run, program, cost = largest_step(args.config, overrides)
        generation = topologies.resolve(run.mesh.topology)[0]
        estimate = roofline.roofline_seconds(cost, roofline.PEAKS[generation])
        seconds.append(estimate.seconds)
        print(f"{label:16s} {program.name}, {program.shapes}: all-gathered "
              f"{cost.collective_bytes.get('all-gather', 0) / 1e9:.1f} GB, HBM {cost.hbm_bytes / 1e9:.1f} GB, "
              f"{estimate.seconds * 1e3:.0f} ms per call ({estimate.bound}; an estimate)", flush=True)
    print(f"ratio: {seconds[0] / seconds[1]:.1f}x less time per call as configured")


if __name__ == "__main__":
    main()
