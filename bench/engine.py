"""The demo's rollout on the dense-cache engine and on the paged engine, side by side in one process, printed as
ratios: seconds per rollout, decode occupancy, programs compiled, trajectories token-identical.

The rollout is the demo's training rollout (configs/demo_cpu.py: 8 questions x 8 samples at temperature 1, two
searching turns of up to 32 tokens, observations of up to 128, top-1 BM25 retrieval over the demo's world, decode
chunks of 8) with the policy of --policy (default: the demo's seed-0 warm start that the engine tests record,
tests/rollout/fixtures/demo_greedy/policy). Each engine runs the turn-synchronous batch of all 64 sequences
("barrier") and a continuous batch of --rows slots; both sample from the same PRNG streams. Each side is run once
to compile, then --repeats times (the best time is reported); "programs" counts the executables each side built
over all its runs (the dense engine compiles per row x capacity x kind bucket, the paged one per token bucket).

    python bench/engine.py [--repeats 3] [--rows 16] [--policy DIR]
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import tempfile
import time

import jax
from flax import nnx

from index_builder.corpus import CorpusReader
from index_builder.to_bm25 import build_bm25
from llds_jax.data import synthetic
from llds_jax.data.qa import read_qa
from llds_jax.model import hf_io
from llds_jax.rollout import agent
from llds_jax.rollout.config import AgentConfig, SamplingConfig
from llds_jax.rollout.paged_sampler import PagedSampler, engine_config
from llds_jax.rollout.sampler import Sampler
from llds_jax.search.factory import make_retriever
from llds_jax.tokenizer import load_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO_AGENT = dict(max_turns=2, max_turn_tokens=32, max_observation_tokens=128, max_prompt_tokens=64,
                  max_context_tokens=512, retrieval_top_k=1)


@contextlib.contextmanager
def counting_compiles():
    """Yields a list that gets one entry per executable XLA builds inside the block."""
    events = []

    def on_compile(event, duration, **kw):
        if event.endswith("backend_compile_duration"):
            events.append(duration)

    jax.monitoring.register_event_duration_secs_listener(on_compile)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(on_compile)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", default=os.path.join(ROOT, "tests", "rollout", "fixtures", "demo_greedy", "policy"))
    p.add_argument("--questions", type=int, default=8)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--rows", type=int, default=16, help="slots (rows) of the continuous batch")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-step-tokens", type=int, default=512)
    args = p.parse_args()

    model = hf_io.load_model(args.policy, dtype="float32", param_dtype="float32")
    graphdef, params = nnx.split(model)
    tokenizer = load_tokenizer(args.policy)
    sampling = SamplingConfig(temperature=1.0, top_p=1.0, decode_chunk=8, stop_ids=agent.turn_stop_ids(tokenizer))
    with tempfile.TemporaryDirectory() as work:
        files = synthetic.write_world(synthetic.make_world(num_people=400, seed=0), os.path.join(work, "world"))
        build_bm25(CorpusReader(files["corpus.jsonl"]), os.path.join(work, "index"))
        examples = [q for q in read_qa(files["test.parquet"])[:args.questions] for _ in range(args.samples)]
        results = {}
        for policy, rows in (("barrier", 0), ("continuous", args.rows)):
            config = AgentConfig(**DEMO_AGENT, continuous_batching=policy == "continuous", max_batch_size=rows)
            slots = rows or len(examples)
            samplers = {"dense": Sampler(graphdef, sampling),
                        "paged": PagedSampler(graphdef, model.cfg, sampling, engine_config(
                            config, sampling, slots, args.page_size, args.max_step_tokens))}
            for engine, sampler in samplers.items():
                results[policy, engine] = measure(sampler, params, tokenizer, os.path.join(work, "index"),
                                                  examples, config, args.repeats)
    print(f"demo rollout: {len(examples)} sequences ({args.questions} questions x {args.samples}), temperature 1, "
          f"best of {args.repeats}; {jax.devices()[0].device_kind}")
    print(f"{'policy':<11} {'engine':<6} {'s/rollout':>9} {'occupancy':>9} {'programs':>8} {'compile s':>9} "
          f"{'identical':>9}")
    for policy in ("barrier", "continuous"):
        dense, paged = results[policy, "dense"], results[policy, "paged"]
        same = sum(a == b for a, b in zip(dense["tokens"], paged["tokens"]))
        for engine, r in (("dense", dense), ("paged", paged)):
            print(f"{policy:<11} {engine:<6} {r['seconds']:9.2f} {r['occupancy']:9.1%} {r['programs']:8d} "
                  f"{r['compile_s']:9.1f} {f'{same}/{len(examples)}':>9}")
        print(f"{policy:<11} ratio dense/paged: seconds {dense['seconds'] / paged['seconds']:.2f}x, "
              f"programs {dense['programs'] / max(paged['programs'], 1):.2f}x")


def measure(sampler, params, tokenizer, index: str, examples, config: AgentConfig, repeats: int) -> dict:
    """One engine's rollouts: the first compiles; the best of `repeats` more is timed."""
    async def one():
        async with make_retriever({"backend": "bm25", "index_dir": index}) as retriever:
            return await agent.rollout_async(sampler, params, tokenizer, retriever, examples, jax.random.key(0),
                                             config)

    seconds, result = [], None
    with counting_compiles() as compiles:
        for _ in range(repeats + 1):
            start = time.perf_counter()
            result = asyncio.run(one())
            seconds.append(time.perf_counter() - start)
    return {"seconds": min(seconds[1:]), "occupancy": result.metrics["decode_occupancy"],
            "programs": len(compiles), "compile_s": sum(compiles),
            "tokens": [t.tokens.tolist() for t in result.trajectories]}


if __name__ == "__main__":
    main()
