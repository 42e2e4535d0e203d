"""Sampled decoding on a mesh of CPU devices against one device, printed as a ratio.

The same random model (bench/rollout.py's `model_config`: Qwen2 shapes, vocabulary 151,936 by default), the same
prompts and PRNG key, temperature-1 sampling of --new-tokens tokens per row: the rollout engine on one device against
the engine on a (data --data, tensor --tensor) mesh of fake CPU devices
(`XLA_FLAGS=--xla_force_host_platform_device_count`, set here when unset). On 2 cores the mesh shares the same
cores, so the ratio measures what partitioning adds (collectives, layout), not parallel speed-up; the fake devices
run the same XLA CPU code a multi-host CPU test runs. Also prints how many sampled tokens agree: the engine's
streams do not depend on the layout, but over a random model's near-uniform 152k-token distribution the rounding
of sharded matmuls flips a draw now and then, after which that row's tokens differ.

    python bench/mesh_decode.py
    python bench/mesh_decode.py --batch 8 --new-tokens 32 --data 2 --tensor 2
"""
from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rollout import Engines, add_model_args, best_time, model_config  # noqa: E402

from llds_jax import parallel  # noqa: E402
from llds_jax.model import Transformer  # noqa: E402
from llds_jax.rollout.config import SamplingConfig  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--batch", type=int, default=8, help="rows (a multiple of --data)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32, help="sampled tokens per row")
    p.add_argument("--decode-chunk", type=int, default=8)
    p.add_argument("--data", type=int, default=2, help="the mesh's data axis")
    p.add_argument("--tensor", type=int, default=2, help="the mesh's tensor axis")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per side (the best is reported)")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    model = Transformer(model_config(args), rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    config = SamplingConfig(temperature=1.0, top_p=1.0, decode_chunk=args.decode_chunk)
    prompts = np.random.RandomState(0).randint(10, args.vocab, size=(args.batch, args.prompt_len)).tolist()
    mesh = parallel.make_mesh(data=args.data, fsdp=1, tensor=args.tensor,
                              devices=jax.devices()[:args.data * args.tensor])
    max_context = args.prompt_len + args.new_tokens + 1
    cfg = model_config(args)
    sides = {"one device": (Engines(graphdef, cfg, config, args.batch, max_context), params),
             f"mesh data {args.data} x tensor {args.tensor}": (
                 Engines(graphdef, cfg, config, args.batch, max_context, mesh=mesh),
                 jax.device_put(params, parallel.param_shardings(params, mesh)))}
    seconds, tokens = {}, {}
    for name, (engines, side_params) in sides.items():
        seconds[name], tokens[name] = best_time(lambda: engines.turns(side_params, prompts, args.new_tokens),
                                                args.repeats)
    one, meshed = sides
    agree = sum(a == b for row_a, row_b in zip(tokens[one], tokens[meshed]) for a, b in zip(row_a, row_b))
    total = sum(len(row) for row in tokens[one])
    print(f"{args.batch} rows x {args.new_tokens} sampled tokens, vocabulary {args.vocab}, "
          f"decode chunks of {args.decode_chunk}, best of {args.repeats}:")
    for name in sides:
        print(f"  {name:24s} {seconds[name]:8.3f} s  ({seconds[name] / args.new_tokens * 1e3:8.1f} ms per step)")
    print(f"  ratio mesh / one device: {seconds[meshed] / seconds[one]:.2f}x; sampled tokens agreeing: "
          f"{agree} of {total}")
    return {"seconds": seconds, "agree": agree, "total": total}


if __name__ == "__main__":
    main()
