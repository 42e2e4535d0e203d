"""The demo's rollout under each scheduling policy of the rollout engine, side by side in one process: seconds per
rollout, decode occupancy, programs compiled, step calls per rollout, and whether the chains are token-identical to
the barrier policy's with the same sessions (the same PRNG streams); per device call, the host's milliseconds (the
rollout's seconds neither waiting for the device's results nor for a search: scheduling, cutting and parsing turns,
observations) and the device's (each call from its dispatch, or the end of the call before, to its results, as a
watcher thread sees them), and the share of the rollout the device sat idle (1 - device seconds / rollout seconds).
The engine dispatches the next call before it absorbs the one in flight (`rollout.engine`, overlap), so the host's
work hides behind the device's: the idle share is the host's work that a call does not cover, the searches' wait and
the first call's dispatch. The interpreter hands the GIL over every 0.1 ms (`sys.setswitchinterval`; 5 ms by
default), so that the watcher's and the decode thread's times of a call's results are within that of the device's.

The rollout is the demo's training rollout (configs/demo_cpu.py: 8 questions x 8 samples at temperature 1, two
searching turns of up to 32 tokens, observations of up to 128, top-1 BM25 retrieval over the demo's world, decode
chunks of 8) with the policy of --policy (default: the demo's seed-0 warm start that the engine tests use,
tests/rollout/fixtures/demo_greedy/policy). The policies: "barrier" (one turn-synchronous batch of every sequence),
"barrier R" (sessions of --rows sequences: other PRNG streams than one batch's), "continuous R" (a stream through
--rows slots; the streams of "barrier R", so the same tokens) and "tree" (each question's 8 samples as 2 trees of 1 + 1 x 3 leaves: forks share
their parent's pages; other trajectories by design). Each is run once to compile, then --repeats times (the best time
is reported; after the first run every token bucket is compiled, as the trainer does); "programs" counts the
executables it built over all its runs (one step program per token bucket).

The dense-cache engine this bench compared the paged one with is gone (db635b6 is the last commit that has it);
docs/benchmarks.md keeps that comparison.

--one-call runs each engine one call at a time instead (`Engine.overlap` off: the host and the device take turns),
for comparison on the same code.

    python bench/engine.py [--repeats 3] [--rows 16] [--policy DIR] [--one-call]
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
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
from llds_jax.search.factory import make_retriever
from llds_jax.model.tokenizer import load_tokenizer

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


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", default=os.path.join(ROOT, "tests", "rollout", "fixtures", "demo_greedy", "policy"))
    p.add_argument("--questions", type=int, default=8)
    p.add_argument("--samples", type=int, default=8, help="samples per question (the tree policy needs 8)")
    p.add_argument("--rows", type=int, default=16, help="sequences per session (barrier R) and slots (continuous R)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-step-tokens", type=int, default=512)
    p.add_argument("--one-call", action="store_true", help="one call at a time: no overlap (module docstring)")
    args = p.parse_args(argv)
    sys.setswitchinterval(1e-4)  # (module docstring)

    model = hf_io.load_model(args.policy, dtype="float32", param_dtype="float32")
    graphdef, params = nnx.split(model)
    tokenizer = load_tokenizer(args.policy)
    sampling = SamplingConfig(temperature=1.0, top_p=1.0, decode_chunk=8, stop_ids=agent.turn_stop_ids(tokenizer))
    policies = {"barrier": {}, f"barrier {args.rows}": dict(max_batch_size=args.rows),
                f"continuous {args.rows}": dict(continuous_batching=True, max_batch_size=args.rows)}
    if args.samples == 8:
        policies["tree"] = dict(trees=2, tree_rounds=1, tree_forks=3)
    with tempfile.TemporaryDirectory() as work:
        files = synthetic.write_world(synthetic.make_world(num_people=400, seed=0), os.path.join(work, "world"))
        build_bm25(CorpusReader(files["corpus.jsonl"]), os.path.join(work, "index"))
        examples = [q for q in read_qa(files["test.parquet"])[:args.questions] for _ in range(args.samples)]
        results = {}
        for name, changes in policies.items():
            config = AgentConfig(**DEMO_AGENT, **changes)
            slots = config.max_batch_size or len(examples)
            sampler = PagedSampler(graphdef, model.cfg, sampling, engine_config(
                config, sampling, slots, args.page_size, args.max_step_tokens))
            if args.one_call:
                sampler = OneCallAtATime(sampler)
            results[name] = measure(sampler, params, tokenizer, os.path.join(work, "index"), examples, config,
                                    args.repeats, args.samples)
    print(f"demo rollout: {len(examples)} sequences ({args.questions} questions x {args.samples}), temperature 1, "
          f"best of {args.repeats}, {'one call at a time' if args.one_call else 'overlapping calls'}; "
          f"{jax.devices()[0].device_kind}")
    print(f"{'policy':<14} {'s/rollout':>9} {'vs barrier':>10} {'occupancy':>9} {'programs':>8} {'compile s':>9} "
          f"{'identical':>9} {'calls':>5} {'host ms/call':>12} {'device ms/call':>14} {'device idle':>11} "
          f"(continuous: to barrier {args.rows}; barrier {args.rows}: to barrier, other streams)")
    barrier = results["barrier"]
    for name, r in results.items():
        reference = results[f"barrier {args.rows}"] if name.startswith("continuous") else barrier
        same = "-" if name == "tree" else (f"{sum(a == b for a, b in zip(reference['tokens'], r['tokens']))}"
                                           f"/{len(examples)}")
        print(f"{name:<14} {r['seconds']:9.2f} {barrier['seconds'] / r['seconds']:9.2f}x {r['occupancy']:9.1%} "
              f"{r['programs']:8d} {r['compile_s']:9.1f} {same:>9} {r['calls']:5d} {r['host_ms']:12.2f} "
              f"{r['device_ms']:14.2f} "
              f"{r['idle']:11.1%}")
    return results


class OneCallAtATime:
    """A PagedSampler whose engines run one call at a time (--one-call)."""

    def __init__(self, sampler: PagedSampler):
        self.sampler, self.token_budgets = sampler, sampler.token_budgets

    def engine(self, params, stop_matcher=None):
        engine = self.sampler.engine(params, stop_matcher)
        engine.overlap = False
        return engine

    def freeze_shapes(self) -> int:
        return self.sampler.freeze_shapes()


def measure(sampler, params, tokenizer, index: str, examples, config: AgentConfig, repeats: int,
            group_size: int) -> dict:
    """One policy's rollouts: the first compiles (then every token bucket it did not run); the best of `repeats`
    more is timed."""
    async def one():
        async with make_retriever({"backend": "bm25", "index_dir": index}) as retriever:
            request = agent.RolloutRequest(examples, jax.random.key(0), config, group_size=group_size)
            return await agent.rollout_async(sampler, params, tokenizer, retriever, request)

    seconds, result = [], None
    with counting_compiles() as compiles:
        for run in range(repeats + 1):
            start = time.perf_counter()
            result = asyncio.run(one())
            seconds.append(time.perf_counter() - start)
            if run == 0:
                sampler.freeze_shapes()  # as the trainer does after its first rollout: no compile in a timed run
    stats = result.stats  # of the last run
    calls = sum(stats.counts.calls.values())
    return {"seconds": min(seconds[1:]), "occupancy": result.metrics["decode_occupancy"],
            "host_ms": stats.host_s / calls * 1e3, "device_ms": stats.decode_s / calls * 1e3,
            "idle": 1 - stats.decode_s / stats.rollout_s, "calls": calls,
            "programs": len(compiles), "compile_s": sum(compiles),
            "tokens": [t.tokens.tolist() for t in result.trajectories]}


if __name__ == "__main__":
    main()
