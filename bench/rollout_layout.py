"""The pod rollout's decode chunk in the training layout against the tensor-parallel one, compiled by XLA's TPU
compiler for the config's topology (no TPU needed) and compared by the roofline of their HLO (an ESTIMATE, not a
run: llds_jax.roofline): all-gathered bytes, HBM bytes, estimated time per chunk and decode tokens/s per host, and
the ratio.

    python bench/rollout_layout.py --config configs/qwen7b_v4.py --baseline-rows 16

The baseline is `rollout.tensor_parallel = 0` at `--baseline-rows` rows per session, attending over every cache
slot (`rollout.cache_block = 0`: what the paper configs ran before 2026-12-03), the other the config as it is, both
on the dense engine (`rollout.engine = dense`). A decode that reads the filled cache blocks alone is costed with its
block loop run once.
"""
from __future__ import annotations

import argparse

import jax

from llds_jax import compile_check, roofline, topologies
from llds_jax.config_file import load_config
from llds_jax.programs import Role


def decode_chunk(config: str, overrides: list[str]):
    """(program, cost) of the config's decode chunk compiled for its topology."""
    cfg = load_config(config, overrides)
    devices, _ = compile_check.topology_devices(cfg.mesh.topology)
    program = next(p for p in compile_check.build_programs(cfg, devices) if p.role is Role.DECODE_CHUNK)
    row = compile_check.compile_row(program)
    if row.error:
        raise SystemExit(f"{program.name} ({program.shapes}) does not compile: {row.error}")
    return cfg, program, row.cost


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/qwen7b_v4.py")
    p.add_argument("--baseline-rows", type=int, default=16)
    args = p.parse_args()
    jax.config.update("jax_platforms", "cpu")
    tokens_per_s = []
    for label, overrides in (("training layout", ["rollout.engine=dense", "rollout.tensor_parallel=0",
                                                  "rollout.cache_block=0", f"rollout.max_batch_size={args.baseline_rows}"]),
                             ("as configured", ["rollout.engine=dense"])):
        cfg, program, cost = decode_chunk(args.config, overrides)
        generation = topologies.resolve(cfg.mesh.topology)[0]
        estimate = roofline.roofline_seconds(cost, roofline.PEAKS[generation])
        rows = int(program.shapes.split()[0])
        tokens_per_s.append(rows * cfg.rollout.decode_chunk / estimate.seconds)
        print(f"{label:16s} {program.shapes}: all-gathered {cost.collective_bytes.get('all-gather', 0) / 1e9:.1f} GB, "
              f"HBM {cost.hbm_bytes / 1e9:.1f} GB, {estimate.seconds * 1e3:.0f} ms per chunk ({estimate.bound}), "
              f"{tokens_per_s[-1]:,.0f} tokens/s per host (estimate)", flush=True)
    print(f"ratio: {tokens_per_s[1] / tokens_per_s[0]:.1f}x decode tokens/s per host")


if __name__ == "__main__":
    main()
