"""Chunked vs naive (full [B, T, V] logits) log-probs + entropies: peak memory and time, printed as ratios.

Peak memory is XLA's compiled estimate (`memory_analysis()`: arguments + outputs + temporaries) of one jitted call;
time is the median wall time of `--repeats` calls after a warm-up. Both for the forward pass (old_logp / ref_logp)
and for forward + backward (the loss).

    python bench/logprobs.py                          # vocab 151936 (Qwen2.5), B=2, T=256, D=256, chunk 64
    python bench/logprobs.py --seq 1024 --chunk 128 --hidden 512
    python bench/logprobs.py --batch 16 --seq 4096 --hidden 3584 --chunk 256 --dtype bfloat16 --repeats 0  # 7B shape
"""
import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from llds_jax.rl.logprobs import token_logp_entropy


def naive(hidden_btd, w_dv, targets_bt, temperature):
    logp_btv = jax.nn.log_softmax(
        jnp.einsum("btd,dv->btv", hidden_btd, w_dv, preferred_element_type=jnp.float32) / temperature, axis=-1)
    logp_bt = jnp.take_along_axis(logp_btv, targets_bt[..., None], axis=-1)[..., 0]
    return logp_bt, -jnp.sum(jnp.exp(logp_btv) * logp_btv, axis=-1)


def scalar_loss(fn):
    def loss(hidden_btd, w_dv, targets_bt):
        logp_bt, entropy_bt = fn(hidden_btd, w_dv, targets_bt)
        return jnp.mean(logp_bt) + 0.001 * jnp.mean(entropy_bt)

    return loss


def measure(fn, args, repeats):
    """(peak bytes estimate, temporary bytes, median seconds) of jit(fn)(*args)."""
    compiled = jax.jit(fn).lower(*args).compile()
    mem = compiled.memory_analysis()
    peak = mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes - mem.alias_size_in_bytes
    if repeats == 0:
        return peak, mem.temp_size_in_bytes, float("nan")
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    return peak, mem.temp_size_in_bytes, statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--chunk", type=int, default=64, help="time steps per chunk")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="hidden / weight dtype")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=2,
                        help="timed calls per variant; 0 = compile only (memory estimates at any size, no run)")
    args = parser.parse_args()

    keys = jax.random.split(jax.random.key(0), 3)
    dtype = jnp.dtype(args.dtype)
    shapes = (jax.ShapeDtypeStruct((args.batch, args.seq, args.hidden), dtype),
              jax.ShapeDtypeStruct((args.hidden, args.vocab), dtype),
              jax.ShapeDtypeStruct((args.batch, args.seq), jnp.int32))
    inputs = shapes if args.repeats == 0 else (
        jax.random.normal(keys[0], shapes[0].shape, dtype),
        (jax.random.normal(keys[1], shapes[1].shape) / args.hidden**0.5).astype(dtype),
        jax.random.randint(keys[2], shapes[2].shape, 0, args.vocab))
    chunked = lambda h, w, t: token_logp_entropy(h, w, t, temperature=args.temperature,  # noqa: E731
                                                 time_chunk=args.chunk)
    full = lambda h, w, t: naive(h, w, t, args.temperature)  # noqa: E731

    print(f"B={args.batch} T={args.seq} D={args.hidden} V={args.vocab} chunk={args.chunk} dtype={args.dtype} "
          f"on {jax.devices()[0].platform}; full logits = {args.batch * args.seq * args.vocab * 4 / 2**20:.0f} MiB")
    print(f"{'pass':<18}{'peak MiB naive/chunked':>24}{'ratio':>8}{'temp MiB naive/chunked':>24}{'ratio':>8}"
          f"{'s naive/chunked':>18}{'ratio':>8}")
    passes = {
        "forward": (full, chunked),
        "forward+backward": (jax.grad(scalar_loss(full), argnums=(0, 1)),
                             jax.grad(scalar_loss(chunked), argnums=(0, 1))),
    }
    for name, (naive_fn, chunked_fn) in passes.items():
        naive_peak, naive_temp, naive_s = measure(naive_fn, inputs, args.repeats)
        chunk_peak, chunk_temp, chunk_s = measure(chunked_fn, inputs, args.repeats)
        print(f"{name:<18}{f'{naive_peak / 2**20:.0f} / {chunk_peak / 2**20:.0f}':>24}{naive_peak / chunk_peak:>7.1f}x"
              f"{f'{naive_temp / 2**20:.0f} / {chunk_temp / 2**20:.0f}':>24}{naive_temp / chunk_temp:>7.1f}x"
              f"{f'{naive_s:.3f} / {chunk_s:.3f}':>18}{chunk_s / naive_s:>7.2f}x")
    print("peak = arguments + outputs + temporaries (incl. w_dv and its gradient); memory ratios are naive / chunked "
          "(higher is better), the time ratio chunked / naive (lower is better)")


if __name__ == "__main__":
    main()
