"""Synchronous vs partial rollouts (`rollout.partial`, docs/partial-rollouts.md) on the CPU demo, side by side in one
process: the same seed, world, warm start and config, `rollout.partial` and `rollout.over_sampling` the only
differences (`objective.tis_cap` is the same in every arm, so the behaviour correction is no difference either).

Each arm is a fresh `Trainer` of configs/demo_cpu.py (8 questions x 8 samples a step, two searching turns, top-1 BM25
over the demo's world, 4 updates per step) started from the demo's seed-0 warm start that the engine tests use
(tests/rollout/fixtures/demo_greedy/policy, over a world built here from the same seed: no warm start is trained),
trained `--steps` steps; the arms: "sync" (`rollout.partial` False), then "partial x1.5" and "partial x2" (`--over-
sampling`; `rollout.max_staleness` at its default 1). Step 1 compiles (the engine's token buckets, the packed-row
counts): it is printed apart.

Printed per arm (means over the steady steps: those after the first that compiled nothing; a training batch longer
than any before compiles its programs in any step, 1-2 minutes on this CPU, so such a step is counted and left out):
seconds per step (`perf/step_s`: rollout, rewards, log-probs, updates), the seconds of its rollout
(`perf/rollout_s`), trained tokens per second (the loss mask's tokens over the steps' seconds), conversations
resumed / carried / dropped (sums over the steady steps), the staleness of the trained tokens (mean, in policy
versions), the share of them sampled by an older policy, and the importance weights' effective sample size
`lld/is_ess` (1: the sampler's and the trainer's log-probs agree); then partial / sync for the seconds and tokens/s.

    python bench/partial_rollouts.py                      # 6 steps per arm, over-sampling 1.5 and 2
    python bench/partial_rollouts.py --steps 6 --override rollout.continuous_batching=False
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from typing import Optional, Sequence

import ml_collections

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from step_profile import CompileCounter  # noqa: E402  (XLA compilations per step)
from llds_jax.config.loader import load_config  # noqa: E402  (the run config as the launch command reads it)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CONFIG = os.path.join(ROOT, "configs", "demo_cpu.py")
WARM_START = os.path.join(ROOT, "tests", "rollout", "fixtures", "demo_greedy", "policy")  # seed 0's, 400 people
# Every arm: the warm start above in place of the demo's SFT stage, no evaluation or checkpoint (not timed here),
# the continuous policy (a partial step's cut comes the moment its last needed group completes: the policy partial
# rollouts are for; --override rollout.continuous_batching=False measures the barrier one).
COMMON = ("seed=0", "sft.enabled=False", "train.eval_at_start=False",
          "rollout.continuous_batching=True")
# (label, metric, how the steady steps combine: "mean", "sum", or "ratio": tokens_per_s, `summary`'s), as printed
ROWS = (("seconds per step", "perf/step_s", "mean"),
        ("rollout seconds per step", "perf/rollout_s", "mean"),
        ("trained tokens per second", "tokens_per_s", "ratio"),
        ("conversations resumed", "rollout/partial/resumed", "sum"),
        ("conversations carried", "rollout/partial/carried", "sum"),
        ("conversations dropped", "rollout/partial/dropped", "sum"),
        ("staleness mean (versions)", "rollout/partial/staleness_mean", "mean"),
        ("stale token share", "rollout/partial/stale_token_share", "mean"),
        ("lld/is_ess", "lld/is_ess", "mean"),
        ("reward", "reward/mean", "mean"))
RATIOS = ("perf/step_s", "perf/rollout_s", "tokens_per_s")  # printed as partial / sync


def arms(over_sampling: Sequence[float]) -> dict[str, list[str]]:
    """Arm name -> its overrides: "sync", then "partial xS" for each over-sampling S."""
    named = {"sync": ["rollout.partial=False"]}
    for factor in over_sampling:
        named[f"partial x{factor:g}"] = ["rollout.partial=True", f"rollout.over_sampling={factor}"]
    return named


def run_arm(cfg: ml_collections.ConfigDict, steps: int, log=print) -> list[dict[str, float]]:
    """Trains `steps` steps of `cfg` (its run_dir and demo.assets_dir set) from a fresh trainer; returns each step's
    metrics: the trainer's, plus `trained_tokens` (the loss mask's tokens) and `compile_s` (seconds of the step's XLA
    backend compilations: a training batch longer than any before compiles its programs in any step)."""
    from llds_jax import checks
    from llds_jax import config as config_lib
    from llds_jax.launch import prepared
    from llds_jax.train.trainer import Trainer

    # The world, index and data files (cached in demo.assets_dir), as the launch prepares them; the policy: WARM_START.
    run = config_lib.with_values(prepared(cfg, checks.validate(cfg)), {"model.path": WARM_START})
    trainer = Trainer(run, config_lib.recorded(run, cfg))
    try:
        state = trainer.rl_train_step.init_state()
        ref_params = trainer.rl_train_step.reference_params(state.params) if run.objective.kl_coef else None
        records = []
        with CompileCounter() as compiles:
            for step in range(1, steps + 1):
                start, mark = time.perf_counter(), compiles.mark()
                state, metrics, _ = trainer.train_step(state, ref_params, step)
                metrics["trained_tokens"] = metrics["perf/tokens_per_s"] * metrics["perf/step_s"]
                metrics["compile_s"] = sum(seconds for _, seconds in compiles.since(mark)[0])
                records.append(metrics)
                log(f"  step {step}: {time.perf_counter() - start:.1f} s ({metrics['compile_s']:.1f} s compiling), "
                    f"rollout {metrics['perf/rollout_s']:.1f} s, {metrics['trained_tokens']:.0f} trained tokens, "
                    f"carried {metrics.get('rollout/partial/carried', 0.0):.0f}")
    finally:
        trainer.close()
    return records


def summary(records: Sequence[dict[str, float]]) -> dict[str, float]:
    """Each ROWS metric over the steady steps, those after the first that compiled nothing (the steps after the
    first when every one compiled): "mean" its mean, "sum" its sum (0 for a metric the arm did not log: a
    synchronous step carries nothing), `tokens_per_s` the trained tokens over the seconds of those steps;
    `first_step_s` (seconds), `steps` (how many steady steps), `compiling_steps` (steps after the first left out:
    they compiled) and `compiling_s` (their seconds, summed)."""
    later = records[1:] or records
    steady = [r for r in later if not r["compile_s"]] or later
    compiling = [r for r in records[1:] if r["compile_s"]]
    out = {"tokens_per_s": sum(r["trained_tokens"] for r in steady) / sum(r["perf/step_s"] for r in steady),
           "first_step_s": records[0]["perf/step_s"], "steps": len(steady), "compiling_steps": len(compiling),
           "compiling_s": sum(r["perf/step_s"] for r in compiling)}
    for _, metric, how in ROWS:
        if how == "ratio":
            continue
        values = [r.get(metric, 0.0) for r in steady]
        out[metric] = sum(values) / len(values) if how == "mean" else sum(values)
    return out


def _compiling(result: dict[str, float]) -> str:
    """`N (S s)`: the later steps that compiled (left out of the means) and their seconds."""
    return f"{result['compiling_steps']:.0f} ({result['compiling_s']:.1f} s)"


def format_table(results: dict[str, dict[str, float]]) -> list[str]:
    """The side-by-side rows, then partial / sync of the seconds and tokens/s for each partial arm."""
    names = list(results)
    lines = [f"{'':<28}" + "".join(f"{name:>14}" for name in names),
             f"{'step 1 seconds (compiles)':<28}" + "".join(f"{results[n]['first_step_s']:>14.2f}" for n in names),
             f"{'later steps that compiled':<28}" + "".join(f"{_compiling(results[n]):>14}" for n in names),
             f"{'steady steps (the means)':<28}" + "".join(f"{results[n]['steps']:>14d}" for n in names)]
    for label, metric, _ in ROWS:
        lines.append(f"{label:<28}" + "".join(f"{results[n][metric]:>14.3f}" for n in names))
    sync = results["sync"]
    for name in names[1:]:
        ratios = ", ".join(f"{label} {results[name][metric] / sync[metric]:.2f}x" for label, metric, _ in ROWS
                           if metric in RATIOS)
        lines.append(f"{name} / sync: {ratios}")
    return lines


def main(argv: Optional[Sequence[str]] = None) -> dict[str, dict[str, float]]:
    """Runs every arm; prints the table and returns arm -> `summary`."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=DEFAULT_CONFIG, help="run config file (default: configs/demo_cpu.py)")
    p.add_argument("--steps", type=int, default=6, help="steps per arm, the first one's compile reported apart")
    p.add_argument("--over-sampling", type=float, nargs="+", default=[1.5, 2.0], help="the partial arms")
    p.add_argument("--tis-cap", type=float, default=2.0, help="objective.tis_cap of every arm (partial needs > 0)")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="config override of every arm, repeatable")
    p.add_argument("--assets-dir", default="", help="the demo world's folder (default: a temporary one; an "
                   "existing one is reused)")
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error("--steps must be >= 2 (step 1 compiles)")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    common = [*COMMON, f"objective.tis_cap={args.tis_cap}", *args.override]
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="partial_bench_") as work:
        assets = args.assets_dir or os.path.join(work, "world")
        for name, overrides in arms(args.over_sampling).items():
            run_dir = os.path.join(work, name.replace(" ", "_"))
            cfg = load_config(args.config, [*common, *overrides, f"run_dir={run_dir}", f"demo.assets_dir={assets}"])
            print(f"{name}: {', '.join([*common, *overrides])}", flush=True)
            results[name] = summary(run_arm(cfg, args.steps, log=lambda line: print(line, flush=True)))
    import jax

    print(f"partial rollouts vs synchronous: {os.path.relpath(args.config, ROOT)}, {args.steps} steps per arm (means "
          f"over the steady steps), {cfg.data.prompts_per_step} x {cfg.data.samples_per_prompt} trajectories "
          f"trained per step; {jax.devices()[0].platform} x{jax.device_count()}")
    for line in format_table(results):
        print(line, flush=True)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
