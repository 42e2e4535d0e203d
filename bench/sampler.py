"""The rollout's sampler (`llds_jax.rollout.sampling.sample_tokens`: the nucleus by bisection over exact fixed-point
sums, one uniform per row) vs the textbook sampler (a sort of each row, a float32 cumsum for the nucleus, Gumbel-max
over the kept logits: Hugging Face's `TopPLogitsWarper` then a categorical draw), side by side in one process at the
rollout's shape: seconds per call and the ratio.

Both are jitted over [B, V] float32 logits (random normal, scaled by --scale so that the nucleus holds a realistic
number of tokens); the time is the median of --repeats calls after one to compile. "project / reference" below 1
means the project's sampler is faster. The two draw from the same distribution but not the same tokens (other
random numbers); the project's tokens do not depend on the batch (tests/rollout/test_sampling.py), the reference's
float32 cumsum does.

    python bench/sampler.py [--rows 128] [--vocab 152064] [--repeats 5]
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from llds_jax.rollout.config import SamplingConfig
from llds_jax.rollout.sampling import sample_tokens


def reference_sample(logits_bv: jax.Array, key: jax.Array, cfg: SamplingConfig) -> tuple[jax.Array, jax.Array]:
    """The textbook draw (int32 tokens [B], float32 log-probs [B] of log_softmax(logits / temperature)): top-k by
    `lax.top_k`, the nucleus by sorting each row and a float32 cumsum (a token is kept while the mass before it is
    below top_p), then `jax.random.categorical` over the kept logits."""
    if cfg.greedy:
        tokens_b = jnp.argmax(logits_bv, axis=-1)
        return tokens_b, jnp.take_along_axis(jax.nn.log_softmax(logits_bv), tokens_b[:, None], axis=1)[:, 0]
    x_bv = logits_bv / cfg.temperature
    logp_bv = jax.nn.log_softmax(x_bv)
    masked_bv = x_bv
    if cfg.top_k:
        kth_b1 = jax.lax.top_k(x_bv, cfg.top_k)[0][:, -1:]
        masked_bv = jnp.where(x_bv < kth_b1, -jnp.inf, masked_bv)
    if cfg.top_p < 1:
        sorted_bv = jnp.sort(masked_bv, axis=-1)[:, ::-1]
        probs_bv = jax.nn.softmax(sorted_bv)
        before_bv = jnp.cumsum(probs_bv, axis=-1) - probs_bv
        kept_b = jnp.sum(before_bv < cfg.top_p, axis=-1)
        floor_b1 = jnp.take_along_axis(sorted_bv, kept_b[:, None] - 1, axis=1)
        masked_bv = jnp.where(masked_bv < floor_b1, -jnp.inf, masked_bv)
    tokens_b = jax.random.categorical(key, masked_bv, axis=-1)
    return tokens_b, jnp.take_along_axis(logp_bv, tokens_b[:, None], axis=1)[:, 0]


def seconds(fn, args, repeats: int) -> float:
    """Median seconds of one call of the compiled fn(*args), after a call that compiles it."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=128, help="rows sampling at once (a decode iteration's)")
    parser.add_argument("--vocab", type=int, default=152064, help="Qwen2.5's padded vocabulary")
    parser.add_argument("--scale", type=float, default=4.0, help="the logits' standard deviation")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    logits_bv = args.scale * jax.random.normal(jax.random.key(0), (args.rows, args.vocab), jnp.float32)
    keys_b = jax.random.split(jax.random.key(1), args.rows)
    settings = {"top_p 0.95": SamplingConfig(top_p=0.95), "top_p 1": SamplingConfig(top_p=1.0),
                "top_k 50, top_p 0.95": SamplingConfig(top_k=50, top_p=0.95),
                "greedy": SamplingConfig(greedy=True)}
    print(f"{args.rows} rows x {args.vocab:,} vocabulary, float32 logits, {jax.devices()[0].platform}; "
          f"median of {args.repeats} calls")
    print(f"{'setting':<22} {'project ms':>11} {'reference ms':>13} {'project / reference':>20}")
    for name, cfg in settings.items():
        project = seconds(jax.jit(lambda x, k, cfg=cfg: sample_tokens(x, k, cfg)), (logits_bv, keys_b), args.repeats)
        reference = seconds(jax.jit(lambda x, k, cfg=cfg: reference_sample(x, k, cfg)), (logits_bv, keys_b[0]),
                            args.repeats)
        print(f"{name:<22} {1e3 * project:11.1f} {1e3 * reference:13.1f} {project / reference:20.2f}")


if __name__ == "__main__":
    main()
