"""GRPO vs GRPO + LLDS on the demo world: the same config, seed, warm start and prompts, LLDS off and on.

    python -m llds_jax.apps.demo_compare [--config=configs/demo_cpu_grpo.py] [--out=runs/demo_compare] [--dry-run]

Runs `python -m llds_jax.launch` twice, one after the other (run folders `<out>/grpo` and `<out>/llds` with the
study's grpo and llds arms: llds_jax.apps.study.plan.ARMS), then `python -m llds_jax.train.report <out>/llds --compare
<out>/grpo --out <out>/report`. Both runs share the config's `demo.assets_dir` and `sft.output_dir`, so the world and
the warm start are built once. Extra arguments after `--` go to both launches (e.g. `-- --config.train.total_steps=10`).
Several seeds, settings and controls: `python -m llds_jax.apps.demo_study`.
"""
from __future__ import annotations

import argparse
import os
import sys

from llds_jax.apps.study import plan, runner


def jobs(config: str, out: str, extra: list[str]) -> list[runner.Job]:
    """The three jobs: the GRPO run, the GRPO + LLDS run, the report comparing them (each after the one before)."""
    cfg = plan.load(config, [override[len("--config."):] for override in extra if override.startswith("--config.")])
    launch = [sys.executable, "-m", "llds_jax.launch", f"--config={config}"]
    folders = {arm: os.path.join(out, arm) for arm in ("grpo", "llds")}
    runs = [runner.Job(arm, (*launch, f"--config.run_dir={folder}",
                             *(f"--config.{o}" for o in plan.ARMS[arm].overrides(cfg)), *extra), None, after)
            for (arm, folder), after in zip(folders.items(), ((), ("grpo",)))]
    report = (sys.executable, "-m", "llds_jax.train.report", folders["llds"], "--compare", folders["grpo"], "--out",
              os.path.join(out, "report"))
    return [*runs, runner.Job("report", report, None, ("llds",))]


def main(argv: list[str] | None = None) -> int:
    own, extra = plan.split_argv(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m llds_jax.apps.demo_compare", description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/demo_cpu_grpo.py")
    parser.add_argument("--out", default="runs/demo_compare")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = parser.parse_args(own)
    try:
        job_list = jobs(args.config, args.out, extra)
    except plan.StudyError as e:
        print(f"llds_jax.apps.demo_compare: error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        for job in job_list:
            print(f"+ {job.shell()}")
        return 0

    def on_start(job: runner.Job) -> None:
        print(f"+ {job.shell()}", flush=True)

    for outcome in runner.run_jobs(job_list, 1, on_start):
        if outcome.status:
            print(f"llds_jax.apps.demo_compare: {outcome.job.name} failed with exit status {outcome.status}",
                  file=sys.stderr)
            return outcome.status
    return 0


if __name__ == "__main__":
    sys.exit(main())
