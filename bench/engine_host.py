"""The rollout engine's host time per device call (`EngineCounts.host_s`: scheduling, the batch's arrays, taking the
samples in, the stop strings), apart from any device: the engine drives a device stand-in that answers at once
(`InstantRunner`: each row's samples drawn from a seeded generator, a stop id with probability --stop-p per token),
with the real Qwen2.5 tokenizer's stop-string matcher, through multi-turn conversations of a GRPO-shaped batch
(groups of 8 samples sharing a prompt of --prompt-tokens; each ended turn extended by --observation-tokens until
--turns turns), at several sequence counts. The device's own time is not in it: what it prints is what a step
costs the host beside the device's work (issue 67's target: <= 2 ms per call at 128 sequences on this machine).

    python bench/engine_host.py [--sequences 32 64 128 256] [--repeats 3] [--emit]

`--emit` also prints the figures as the step estimate's table (`llds_jax.aot.measured.HOST`: the host's time per
call the kernel-faithful estimate adds per step call, at the call's sequences in flight), with the command, the
commit and this machine.
"""
from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time

import numpy as np

from llds_jax.model import tokenizer as tokenizer_lib
from llds_jax.rollout.engine import Engine, EngineConfig, StepResult
from llds_jax.rollout.paged_sampler import token_budgets
from llds_jax.rollout.stop_strings import StopMatcher

GROUP = 8
STOP_ID = 151643  # Qwen2.5's <|endoftext|>
VOCAB = 151643    # token ids drawn below the special tokens


class InstantRunner:
    """A device that answers at once: each sampling row's tokens drawn from a seeded generator, a stop id with
    probability `stop_p` per token (`step_calls.StepRunner`)."""

    def __init__(self, seed: int, stop_p: float):
        self.rng, self.stop_p = np.random.default_rng(seed), stop_p
        self.seconds = 0.0  # in `run`, which `host_ms_per_call` takes off the step's time

    def run(self, params, batch) -> StepResult:
        start = time.perf_counter()
        result = self._draw(batch)
        self.seconds += time.perf_counter() - start
        return result

    def _draw(self, batch) -> StepResult:
        s, c = batch.samples_s.shape[0], batch.decode_chunk
        tokens_sc = self.rng.integers(0, VOCAB, (s, c), dtype=np.int32)
        stops_sc = self.rng.random((s, c)) < self.stop_p
        tokens_sc[stops_sc] = STOP_ID
        within_sc = np.arange(c)[None, :] < batch.samples_s[:, None]
        first_stop_s = np.where((stops_sc & within_sc).any(axis=1), np.argmax(stops_sc & within_sc, axis=1) + 1,
                                batch.samples_s)
        return StepResult(tokens_sc, np.zeros((s, c), np.float32), first_stop_s.astype(np.int32))


def host_ms_per_call(sequences: int, matcher: StopMatcher, args) -> tuple[float, int]:
    """(the engine's host milliseconds per step call, calls) of one batch of `sequences` conversations."""
    rng = np.random.default_rng(1)
    max_context = args.prompt_tokens + args.turns * (args.turn_tokens + args.observation_tokens)
    config = EngineConfig(max_seqs=sequences, token_budgets=token_budgets(sequences, args.max_step_tokens),
                          decode_chunk=args.decode_chunk, page_size=args.page_size,
                          num_pages=sequences * -(-max_context // args.page_size) + 1, max_context=max_context,
                          stop_ids=(STOP_ID,))
    runner = InstantRunner(2, args.stop_p)
    engine = Engine(runner, None, config, matcher)
    prompts = [rng.integers(0, VOCAB, args.prompt_tokens).tolist() for _ in range(-(-sequences // GROUP))]
    for seq in range(sequences):
        engine.add_request(seq, prompts[seq // GROUP], np.array([seq, 0], np.uint32), args.turn_tokens)
    turns, calls, step_s = dict.fromkeys(range(sequences), 0), 0, 0.0
    while engine.running:
        calls += 1
        start = time.perf_counter()
        ended = engine.step()
        step_s += time.perf_counter() - start
        for seq, turn in ended:
            turns[seq] += 1
            if turns[seq] < args.turns:
                observation = rng.integers(0, VOCAB, args.observation_tokens).tolist()
                engine.extend(seq, len(turn.token_ids), observation, args.turn_tokens)
            else:
                engine.finish(seq)
    return (step_s - runner.seconds) / calls * 1e3, calls


def main(argv=None) -> dict[int, float]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sequences", type=int, nargs="+", default=[32, 64, 128, 256])
    p.add_argument("--repeats", type=int, default=3, help="batches per sequence count (the best is reported)")
    p.add_argument("--prompt-tokens", type=int, default=300)
    p.add_argument("--turn-tokens", type=int, default=500)
    p.add_argument("--observation-tokens", type=int, default=400)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--stop-p", type=float, default=1 / 150, help="a turn's mean length is about 1 / stop-p tokens")
    p.add_argument("--decode-chunk", type=int, default=32)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--max-step-tokens", type=int, default=1024)
    p.add_argument("--emit", action="store_true", help="print the figures as llds_jax/aot/measured.py's HOST")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        matcher = StopMatcher(tokenizer_lib.load_tokenizer(tokenizer_lib.write_qwen25_tokenizer(folder, "base")))
    print(f"engine host time per step call (no device), decode chunk {args.decode_chunk}, pages of "
          f"{args.page_size}, groups of {GROUP}, up to {args.turns} turns; best of {args.repeats}")
    print(f"{'sequences':>9} {'calls':>6} {'host ms/call':>12}")
    results = {}
    for sequences in args.sequences:
        runs = [host_ms_per_call(sequences, matcher, args) for _ in range(args.repeats)]
        results[sequences] = min(ms for ms, _ in runs)
        print(f"{sequences:>9} {runs[0][1]:>6} {results[sequences]:>12.2f}")
    if args.emit:
        print(emit(results, argv if argv is not None else sys.argv[1:]))
    return results


def emit(results: dict[int, float], argv: list[str]) -> str:
    """`results` as llds_jax/aot/measured.py's HOST line: the command, commit and machine beside them (the date
    goes to docs/benchmarks.md's row)."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or "unknown"
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    machine = f"{platform.machine()} CPU, {os.cpu_count()} cores, load average {load}"
    command = " ".join(["python bench/engine_host.py", *argv])
    return (f"HOST = HostTable({tuple(results)}, {tuple(round(ms, 2) for ms in results.values())}, {command!r}, "
            f"{commit!r}, {machine!r})")


if __name__ == "__main__":
    main()
