"""Where the time of a training step goes: a few steps of a run config, split into phases, with XLA compilations.

Builds the config's demo assets (and its warm start, when `sft.enabled`; both where the config puts them, so they
are cached across runs) with a temporary run folder, then runs `Trainer.train_step` plus a checkpoint save
`--steps` times (under the trainer's signal handlers, as `Trainer.run` does) and prints, per step and as shares of
the steps after the first (compilation done):

  rollout/decode          the rollout engine's steps on device (prompt and observation chunks and decoding, their
                          dispatch and the wait for their tokens)
  rollout/host            host turn handling: stop-string checks of the new tokens, cutting/parsing turns,
                          tokenizing observations, scheduling, building trajectories
  rollout/retrieval_wait  waiting for search results with nothing to decode (retrieval on the critical path;
                          searches started while other sequences decode are hidden behind decoding)
  rollout/compile_grid    after the first rollout: compiling the step program at every token bucket it did not run
                          (`PagedSampler.freeze_shapes`)
  batch                   packing the trajectories, checking and placing the batch, fetching metrics
  compile_rows            with packing, the first batch of a length: compiling the forwards of every packed-row
                          count ahead (`RLTrainStep.compile_row_counts`)
  logp                    old and reference log-probs (one forward each)
  updates                 the optimizer updates (and the post-update log-probs on LLD steps)
  checkpoint              the blocking part of an (asynchronous) Orbax save; saved every step here
  other                   the rest of the step's wall time

and tokens/s (real tokens of the training batch per second of step), the padding share of the training batch and
the XLA compilations of each step (`jax.monitoring` backend-compile events, by function). A compilation after the
first step is the first use of a new shape bucket: a longer training batch than any before (the rollout's step
programs are all compiled after the first rollout: `PagedSampler.freeze_shapes`); a program compiled again
for an input signature it was already compiled for is a bug, counted apart (from the lowerings JAX logs that a
backend compilation follows: a program compiled ahead lowers again at its first call, then finds its executable) and
expected to be 0.

    python bench/step_profile.py                                   # configs/demo_cpu.py, 3 steps
    python bench/step_profile.py --config configs/tiny_test.py --steps 2 --override rollout.max_turns=2
    python bench/step_profile.py --config.rollout.decode_chunk=8   # ml_collections-style overrides work too
    python bench/step_profile.py --search-seconds-per-query 0.05   # a loaded search backend
    python bench/step_profile.py --config.rollout.continuous_batching=True   # the continuous-batching rollout
    python bench/step_profile.py --steps 20 --compare-packing      # unpacked, then packed: the tokens/s ratio
    python bench/step_profile.py --steps 20 --compare-packing \
        --unpacked-override model.attention_query_block=512 --unpacked-override model.attention_key_block=512

The padding share is that of the rows the log-probs and updates run on (`perf/padding`): with
`optim.pack_trajectories` the packed rows, else one row per trajectory. `--compare-packing` profiles the config twice
in this process, with `optim.pack_trajectories=False` and then `True` (each from a fresh trainer, the same seed), and
prints both reports and the ratio of their tokens/s; `--unpacked-override` sets keys of the unpacked run alone (the
demo's 64-token attention tiles serve its packed rows: the second example compares with the 512-token tiles an
unpacked demo would keep).
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Optional, Sequence

import jax
import ml_collections

from llds_jax.config.loader import load_config  # the run config as the launch command reads it
from llds_jax.search.types import Retriever

PHASES = ("rollout/decode", "rollout/host", "rollout/retrieval_wait", "rollout/compile_grid",
          "batch", "compile_rows", "logp", "updates", "checkpoint", "other")
COMPILE_EVENT = "backend_compile_duration"  # /jax/core/compile/backend_compile_duration
DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "demo_cpu.py")


# ----- measurement ---------------------------------------------------------------------------------------------------
class CompileCounter:
    """Counts XLA backend compilations (with their seconds and function names) while installed, and tells the
    first compilation of a program for an input signature (function, shapes, dtypes, shardings) from a repeated
    one: the lowerings JAX logs at DEBUG level are keyed by their signature, and a signature counts as compiled once
    a backend compilation follows its lowering (a program lowered ahead and compiled is lowered again at its first
    call, and compiles nothing then; one lowered ahead and not compiled compiles at its first call)."""

    LOWERING_LOGGER = "jax._src.interpreters.pxla"

    def __init__(self):
        self.events: list[tuple[str, float]] = []
        self.lowerings: list[list] = []  # [function, signature compiled before, a backend compilation followed]
        self._compiled: set[str] = set()  # signatures a backend compilation followed
        self._handler = logging.Handler(logging.DEBUG)
        self._handler.emit = self._on_log  # type: ignore[method-assign]

    def __call__(self, event: str, duration: float, **kwargs) -> None:
        if event.endswith(COMPILE_EVENT):
            self.events.append((str(kwargs.get("fun_name", "?")), duration))
            if self.lowerings:
                self.lowerings[-1][2] = True
                self._compiled.add(self._last_signature)

    def _on_log(self, record: logging.LogRecord) -> None:
        if not str(record.msg).startswith("Compiling %s with global shapes and types"):
            return
        self._last_signature = repr(record.args)
        self.lowerings.append([str(record.args[0]), self._last_signature in self._compiled, False])

    def __enter__(self) -> "CompileCounter":
        jax.monitoring.register_event_duration_secs_listener(self)
        logger = logging.getLogger(self.LOWERING_LOGGER)
        self._saved = (logger.level, logger.propagate)
        logger.setLevel(logging.DEBUG)
        logger.propagate = False  # keep its DEBUG records off the console
        logger.addHandler(self._handler)
        return self

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_duration_listener(self)
        logger = logging.getLogger(self.LOWERING_LOGGER)
        logger.removeHandler(self._handler)
        logger.setLevel(self._saved[0])
        logger.propagate = self._saved[1]

    def mark(self) -> tuple[int, int]:
        return len(self.events), len(self.lowerings)

    def since(self, mark: tuple[int, int]) -> tuple[list[tuple[str, float]], list[list]]:
        return self.events[mark[0]:], self.lowerings[mark[1]:]


def step_phases(metrics: dict[str, float], checkpoint_s: float, wall_s: float) -> dict[str, float]:
    """Seconds per phase of one step from the trainer's metrics; `other` closes the sum to `wall_s`."""
    rollout_s = metrics["perf/rollout_s"]
    decode, wait = metrics.get("rollout/decode_s", 0.0), metrics.get("rollout/search_s", 0.0)
    phases = {
        "rollout/decode": decode, "rollout/retrieval_wait": wait,
        "rollout/host": max(rollout_s - decode - wait, 0.0),
        "rollout/compile_grid": metrics.get("perf/compile_grid_s", 0.0),
        "compile_rows": metrics.get("perf/compile_rows_s", 0.0),
        "logp": metrics["perf/logp_s"], "updates": metrics["perf/update_s"], "checkpoint": checkpoint_s,
    }
    phases["batch"] = max(metrics["perf/step_s"] - rollout_s - phases["rollout/compile_grid"] - phases["compile_rows"]
                          - phases["logp"] - phases["updates"], 0.0)
    phases["other"] = max(wall_s - sum(phases.values()), 0.0)
    return {name: phases[name] for name in PHASES}


class DelayedRetriever(Retriever):
    """A slower `inner` retriever, like a network backend: every call first waits `latency_s` (the round trip;
    calls overlap), then `seconds_per_query` per query with one batch served at a time (the backend's throughput),
    then asks `inner`."""

    def __init__(self, inner: Retriever, latency_s: float = 0.0, seconds_per_query: float = 0.0):
        self.inner, self.latency_s, self.seconds_per_query = inner, latency_s, seconds_per_query
        self.backend = inner.backend
        self._busy = asyncio.Lock()

    async def search(self, queries, k):
        await asyncio.sleep(self.latency_s)
        async with self._busy:
            await asyncio.sleep(self.seconds_per_query * len(queries))
        return await self.inner.search(queries, k)

    async def check(self) -> None:
        await self.inner.check()

    async def close(self) -> None:
        await self.inner.close()


@contextlib.contextmanager
def _run_folder(run_dir: Optional[str]):
    if run_dir:
        yield run_dir
        return
    tmp = tempfile.mkdtemp(prefix="step_profile_")
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def profile(cfg: ml_collections.ConfigDict, steps: int, checkpoint_every: int = 1, log=print,
            search_latency_s: float = 0.0, search_s_per_query: float = 0.0) -> dict[str, Any]:
    """Runs `steps` training steps of `cfg` (its run_dir must be set) and returns the profile (see `main`).

    search_latency_s, search_s_per_query: make the retriever slower (`DelayedRetriever`).
    """
    from llds_jax import checks
    from llds_jax import config as config_lib
    from llds_jax.launch import prepared
    from llds_jax.train.checkpoint import Checkpointer, rng_to_json
    from llds_jax.train.preemption import PreemptionGuard
    from llds_jax.train.trainer import Trainer

    setup = {}
    start = time.perf_counter()
    # The config's application (the demo's assets) and the warm start, as `python -m llds_jax.launch` runs them.
    run = prepared(cfg, checks.validate(cfg))
    setup["assets_and_warm_start_s"] = time.perf_counter() - start
    start = time.perf_counter()
    trainer = Trainer(run, config_lib.recorded(run, cfg))
    if search_latency_s or search_s_per_query:
        trainer.retriever = DelayedRetriever(trainer.retriever, search_latency_s, search_s_per_query)
    state = trainer.rl_train_step.init_state()
    ref_params = trainer.rl_train_step.reference_params(state.params) if run.objective.kl_coef else None
    setup["trainer_s"] = time.perf_counter() - start
    ckpt_dir = os.path.join(run.run_dir, "step_profile_checkpoints")
    shutil.rmtree(ckpt_dir, ignore_errors=True)  # a reused run folder: start from no saved step
    ckpt = Checkpointer(ckpt_dir, save_every=checkpoint_every, keep=2)
    records = []
    try:
        # Under the trainer's signal handlers, as in Trainer.run (asyncio.Runner installs its own SIGINT handler
        # per rollout only when none is set).
        with PreemptionGuard(), CompileCounter() as compiles:
            for step in range(1, steps + 1):
                mark = compiles.mark()
                start = time.perf_counter()
                state, metrics, trajectories = trainer.train_step(state, ref_params, step)
                ckpt_start = time.perf_counter()
                if ckpt.should_save(step) or step == steps:
                    ckpt.save(step, state.params, state.opt_state, {
                        "data": trainer.data.state(), "rng": rng_to_json(trainer.base_rng),
                        "nonfinite_count": int(jax.device_get(state.nonfinite_count))})
                checkpoint_s = time.perf_counter() - ckpt_start
                wall_s = time.perf_counter() - start
                compiled, lowered = compiles.since(mark)
                lengths = [len(t.tokens) for t in trajectories]
                record = {
                    "step": step, "wall_s": wall_s, "phases": step_phases(metrics, checkpoint_s, wall_s),
                    "compiles": len(compiled), "compile_s": sum(d for _, d in compiled),
                    "compiled": sorted(collections.Counter(name for name, _ in compiled).items()),
                    "repeated_signatures": sorted(collections.Counter(
                        n for n, seen, compiled in lowered if seen and compiled).items()),
                    "tokens": float(sum(lengths)), "tokens_per_s": sum(lengths) / wall_s,
                    "padding": metrics["perf/padding"], "sequence_length": metrics["perf/sequence_length"],
                    "sampled_tokens_per_s": metrics.get("rollout/sampled_tokens_per_s", 0.0),
                    "decode_occupancy": metrics.get("rollout/decode_occupancy", 0.0),
                    "searches": metrics.get("rollout/valid_searches", 0.0),
                    "search_calls_s": metrics.get("rollout/search_calls_s", 0.0),
                    "reward": metrics["reward/mean"],
                }
                records.append(record)
                log(f"step {step}: {wall_s:.2f} s, {len(compiled)} compilation(s)")
            start = time.perf_counter()
            ckpt.wait_until_finished()
            setup["checkpoint_flush_s"] = time.perf_counter() - start
    finally:
        ckpt.close()
        trainer.close()
    steady = records[1:] or records
    total = sum(r["wall_s"] for r in steady)
    shares = {name: sum(r["phases"][name] for r in steady) / total for name in PHASES}
    return {
        "setup": setup, "steps": records, "shares": shares,
        "steady_steps": [r["step"] for r in steady],
        "compiles_first_step": records[0]["compiles"],
        "compiles_after_first_step": sum(r["compiles"] for r in records[1:]),
        "recompiles_of_a_seen_signature": sum(c for r in records for _, c in r["repeated_signatures"]),
        "tokens_per_s": sum(r["tokens"] for r in steady) / total,
    }


def format_report(result: dict[str, Any]) -> str:
    steps = result["steps"]
    steady = result["steady_steps"]
    span = f"step {steady[0]}" if len(steady) == 1 else f"steps {steady[0]}-{steady[-1]}"
    head = (f"{'phase':<24}" + "".join(f"{'step ' + str(r['step']):>11}" for r in steps)
            + f"{'share (' + span + ')':>24}")
    lines = [head]
    for name in PHASES:
        lines.append(f"{name:<24}" + "".join(f"{r['phases'][name]:>10.3f}s" for r in steps)
                     + f"{result['shares'][name]:>23.1%}")
    lines.append(f"{'step wall time':<24}" + "".join(f"{r['wall_s']:>10.3f}s" for r in steps)
                 + f"{sum(result['shares'].values()):>23.1%}")
    rows = (("XLA compilations", lambda r: f"{r['compiles']:>11d}"),
            ("compile seconds", lambda r: f"{r['compile_s']:>10.2f}s"),
            ("tokens/s (batch)", lambda r: f"{r['tokens_per_s']:>11.1f}"),
            ("sampled tokens/s", lambda r: f"{r['sampled_tokens_per_s']:>11.1f}"),
            ("decode occupancy", lambda r: f"{r['decode_occupancy']:>11.1%}"),
            ("sequence length", lambda r: f"{r['sequence_length']:>11.0f}"),
            ("padding share", lambda r: f"{r['padding']:>11.1%}"),
            ("searches / trajectory", lambda r: f"{r['searches']:>11.2f}"),
            ("search calls (s)", lambda r: f"{r['search_calls_s']:>10.3f}s"),
            ("reward", lambda r: f"{r['reward']:>11.3f}"))
    lines += [f"{label:<24}" + "".join(cell(r) for r in steps) for label, cell in rows]
    for r in steps[1:]:
        if r["compiled"]:
            lines.append(f"step {r['step']} compiled: " + ", ".join(f"{n} x{c}" for n, c in r["compiled"]))
    for r in steps:
        if r["repeated_signatures"]:
            lines.append(f"step {r['step']} compiled again for input shapes it had compiled before: "
                         + ", ".join(f"{n} x{c}" for n, c in r["repeated_signatures"]))
    setup = ", ".join(f"{k[:-2].replace('_', ' ')} {v:.1f} s" for k, v in result["setup"].items())
    lines.append(f"setup (not in the steps): {setup}")
    steady_records = [r for r in steps if r["step"] in steady]
    compile_s = sum(r["compile_s"] for r in steady_records)
    lines.append(f"tokens/s ({span}): {result['tokens_per_s']:.1f}; retrieval wait "
                 f"{result['shares']['rollout/retrieval_wait']:.1%} of the step; compilation {compile_s:.1f} s "
                 f"({compile_s / sum(r['wall_s'] for r in steady_records):.1%}, inside the phases above)")
    lines.append(f"XLA compilations: step 1: {result['compiles_first_step']}, after step 1: "
                 f"{result['compiles_after_first_step']} (new shape buckets); of a program for input shapes it "
                 f"had already compiled: {result['recompiles_of_a_seen_signature']}")
    return "\n".join(lines)


# ----- command line --------------------------------------------------------------------------------------------------
def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=DEFAULT_CONFIG, help="run config file (default: configs/demo_cpu.py)")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="config override, repeatable (--config.KEY=VALUE works too)")
    p.add_argument("--steps", type=int, default=3, help="training steps to profile (>= 2 to see recompilation)")
    p.add_argument("--checkpoint-every", type=int, default=1, help="save a checkpoint every this many steps "
                   "(and after the last)")
    p.add_argument("--run-dir", default="", help="run folder (default: a temporary one, deleted afterwards); "
                   "an existing one reuses its demo assets and warm start")
    p.add_argument("--json", default="", help="also write the result dict to this file")
    p.add_argument("--search-latency", type=float, default=0.0, metavar="SECONDS",
                   help="add this round trip to every retriever call (calls overlap)")
    p.add_argument("--search-seconds-per-query", type=float, default=0.0, metavar="SECONDS",
                   help="add this much backend time per query, one batch served at a time (a loaded backend)")
    p.add_argument("--compare-packing", action="store_true", help="profile without and then with "
                   "optim.pack_trajectories, and print the ratio of tokens/s")
    p.add_argument("--unpacked-override", action="append", default=[], metavar="KEY=VALUE",
                   help="with --compare-packing: a config override for the unpacked run only, repeatable (e.g. the "
                   "attention tiles the config had before it packed)")
    args, rest = p.parse_known_args(argv)
    for arg in rest:
        if not arg.startswith("--config.") or "=" not in arg:
            p.error(f"unrecognized argument {arg!r}")
        args.override.append(arg[len("--config."):])
    if args.steps < 1:
        p.error("--steps must be >= 1")
    return args


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """Runs the profile; prints the report and returns the result dict: `steps` (per step: wall_s, phases
    (seconds), compiles, compiled names, tokens_per_s, padding, ...), `shares` (phase shares of the steps after
    the first, summing to 1), `compiles_first_step`, `compiles_after_first_step`, `tokens_per_s`, `setup`."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("absl").setLevel(logging.WARNING)
    if args.compare_packing:
        return compare_packing(args)
    cfg = load_config(args.config, args.override)
    with _run_folder(args.run_dir) as run_dir:
        cfg.run_dir = run_dir
        print(f"step_profile: {os.path.relpath(args.config)}"
              + (f" with {', '.join(args.override)}" if args.override else "")
              + (f"; search latency {args.search_latency:g} s" if args.search_latency else "")
              + (f"; {args.search_seconds_per_query:g} s per query" if args.search_seconds_per_query else "")
              + ("; continuous batching" if cfg.rollout.continuous_batching else "")
              + f"; {args.steps} step(s), {cfg.data.prompts_per_step} x {cfg.data.samples_per_prompt} trajectories "
              f"per step; devices {jax.devices()[0].platform} x{jax.device_count()}", flush=True)
        result = profile(cfg, args.steps, args.checkpoint_every, log=lambda line: print(line, flush=True),
                         search_latency_s=args.search_latency, search_s_per_query=args.search_seconds_per_query)
    print(format_report(result), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


def compare_packing(args: argparse.Namespace) -> dict[str, Any]:
    """`profile` of the config without (and with `--unpacked-override`), then with, packed trajectories; returns
    {"unpacked": result, "packed": result, "tokens_per_s_ratio": packed / unpacked}."""
    results = {}
    for name, packed in (("unpacked", False), ("packed", True)):
        overrides = [*args.override, f"optim.pack_trajectories={packed}"] + ([] if packed else args.unpacked_override)
        cfg = load_config(args.config, overrides)
        with _run_folder(args.run_dir and os.path.join(args.run_dir, name)) as run_dir:
            cfg.run_dir = run_dir
            print(f"step_profile: {os.path.relpath(args.config)}, {', '.join(overrides)}; {args.steps} step(s)",
                  flush=True)
            results[name] = profile(cfg, args.steps, args.checkpoint_every, log=lambda line: print(line, flush=True))
        print(format_report(results[name]), flush=True)
    ratio = results["packed"]["tokens_per_s"] / results["unpacked"]["tokens_per_s"]
    steady = results["packed"]["steady_steps"]
    padding = {name: sum(r["padding"] for r in result["steps"][1:] or result["steps"]) / len(steady)
               for name, result in results.items()}
    print(f"packed / unpacked tokens/s (steps {steady[0]}-{steady[-1]}): {ratio:.2f}x; padding of the trained rows "
          f"{padding['unpacked']:.1%} -> {padding['packed']:.1%}", flush=True)
    results["tokens_per_s_ratio"] = ratio
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
