"""One ragged step over the paged KV cache (`Transformer.ragged_step`) compiled by XLA's TPU compiler for a pod
topology on this CPU: JAX's Pallas ragged paged attention kernel against the plain-XLA gather reference, side by
side. Per chip: the arguments, the pool's bytes (donated: aliased to the output), the temporaries, and the compile
time. A model preset's shapes with fewer layers (the scanned layer body compiles once, so the temporaries are those
of any depth; the pool and the weights grow with it). Heads are split over the topology's chips (tensor
parallelism); parameters and activations in bfloat16.

    python bench/paged_step.py          # qwen2.5-7b (2 layers), v4:2x2x1, 512 tokens of 64 sequences, context 4096
    python bench/paged_step.py --preset qwen2.5-3b --topology v5e:2x2 --tokens 256 --seqs 32 --context 8192
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from llds_jax import parallel
from llds_jax.aot import compile_check
from llds_jax.model import Transformer, pages_spec, preset

GIB = float(1 << 30)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen2.5-7b")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--topology", default="v4:2x2x1")
    p.add_argument("--tokens", type=int, default=512, help="token budget T of the ragged batch")
    p.add_argument("--seqs", type=int, default=64, help="sequences S of a batch")
    p.add_argument("--context", type=int, default=4096, help="tokens a sequence's page table covers")
    p.add_argument("--page-size", type=int, default=32)
    p.add_argument("--pages", type=int, default=0, help="pool pages (0: seqs x context / page size)")
    p.add_argument("--overrides", default="", help="extra ModelConfig fields, name=int,... (tiny shapes in tests)")
    return p.parse_args(argv)


def compile_step(cfg, mesh, args, implementation: str) -> dict:
    """Compiles the step with one attention implementation; returns its row (GiB per chip, seconds)."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    per_seq = args.context // args.page_size
    pages = args.pages or args.seqs * per_seq
    pool = jax.ShapeDtypeStruct((cfg.num_layers, pages, args.page_size, 2 * cfg.num_kv_heads, cfg.head_dim),
                                jnp.bfloat16, sharding=NamedSharding(mesh, pages_spec(mesh, cfg.num_kv_heads)))
    int32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=NamedSharding(mesh, P()))  # noqa: E731

    def step(params, pool, tokens, kv_lens, table, cu, num):
        return nnx.merge(graphdef, params).ragged_step(tokens, pool, kv_lens, table, cu, num,
                                                       implementation=implementation)

    row = {"implementation": implementation}
    start = time.perf_counter()
    try:
        with compile_check.no_persistent_cache_writes(), jax.set_mesh(mesh):
            compiled = jax.jit(step, donate_argnums=1).lower(
                parallel.abstract_params(state, mesh), pool, int32(args.tokens), int32(args.seqs),
                int32(args.seqs, per_seq), int32(args.seqs + 1), int32(1)).compile()
    except Exception as e:  # noqa: BLE001 - a program over HBM is a result
        return {**row, "error": str(e).splitlines()[0][:200], "compile_s": time.perf_counter() - start}
    memory = compiled.memory_analysis()
    return {**row, "compile_s": time.perf_counter() - start, "arguments": memory.argument_size_in_bytes / GIB,
            "pool": memory.alias_size_in_bytes / GIB, "temporaries": memory.temp_size_in_bytes / GIB,
            "kernels": compiled.as_text().count("tpu_custom_call")}


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    overrides = {k: int(v) for k, v in (item.split("=") for item in args.overrides.split(",") if item)}
    cfg = preset(args.preset, num_layers=args.layers, dtype="bfloat16", param_dtype="bfloat16",
                 attention_platform="tpu", **overrides)
    devices, hbm = compile_check.topology_devices(args.topology)
    mesh = parallel.make_mesh(data=1, fsdp=1, tensor=len(devices), devices=devices)
    print(f"{args.preset} ({cfg.num_layers} layers, {cfg.num_heads}/{cfg.num_kv_heads} heads), {args.topology} "
          f"(tensor {len(devices)}, {hbm / GIB:.0f} GiB HBM per chip): T {args.tokens}, S {args.seqs}, context "
          f"{args.context}, pages of {args.page_size}")
    rows = [compile_step(cfg, mesh, args, implementation) for implementation in ("kernel", "reference")]
    print(f"{'attention':<10} {'compile s':>9} {'args GiB':>9} {'pool GiB':>9} {'temp GiB':>9} {'kernels':>7}")
    for r in rows:
        if "error" in r:
            print(f"{r['implementation']:<10} {r['compile_s']:>9.1f}  does not compile: {r['error']}")
        else:
            print(f"{r['implementation']:<10} {r['compile_s']:>9.1f} {r['arguments']:>9.3f} {r['pool']:>9.3f} "
                  f"{r['temporaries']:>9.3f} {r['kernels']:>7}")
    return rows


if __name__ == "__main__":
    main()
