"""What the persistent compilation cache (`compilation_cache_dir`) saves a resumed run.

Trains the run config for one step with the cache on (the first run fills it), copies the run folder, then resumes
both copies for one more step, one after the other in this process run: with the cache, and with no cache at all
(JAX_COMPILATION_CACHE_DIR unset too). Prints each resume's wall time (process start to exit), its step's
`perf/step_s` and `perf/compile_rows_s`, the ratios, and whether the two resumed steps computed the same metrics
(everything but times).

    python bench/compilation_cache.py                          # configs/demo_cpu.py without its warm start
    python bench/compilation_cache.py --config configs/tiny_test.py --override demo.enabled=True

JAX keeps a program only when it took at least `jax_persistent_cache_min_compile_time_secs` (1 s by default) to
compile; the bench keeps that default, so it measures what a run gets.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

from etils import epath

from llds_jax.train import report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OVERRIDES = ("sft.enabled=False",)  # the demo's warm start takes minutes and compiles nothing of the RL run


def launch(config: str, overrides: list[str], run_dir: str, steps: int, cache_dir: str) -> float:
    """Runs `python -m llds_jax.launch` to `steps` steps in `run_dir` (cache at `cache_dir`, "" for none); returns
    its wall seconds."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    command = [sys.executable, "-m", "llds_jax.launch", f"--config={config}", f"--config.run_dir={run_dir}",
               f"--config.train.total_steps={steps}", f"--config.compilation_cache_dir={cache_dir}",
               *[f"--config.{o}" for o in overrides]]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode:
        sys.exit(f"{' '.join(command)} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return seconds


def last_record(run_dir: str) -> dict:
    """The run's metrics record of its last step."""
    records, _ = report.read_metrics(epath.Path(run_dir) / report.METRICS_FILE)
    return records[-1]


def computed(record: dict) -> dict:
    """A step's metrics without its times (seconds, rates, the wall clock)."""
    return {k: v for k, v in record.items()
            if k != "time" and not k.startswith("perf/") and not k.endswith("_s") and "per_s" not in k}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/demo_cpu.py")
    parser.add_argument("--override", action="append", default=None,
                        help=f"KEY=VALUE for every run (default: {' '.join(DEFAULT_OVERRIDES)})")
    parser.add_argument("--out", default="", help="folder for the runs and the cache (default: a temporary one)")
    args = parser.parse_args()
    overrides = args.override if args.override is not None else list(DEFAULT_OVERRIDES)
    out = args.out or tempfile.mkdtemp(prefix="compilation_cache_bench_")
    cache, cached, fresh = (os.path.join(out, name) for name in ("cache", "run_cached", "run_fresh"))
    overrides.append(f"demo.assets_dir={os.path.join(out, 'assets')}")

    print(f"{args.config} ({' '.join(overrides)}), in {out}", flush=True)
    first_s = launch(args.config, overrides, cached, 1, cache)
    print(f"step 1 with an empty cache: {first_s:.1f} s; {len(os.listdir(cache))} programs kept", flush=True)
    shutil.copytree(cached, fresh)
    rows = {}
    for name, run_dir, cache_dir in (("cache", cached, cache), ("no cache", fresh, "")):
        wall_s = launch(args.config, overrides, run_dir, 2, cache_dir)
        rows[name] = (wall_s, last_record(run_dir))
    print(f"{'resumed for step 2':<20} {'wall s':>8} {'step s':>8} {'compile_rows s':>15}")
    for name, (wall_s, record) in rows.items():
        print(f"{name:<20} {wall_s:8.1f} {record['perf/step_s']:8.1f} {record.get('perf/compile_rows_s', 0.0):15.1f}")
    (cached_s, with_cache), (fresh_s, without) = rows["cache"], rows["no cache"]
    step_ratio = without["perf/step_s"] / with_cache["perf/step_s"]
    print(f"no cache / cache: wall {fresh_s / cached_s:.2f}x, step {step_ratio:.2f}x")
    same = computed(with_cache) == computed(without)
    print(f"step 2's metrics (times aside) {'identical' if same else 'DIFFER'} with and without the cache")
    if not args.out:
        shutil.rmtree(out)


if __name__ == "__main__":
    main()
