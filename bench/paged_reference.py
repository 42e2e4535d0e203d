"""Paged attention's reference implementation (the paged engine's CPU path) against its former form, one layer call
at a time, side by side in one process: the former gathered every token's whole page table (M * Z slots) and ran
the dense attention over it; the blocked one attends in chunks of query tokens x blocks of pages with an online
softmax, reading only the blocks up to each chunk's furthest cache index. Also each tile in --tiles, to choose the
default. Shapes: the demo engine's (64 sequence slots, page tables of 32 pages of 16 tokens, 2 key/value heads and 4
query heads of 32 dims, float32): decode (one token per sequence) and ragged batches of T = 64 .. 512 tokens, and a
prefill of T = 512 tokens from 8 sequences. Prints the median milliseconds per call and the largest difference.

    python bench/paged_reference.py [--repeats 9] [--tiles 2x32,4x64,8x64,16x64]
"""
from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from llds_jax.model import paged_kv
from llds_jax.model.attention import dense_attention
from llds_jax.model.paged_attention import reference_paged_attention

SEQS, PAGES_PER_SEQ, PAGE, KV_HEADS, HEADS, HEAD_DIM, LAYERS = 64, 32, 16, 2, 4, 32, 4


def gather_everything(q_tnh, kv_pages_pzch, kv_lens_s, page_indices_sm, cu_q_lens_s1, num_seqs):
    """The reference before blocks: each token gathers all M pages of its sequence, dense attention over them."""
    t, n, h = q_tnh.shape
    z, c = kv_pages_pzch.shape[1:3]
    m = page_indices_sm.shape[1]
    seq_t, position_t, _, valid_t = paged_kv.token_layout(cu_q_lens_s1, kv_lens_s, page_indices_sm, num_seqs, t, z)
    kv_tich = jnp.take(kv_pages_pzch, page_indices_sm[seq_t], axis=0, mode="clip").reshape(t, m * z, c, h)
    query_slot_t1 = jnp.where(valid_t, position_t, -1)[:, None]
    out_t1nh = dense_attention(q_tnh[:, None], kv_tich[:, :, 0::2], kv_tich[:, :, 1::2], query_slot_t1,
                               jnp.ones((t, m * z), bool))
    return jnp.where(valid_t[:, None, None], out_t1nh[:, 0], 0).astype(q_tnh.dtype)


def batch(rng, q_lens, kv_lens):
    """A ragged batch over a pool of every layer's pages (the engine's: slots x pages + 1 per layer), random."""
    pool_pages = LAYERS * (SEQS * PAGES_PER_SEQ + 1)
    pool = rng.normal(size=(pool_pages, PAGE, 2 * KV_HEADS, HEAD_DIM)).astype(np.float32)
    table = rng.permutation(pool_pages)[:SEQS * PAGES_PER_SEQ].reshape(SEQS, PAGES_PER_SEQ).astype(np.int32)
    num = len(q_lens)
    cu = np.concatenate([np.cumsum([0] + list(q_lens)), np.full(SEQS - num, sum(q_lens))]).astype(np.int32)
    kv = np.concatenate([kv_lens, np.ones(SEQS - num)]).astype(np.int32)
    q = rng.normal(size=(sum(q_lens), HEADS, HEAD_DIM)).astype(np.float32)
    return tuple(jnp.asarray(a) for a in (q, pool, kv, table, cu, np.array([num], np.int32)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--tiles", default="2x32,4x64,8x64,16x64",
                   help="pages per block x queries per block, each timed beside the default (4 x 32 at these shapes)")
    args = p.parse_args()
    rng = np.random.default_rng(0)
    cases = {"decode T=64, kv_len <= 256": batch(rng, [1] * 64, rng.integers(32, 257, 64)),
             "decode T=64, kv_len 512 (full table)": batch(rng, [1] * 64, np.full(64, 512)),
             "T=128 (64 x 2), kv_len <= 256": batch(rng, [2] * 64, rng.integers(32, 257, 64)),
             "T=256 (64 x 4), kv_len <= 256": batch(rng, [4] * 64, rng.integers(32, 257, 64)),
             "T=512 (64 x 8), kv_len <= 256": batch(rng, [8] * 64, rng.integers(32, 257, 64)),
             "prefill T=512 (8 x 64), kv_len 64": batch(rng, [64] * 8, np.full(8, 64)),
             "prefill T=512 (8 x 64), kv_len <= 320": batch(rng, [64] * 8, rng.integers(64, 321, 8))}
    fns = {"former": jax.jit(gather_everything), "blocked": jax.jit(reference_paged_attention)}
    for tile in filter(None, args.tiles.split(",")):
        pages, queries = map(int, tile.split("x"))
        fns[tile] = jax.jit(functools.partial(reference_paged_attention, kv_pages_per_block=pages,
                                              queries_per_block=queries))
    print(f"one layer's paged attention, median ms of {args.repeats} (tiles: pages x queries); "
          f"{jax.devices()[0].device_kind}")
    print(f"{'case':<38} " + " ".join(f"{name:>8}" for name in fns) + f" {'ratio':>7} {'max diff':>8}")
    for name, ragged in cases.items():
        want = np.asarray(fns["former"](*ragged))
        diff = max(float(np.abs(np.asarray(fn(*ragged)) - want).max()) for fn in fns.values())
        times = {f: [] for f in fns}
        for _ in range(args.repeats):
            for f, fn in fns.items():  # interleaved: the machine's load falls on every side alike
                start = time.perf_counter()
                fn(*ragged).block_until_ready()
                times[f].append(time.perf_counter() - start)
        ms = {f: 1e3 * float(np.median(v)) for f, v in times.items()}
        print(f"{name:<38} " + " ".join(f"{ms[f]:8.1f}" for f in fns)
              + f" {ms['former'] / ms['blocked']:6.1f}x {diff:8.1e}", flush=True)


if __name__ == "__main__":
    main()
