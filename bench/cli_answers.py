"""How fast the commands answer what needs no run (issue 70 item 5): `--help` of every entry point and a bad value
of a run config, each as the user runs it (`python -m ...`, a fresh process), in CPU seconds (user + sys of the
process, the least of --repeats): on a shared, loaded machine wall seconds measure the neighbours, CPU seconds the
command. `--tree DIR` runs another checkout's code (e.g. an older commit's `git archive`), for a before/after pair.

    python bench/cli_answers.py [--tree DIR] [--repeats 3]
"""
from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys

COMMANDS = (
    ("llds_jax.launch", "--help"),
    ("index_builder", "--help"),
    ("llds_jax.apps.demo_study", "--help"),
    ("llds_jax.search.server", "--help"),
    ("llds_jax.launch", "--config=configs/demo_cpu.py", "--config.objective.llds.lam=-1"),
    ("llds_jax.launch", "--config=configs/demo_cpu.py", "--config.model.dtype=bf16"),
    ("llds_jax.launch", "--config=configs/demo_cpu.py", "--config.train.totl_steps=3"),
)


def cpu_seconds(command: tuple[str, ...], tree: str) -> float:
    """user + sys CPU seconds of `python -m COMMAND` run in `tree` with its code first on the path."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tree] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-m", *command], cwd=tree, env=env, capture_output=True, check=False)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tree", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        help="the checkout whose code runs (default: this one)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per command; the least is printed")
    args = parser.parse_args()
    for command in COMMANDS:
        best = min(cpu_seconds(command, args.tree) for _ in range(args.repeats))
        print(f"{best:6.2f} s CPU  python -m {' '.join(command)}", flush=True)


if __name__ == "__main__":
    main()
