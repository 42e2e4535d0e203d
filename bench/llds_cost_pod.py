"""What LLDS costs per training step at a paper config's shape, compiled, not run: the config's training update
compiled by XLA's TPU compiler (the libtpu wheel) for its pod topology twice, with `objective.llds.enabled` True
(the config's LLDS: its lambda and gate) and False (plain GRPO), everything else identical, as `--mode=compile`
compiles it (`llds_jax.aot.compile_check`: no TPU, no weights read).

For each side:
- memory per chip, from XLA's memory analysis of the compiled update (as `--mode=compile` reports it): arguments,
  temporaries, resident (the arrays the run keeps in HBM meanwhile that are not its arguments, read off the
  compiled "optimizer init" and "reference copy"), total = arguments + outputs - donated + temporaries + code +
  resident;
- the roofline ESTIMATE of one call on one chip, read from its HLO (`llds_jax.aot.roofline`): matrix FLOPs, HBM bytes,
  ICI bytes, seconds at the topology generation's peaks;
- calls per training step (`optim` updates per step, `llds_jax.aot.step_estimate.update_calls`) and the estimated
  update time per step, calls x seconds per call, as the step estimate of `--mode=compile` counts it;
and LLDS - GRPO and LLDS / GRPO of each.

Only the update is compiled (with the two state programs that size what stays resident, and the retriever's first
search and query encoder programs when its index and encoder stay on the chips): LLDS is a term of the update's
loss, and the log-prob forwards, likelihood and LLD metrics compute nothing of it. `build_programs` lowers
every program of the run on both sides (a few seconds), and the command prints which lowered modules differ (the
update alone for configs/qwen7b_v4.py); the rollout is not compiled.

    python bench/llds_cost_pod.py                                        # configs/qwen7b_v4.py on v4:2x2x4
    python bench/llds_cost_pod.py --config configs/qwen3b_v4.py --override optim.micro_batch_size=32

These are ESTIMATES, not measurements: the roofline counts only matrix products as FLOPs (the LLDS term is
elementwise work on [B, T] log-probs: it shows in HBM bytes, not in FLOPs) and assumes peak rates no program reaches
(docs/tpu.md, "Step-time estimates from the HLO"). `bench/llds_cost.py` times both sides on this machine at the
demo's shape.
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Optional, Sequence

import jax

from llds_jax import checks, topologies
from llds_jax.aot import compile_check, compiled, roofline
from llds_jax.config.loader import load_config
from llds_jax.programs import Role

SIDES = {"GRPO": False, "LLDS": True}  # objective.llds.enabled of each side
MIB = 1 << 20


@dataclasses.dataclass(frozen=True)
class UpdateCost:
    """One side's compiled update: its memory per chip (`row`, bytes, resident arrays included), its calls per
    training step and the roofline estimate of one call (`cost` per chip, `estimate` in seconds)."""

    row: compiled.Row
    calls: float
    estimate: roofline.Estimate

    @property
    def cost(self) -> roofline.HloCost:
        """The roofline cost of one call on one chip (FLOPs, HBM and ICI bytes)."""
        return self.row.cost

    @property
    def per_step_s(self) -> float:
        """Estimated update seconds per training step: calls x seconds per call."""
        return self.calls * self.estimate.seconds


def compile_update(programs: Sequence[compiled.Program], hbm_bytes: float, peaks: roofline.ChipPeaks,
                   label: str) -> UpdateCost:
    """The update among a run's `programs` (`compile_check.build_programs`: at the run's largest training batch)
    compiled, with the resident arrays added as `compile_check.run` adds them. Raises SystemExit naming the program
    when one does not compile or its temporaries do not fit the `hbm_bytes` per chip."""
    # The programs whose outputs and arguments size the resident arrays (the state programs; the on-chip
    # retriever's index and query encoder, `compile_check.sizing_programs`), then the update.
    programs = compile_check.sizing_programs(programs) + [p for p in programs if p.role is Role.UPDATE]
    rows = []
    for program in programs:
        print(f"[{label}] compiling {program.name}: {program.shapes}", flush=True)
        rows.append(compile_check.compile_row(program))
    failed = compile_check.overflows([row for row in rows if row.error], hbm_bytes)
    if failed:
        raise SystemExit(f"llds_cost_pod: error: [{label}] " + "; ".join(failed))
    sizes = compile_check.long_lived_bytes(rows, programs)
    update, row = next((p, r) for p, r in zip(programs, rows) if p.role is Role.UPDATE)
    row = row.with_resident(sum(sizes[name] for name in update.resident))
    return UpdateCost(row, update.calls, roofline.roofline_seconds(row.cost, peaks))


def differing_programs(grpo: Sequence[compiled.Program], llds: Sequence[compiled.Program]) -> list[str]:
    """Names of the run's programs whose lowered modules differ between the two sides (lowered, not compiled)."""
    if [p.name for p in grpo] != [p.name for p in llds]:
        raise ValueError(f"the two sides run different programs: {[p.name for p in grpo]} vs "
                         f"{[p.name for p in llds]}")
    return [g.name for g, l in zip(grpo, llds) if g.lowered.as_text() != l.lowered.as_text()]


def comparison_rows(sides: dict[str, UpdateCost]) -> list[tuple[str, float, float]]:
    """(label, GRPO value, LLDS value) of each compared quantity."""
    g, l = sides["GRPO"], sides["LLDS"]
    return [
        ("arguments, MiB per chip", g.row.arguments / MIB, l.row.arguments / MIB),
        ("temporaries, MiB per chip", g.row.temporaries / MIB, l.row.temporaries / MIB),
        ("resident, MiB per chip", g.row.resident / MIB, l.row.resident / MIB),
        ("total, MiB per chip", g.row.total / MIB, l.row.total / MIB),
        ("GFLOP per call (matrix products)", g.cost.flops / 1e9, l.cost.flops / 1e9),
        ("HBM GB per call", g.cost.hbm_bytes / 1e9, l.cost.hbm_bytes / 1e9),
        ("ICI GB per call", g.cost.ici_bytes / 1e9, l.cost.ici_bytes / 1e9),
        ("ms per call (estimate)", g.estimate.seconds * 1e3, l.estimate.seconds * 1e3),
        (f"s per step (estimate, {g.calls:g} calls)", g.per_step_s, l.per_step_s),
    ]


def format_comparison(sides: dict[str, UpdateCost], generation: str) -> str:
    """The table of each quantity on both sides (7 significant digits), LLDS - GRPO and LLDS / GRPO (the ratio of
    the exact values)."""
    rows = comparison_rows(sides)
    width = max(len(label) for label, *_ in rows)
    header = f"{'update':<{width}}  {'GRPO':>14} {'LLDS':>14} {'LLDS - GRPO':>12} {'LLDS / GRPO':>12}"
    lines = [f"the update, GRPO vs LLDS (memory: XLA's analysis of the compiled program; time: roofline ESTIMATE from "
             f"its HLO at {generation} peaks, not a measurement)", header, "-" * len(header)]
    for label, g, l in rows:
        ratio = f"{l / g:12.6f}" if g else f"{'-':>12}"
        lines.append(f"{label:<{width}}  {g:14.7g} {l:14.7g} {l - g:+12.4g} {ratio}")
    lines.append(f"{'bound':<{width}}  {sides['GRPO'].estimate.bound:>14} {sides['LLDS'].estimate.bound:>14}")
    return "\n".join(lines)


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/qwen7b_v4.py", help="run config file (default: configs/qwen7b_v4.py)")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="config override of both sides, repeatable (--config.KEY=VALUE works too)")
    p.add_argument("--topology", default="", help="TPU topology (default: the config's mesh.topology)")
    args, rest = p.parse_known_args(argv)
    for arg in rest:
        if not arg.startswith("--config.") or "=" not in arg:
            p.error(f"unrecognized argument {arg!r}")
        args.override.append(arg[len("--config."):])
    if any(o.split("=", 1)[0].strip() == "objective.llds.enabled" for o in args.override):
        p.error("objective.llds.enabled is what the two sides differ in: do not override it")
    return args


def main(argv: Optional[Sequence[str]] = None) -> dict[str, UpdateCost]:
    """Compiles both sides, prints compile_check's memory table and the comparison; returns {"GRPO": ...,
    "LLDS": ...}."""
    args = parse_args(argv)
    jax.config.update("jax_platforms", "cpu")  # the host's own backend; TPU programs are compiled, never run
    cfgs = {name: load_config(args.config, [*args.override, f"objective.llds.enabled={enabled}"])
            for name, enabled in SIDES.items()}
    topology = args.topology or cfgs["LLDS"].mesh.topology
    if not topology:
        raise SystemExit("llds_cost_pod: error: no TPU topology: --topology=NAME or the config key mesh.topology")
    devices, nominal = compile_check.topology_devices(topology)
    runs = {name: checks.validate(cfg, len(devices)) for name, cfg in cfgs.items()}
    hbm = compile_check.usable_hbm_bytes(devices[0]) or nominal
    generation = topologies.resolve(topology)[0]
    llds = runs["LLDS"].objective.llds
    print(f"llds_cost_pod: {args.config}" + (f" with {', '.join(args.override)}" if args.override else "")
          + f", compiled for {topology}: {len(devices)} chips, {devices[0].device_kind}, {nominal / (1 << 30):.0f} "
          f"GiB HBM per chip ({hbm / (1 << 30):.2f} GiB usable); GRPO: objective.llds.enabled=False, LLDS: True "
          f"({llds.variant}, lambda {llds.lam}, gate {llds.gate}), all else identical", flush=True)
    programs = {name: compile_check.build_programs(run, devices) for name, run in runs.items()}
    differ = differing_programs(programs["GRPO"], programs["LLDS"])
    count = len(programs["LLDS"])
    print(f"lowered on both sides: {count} programs of the run; differing: {', '.join(differ) or 'none'} (the other "
          f"{count - len(differ)} lower to identical modules)", flush=True)
    sides = {name: compile_update(programs[name], hbm, roofline.PEAKS[generation], name) for name in SIDES}
    print(compile_check.format_table([dataclasses.replace(s.row, name=f"{s.row.name}, {name}")
                                      for name, s in sides.items()], hbm))
    print(format_comparison(sides, generation))
    return sides


if __name__ == "__main__":
    main()
