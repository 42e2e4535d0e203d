"""Blockwise (online-softmax) attention vs the dense reference (full float32 [B, K, G, T, S] scores), side by side.

For each T: compiled temporary memory (XLA's `memory_analysis()`) and wall time of one jitted call, for the forward
and for forward + backward (gradients w.r.t. q, k, v of sum(w * out)), and the largest difference of the results.
Causal over T = S keys, the second row left-padded by a quarter (what a training batch of the update looks like).
Times are the best of `--repeats` interleaved rounds after a warm-up.

Then (`--update-layers` > 0) the whole GRPO + LLDS update program (RLTrainStep, one micro-batch of `--batch` rows at
the largest T) of a small decoder, compiled under `model.attention` = xla and = blockwise: its temporary memory.

    python bench/attention.py                                   # T = 512 .. 4096, 8 heads over 2 kv heads, CPU
    python bench/attention.py --seqs 4096 --batch 16 --heads 28 --kv-heads 4 --head-dim 128 \\
        --dtype bfloat16 --repeats 0 --update-layers 0          # qwen2.5-7b's attention, memory only
"""
import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from llds_jax import parallel
from llds_jax.model import ModelConfig, Transformer
from llds_jax.model.attention import attention
from llds_jax.programs import Role
from llds_jax.config.sections import ObjectiveConfig, UpdateConfig
from llds_jax.rl.train_step import RLTrainStep, TrainShapes

MIB = 2.0 ** 20


def inputs(args, t):
    keys = jax.random.split(jax.random.key(0), 4)
    dt = jnp.dtype(args.dtype)
    q = jax.random.normal(keys[0], (args.batch, t, args.heads, args.head_dim)).astype(dt)
    k = jax.random.normal(keys[1], (args.batch, t, args.kv_heads, args.head_dim)).astype(dt)
    v = jax.random.normal(keys[2], (args.batch, t, args.kv_heads, args.head_dim)).astype(dt)
    w = jax.random.normal(keys[3], q.shape).astype(dt)
    mask = np.ones((args.batch, t), bool)
    mask[1::2, : t // 4] = False  # every second row left-padded by a quarter
    slot = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (args.batch, t))
    return (q, k, v, w), slot, jnp.asarray(mask)


def programs(args, implementation, slot, valid):
    def forward(q, k, v, w):
        return attention(q, k, v, slot, valid, implementation=implementation, query_block=args.query_block,
                         key_block=args.key_block)

    def loss(q, k, v, w):
        return jnp.sum(forward(q, k, v, w).astype(jnp.float32) * w.astype(jnp.float32))

    return {"fwd": forward, "fwd+bwd": jax.grad(loss, argnums=(0, 1, 2))}


def update_temp_bytes(args, implementation: str, t: int) -> float:
    """Compiled temporaries of one update (a mini-batch of one micro-batch of `--batch` rows x t tokens)."""
    cfg = ModelConfig(vocab_size=args.update_vocab, hidden_size=args.heads * args.head_dim,
                      intermediate_size=4 * args.heads * args.head_dim, num_layers=args.update_layers,
                      num_heads=args.heads, num_kv_heads=args.kv_heads, head_dim=args.head_dim, qkv_bias=True,
                      dtype=args.dtype, remat=True, attention=implementation, attention_query_block=args.query_block,
                      attention_key_block=args.key_block)
    mesh = parallel.make_mesh(devices=jax.devices()[:1])
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    nnx.update(model, parallel.abstract_params(nnx.state(model, nnx.Param), mesh))
    step = RLTrainStep(model, ObjectiveConfig(), UpdateConfig(mini_batch_size=args.batch,
                                                              micro_batch_size=args.batch), mesh)
    programs = step.abstract_programs(TrainShapes(args.batch, t, measure_lld=False))
    update = next(program for program in programs if program.role is Role.UPDATE)
    return update.lower().compile().memory_analysis().temp_size_in_bytes


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", default="512,1024,2048,4096", help="comma-separated T (= S)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--query-block", type=int, default=512)
    p.add_argument("--key-block", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3, help="timing rounds (0: compiled memory only)")
    p.add_argument("--update-layers", type=int, default=2, help="layers of the update's decoder (0: no update)")
    p.add_argument("--update-vocab", type=int, default=4096)
    args = p.parse_args(argv)
    print(f"{jax.devices()[0].platform}: batch {args.batch}, {args.heads} heads over {args.kv_heads} kv heads x "
          f"{args.head_dim}, {args.dtype}, tiles {args.query_block} x {args.key_block}")
    print(f"{'T':>6} {'pass':>8} | {'temp MiB dense':>14} {'blockwise':>10} {'ratio':>7} | {'s dense':>9} "
          f"{'blockwise':>10} {'ratio':>7} | max |diff| / max")
    results = []
    for t in (int(s) for s in args.seqs.split(",")):
        operands, slot, valid = inputs(args, t)
        dense, blockwise = programs(args, "xla", slot, valid), programs(args, "blockwise", slot, valid)
        for name in ("fwd", "fwd+bwd"):
            compiled = [jax.jit(impl[name]).lower(*operands).compile() for impl in (dense, blockwise)]
            temp = [c.memory_analysis().temp_size_in_bytes for c in compiled]
            times, diff = [float("nan")] * 2, float("nan")
            if args.repeats:
                outs = [jax.block_until_ready(c(*operands)) for c in compiled]  # warm-up
                ref, got = (jax.tree.leaves(o) for o in outs)
                diff = max(float(jnp.max(jnp.abs(g.astype(jnp.float32) - r.astype(jnp.float32))))
                           / float(jnp.max(jnp.abs(r.astype(jnp.float32)))) for g, r in zip(got, ref))
                times = [float("inf")] * 2
                for _ in range(args.repeats):
                    for i, c in enumerate(compiled):
                        start = time.perf_counter()
                        jax.block_until_ready(c(*operands))
                        times[i] = min(times[i], time.perf_counter() - start)
            print(f"{t:>6} {name:>8} | {temp[0] / MIB:>14.1f} {temp[1] / MIB:>10.1f} {temp[0] / temp[1]:>6.1f}x | "
                  f"{times[0]:>9.3f} {times[1]:>10.3f} {times[1] / times[0]:>6.2f}x | {diff:.1e}", flush=True)
            results.append(dict(seq=t, part=name, temp_dense=temp[0], temp_blockwise=temp[1], s_dense=times[0],
                                s_blockwise=times[1], max_rel_diff=diff))
    print("ratio: temp memory dense / blockwise (higher: blockwise smaller); time blockwise / dense (lower: faster)")
    if args.update_layers:
        t = max(r["seq"] for r in results)
        temp = [update_temp_bytes(args, impl, t) for impl in ("xla", "blockwise")]
        print(f"update program ({args.update_layers} layers, hidden {args.heads * args.head_dim}, vocab "
              f"{args.update_vocab}, remat, {args.batch} x {t} tokens): temp MiB dense {temp[0] / MIB:.1f}, "
              f"blockwise {temp[1] / MIB:.1f}: {temp[0] / temp[1]:.1f}x", flush=True)
        results.append(dict(seq=t, part="update", temp_dense=temp[0], temp_blockwise=temp[1]))
    return results


if __name__ == "__main__":
    main()
