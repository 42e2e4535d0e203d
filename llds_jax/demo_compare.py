"""GRPO vs GRPO + LLDS on the demo world: the same config, seed, warm start and prompts, LLDS off and on.

    python -m llds_jax.demo_compare [--config=configs/demo_cpu_grpo.py] [--out=runs/demo_compare] [--dry-run]

Runs `python -m llds_jax.launch` twice (run folders `<out>/grpo` and `<out>/llds`; the second differs only in
`objective.llds.enabled=True`), then `python -m llds_jax.report <out>/llds --compare <out>/grpo --out <out>/report`.
Both runs share the config's `demo.assets_dir` and `sft.output_dir`, so the world and the warm start are built once.
Extra arguments after `--` go to both launches (e.g. `-- --config.train.total_steps=10`).
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys


def commands(config: str, out: str, extra: list[str]) -> list[list[str]]:
    """The three commands: the GRPO run, the GRPO + LLDS run, the report comparing them."""
    launch = [sys.executable, "-m", "llds_jax.launch", f"--config={config}"]
    grpo, llds = os.path.join(out, "grpo"), os.path.join(out, "llds")
    return [
        launch + [f"--config.run_dir={grpo}", "--config.objective.llds.enabled=False", *extra],
        launch + [f"--config.run_dir={llds}", "--config.objective.llds.enabled=True", *extra],
        [sys.executable, "-m", "llds_jax.report", llds, "--compare", grpo, "--out", os.path.join(out, "report")],
    ]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(prog="python -m llds_jax.demo_compare", description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/demo_cpu_grpo.py")
    parser.add_argument("--out", default="runs/demo_compare")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = parser.parse_args(own)
    for cmd in commands(args.config, args.out, extra):
        print("+ " + shlex.join(cmd), flush=True)
        if not args.dry_run:
            code = subprocess.call(cmd)
            if code:
                print(f"llds_jax.demo_compare: command failed with exit status {code}", file=sys.stderr)
                return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
