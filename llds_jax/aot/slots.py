"""The rollout's sequence slots and page pool for a config, chosen by the kernel-faithful estimate within the chip's
HBM (issue 67, build 3: rows in flight become a memory budget).

    python -m llds_jax.aot.slots configs/qwen7b_v4.py --largest_gib 24.97 --updates_s 72.2 --reshard_s 0.06

The engine admits by the pages its sequences hold and preempts by recompute when the pool runs short
(`rollout.engine`), so `rollout.max_batch_size` (the slots S: the rows a decode iteration may run) and
`rollout.num_pages` (the pool) are free to trade: more slots read the weights once for more rows, a pool short of
every slot's worst case makes sequences wait or re-encode. The pool is the HBM left beside the largest program: a
`--mode=compile` of the config prints every program's memory per chip, each of which holds the pool (an argument of
the rollout programs, resident beside the others), so the largest one less its pool (`--largest_gib` less
`rollout.num_pages` x `page_bytes`, its printed figure rounded up) is what stays whatever the pool, and the pool gets the rest of the usable HBM
down to `HEADROOM` (`pages_that_fit`; no more than every slot's worst case). The step programs' temporaries grow
with S (their [S, V] logits) and are not in that figure: a `--mode=compile` of the chosen config checks that every
program still fits.

Each candidate S (default `SLOTS`) at each step token budget (`rollout.max_step_tokens`, default the config's and
its double: more rows in flight fill larger steps) is costed as `llds_jax.aot.tiles` costs tiles: the real engine's
schedule of one host's rollout at the expected lengths (`rollout_schedule.for_run`, its admission and preemption
with this pool) costed call by call by `step_estimate.FaithfulCost`, at the tiles `tiles.choose` picks for that
schedule; candidates of more than `MAX_PROGRAMS` rollout programs are left out. The rollout is that device time plus
the weight reshard's seconds, its share of the step beside `--updates_s` (both from the `--mode=compile`). Nothing
is compiled.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Sequence

import jax

from llds_jax.aot import compile_check, rollout_schedule, step_lengths, tiles
from llds_jax.config.sections import RunConfig
from llds_jax.programs import Role
from llds_jax.rollout.config import KernelTiles, PagingConfig
from llds_jax.rollout.paged_sampler import pool_pages
from llds_jax.rollout.runner import pool_shape
from llds_jax.train import run_builder

SLOTS = (128, 192, 256, 384)
MAX_PROGRAMS = 12  # rollout programs a run compiles, training's and evaluation's (issue 67: up to 12 if it pays)
HEADROOM = 0.10  # the share of the usable HBM every program leaves free
GIB = 1 << 30
PRINTED_GIB = 0.005  # --mode=compile prints GiB to 2 decimals: the largest program may be this much above its figure


def page_bytes(run: RunConfig) -> float:
    """Bytes per chip of one page of the rollout's pool of the run config `run` (every layer's keys and values of
    `rollout.page_size` slots, split over the rollout's tensor-parallel chips as the run lays the pool out:
    `runner.pool_shape`)."""
    devices, _ = compile_check.topology_devices(run.mesh.topology)
    layout = run_builder.run_layout(run, devices)
    engine = run_builder.rollout_shapes(run, len({d.process_index for d in devices}))[0][1]
    pool = pool_shape(layout.rollout.model_cfg, engine, layout.rollout.mesh)  # split over heads, never over pages
    return tiles.shard_bytes(pool) / engine.num_pages


def pool_of(run: RunConfig) -> int:
    """Pages of the pool of the run config `run` as `--mode=compile` sizes it (`run_builder.build` in this process:
    `rollout.num_pages`, 0: the training or evaluation engine's slots at their worst case, whichever is larger)."""
    return max(engine.num_pages for _, engine in run_builder.rollout_shapes(run, jax.process_count()))


def pages_that_fit(usable_bytes: float, other_bytes: float, bytes_per_page: float,
                   headroom: float = HEADROOM) -> int:
    """The most pages whose pool, beside `other_bytes` per chip (the largest program less its pool), leaves
    `headroom` of `usable_bytes` free."""
    return max(0, math.floor(((1 - headroom) * usable_bytes - other_bytes) / bytes_per_page))


def with_slots(run: RunConfig, slots: int, num_pages: int, max_step_tokens: int = 0) -> RunConfig:
    """The run config `run` with rollout.max_batch_size = `slots`, rollout.num_pages = `num_pages` and (unless 0)
    rollout.max_step_tokens = `max_step_tokens`."""
    return run.replaced(rollout=dataclasses.replace(run.rollout, max_batch_size=slots, num_pages=num_pages,
                                                    max_step_tokens=max_step_tokens or run.rollout.max_step_tokens))


@dataclasses.dataclass(frozen=True)
class Option:
    """One slot count's expected rollout per host at one step budget: its slots, pool and budget, the rollout
    programs it compiles, the tiles chosen for it (`tiles.choose`), the most sequences the engine held at once, the
    decode iterations' share of slots that sampled, the step calls, the kernel-faithful device seconds and the
    rollout's seconds (device and reshard)."""

    slots: int
    pages: int
    max_step_tokens: int
    programs: int
    tiles: KernelTiles
    rows_in_flight: int
    occupancy: float
    calls: int
    device_s: float
    rollout_s: float

    def share(self, updates_s: float) -> float:
        """The rollout's share of a step of `updates_s` seconds of updates."""
        return self.rollout_s / (self.rollout_s + updates_s)


def evaluate(run: RunConfig, slots: int, num_pages: int, max_step_tokens: int = 0, reshard_s: float = 0.0,
             lengths: step_lengths.Lengths | None = None) -> Option:
    """The expected rollout per host of the run config `run` at `slots` slots, a pool of `num_pages` and steps of
    `max_step_tokens` (0: the config's), kernel-faithful at the tiles `tiles.choose` picks (module docstring)."""
    sized = with_slots(run, slots, num_pages, max_step_tokens)
    rollout = tiles.rollout_of(sized)
    schedule = rollout_schedule.for_run(sized, lengths or step_lengths.defaults(sized), rollout.sequences)
    choice = tiles.choose(rollout, schedule, sized.rollout.max_step_tokens)
    return Option(slots, num_pages, choice.max_step_tokens, choice.programs, choice.tiles, schedule.rows_in_flight,
                  schedule.occupancy, len(schedule.calls), choice.seconds, choice.seconds + reshard_s)


def sweep(run: RunConfig, slot_counts: Sequence[int], budgets: Sequence[int], fit_pages: int, reshard_s: float = 0.0,
          lengths: step_lengths.Lengths | None = None) -> list[Option]:
    """Each of `slot_counts` (at most the host's trajectories) at each of `budgets` (rollout.max_step_tokens) with
    the pool that fits, `fit_pages`, or every slot's worst case where that is less; those of at most `MAX_PROGRAMS`
    rollout programs, in `slot_counts`' then `budgets`' order, for the run config `run`."""
    paging = PagingConfig.of(run.rollout)
    sequences = tiles.rollout_of(run).sequences
    options = []
    for slots in slot_counts:
        if slots > sequences:
            continue
        worst = pool_pages(slots, run.rollout.max_context_tokens, paging.page_size)
        for budget in budgets:
            option = evaluate(run, slots, min(fit_pages, worst), budget, reshard_s, lengths)
            if option.programs <= MAX_PROGRAMS:
                options.append(option)
    return options


def best(options: Sequence[Option]) -> Option:
    """The option of the least rollout seconds (of equal ones, the fewest slots, then the smallest budget)."""
    return min(options, key=lambda o: (round(o.rollout_s, 6), o.slots, o.max_step_tokens))


def format_options(name: str, options: Sequence[Option], updates_s: float, fit_pages: int, bytes_per_page: float,
                   usable_bytes: float, other_bytes: float) -> str:
    """The sweep's lines: the pool that fits, then per slot count and budget its pool, programs, tiles, rows held,
    calls, seconds and share, then the least."""
    lines = [f"{name}: the pool beside the largest program less its pool ({other_bytes / GIB:.2f} GiB per chip) within "
             f"{1 - HEADROOM:.0%} of {usable_bytes / GIB:.2f} GiB usable: {fit_pages:,} pages of "
             f"{bytes_per_page / (1 << 20):.3f} MiB per chip; expected rollout per host, kernel-faithful at the "
             "tiles chosen for each (an estimate, not a measurement)"]
    for o in options:
        share = f", rollout share {o.share(updates_s):.1%}" if updates_s else ""
        t = o.tiles
        lines.append(f"  slots {o.slots:>4}, pages {o.pages:>6,} ({o.pages * bytes_per_page / GIB:5.2f} GiB), steps of "
                     f"{o.max_step_tokens:>5} ({o.programs} rollout programs), tiles {t.kv_pages_per_block} x "
                     f"{t.queries_per_block} / {t.decode_kv_pages_per_block} x {t.decode_queries_per_block}: "
                     f"{o.rows_in_flight:>4} sequences in flight at most, decode occupancy {o.occupancy:.0%}, "
                     f"{o.calls:,} calls, device {o.device_s:.1f} s, rollout {o.rollout_s:.1f} s{share}")
    chosen = best(options)
    t = chosen.tiles
    largest = other_bytes + chosen.pages * bytes_per_page
    lines.append(f"  least: rollout.max_batch_size {chosen.slots}, rollout.num_pages {chosen.pages}, "
                 f"rollout.max_step_tokens {chosen.max_step_tokens}, tiles {t.kv_pages_per_block} x "
                 f"{t.queries_per_block} (ragged), {t.decode_kv_pages_per_block} x {t.decode_queries_per_block} "
                 f"(decode); the largest program then {largest / GIB:.2f} GiB per chip ({largest / usable_bytes:.1%} "
                 "of usable)")
    return "\n".join(lines)


def compile_rollout(run: RunConfig) -> tuple[list[compile_check.Row], float]:
    """`--mode=compile`'s rows for the programs whose memory the slots, the pool and the budget change, compiled for
    the topology of the run config `run`: the programs its resident arrays are read from
    (`compile_check.sizing_programs`) and every rollout step program (training's and evaluation's buckets), each with
    its resident arrays; and the usable HBM per chip. Every other program holds the pool as a resident array, which
    `--mode=compile` adds from the pool's shape: its total moves by the pool's bytes."""
    devices, nominal = compile_check.topology_devices(run.mesh.topology)
    hbm = compile_check.usable_hbm_bytes(devices[0]) or nominal
    programs = compile_check.build_programs(run, devices, compile_check.host_chips(run.mesh.topology, devices))
    chosen = compile_check.sizing_programs(programs) + [p for p in programs if p.role is Role.ROLLOUT_STEP]
    rows = [compile_check.compile_row(p) for p in chosen]
    sizes = compile_check.long_lived_bytes(rows, chosen)
    return [row.with_resident(sum(sizes[name] for name in p.resident)) for row, p in zip(rows, chosen)], hbm


def main(argv=None) -> list[Option]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="a config file, PATH[:ARG] as --config takes it")
    p.add_argument("--largest_gib", type=float, required=True,
                   help="the largest program's total per chip, GiB, as --mode=compile prints it for the config")
    p.add_argument("--slots", default=",".join(map(str, SLOTS)), help="rollout.max_batch_size to try, comma-separated")
    p.add_argument("--budgets", default="", help="rollout.max_step_tokens to try, comma-separated (default: the "
                                                 "config's and its double)")
    p.add_argument("--compile", action="store_true", help="compile the least option's rollout step programs for the "
                                                             "topology and print their memory (compile_rollout)")
    p.add_argument("--updates_s", type=float, default=0.0, help="the expected step's updates, seconds (--mode=compile)")
    p.add_argument("--reshard_s", type=float, default=0.0, help="the weight reshard's seconds (--mode=compile)")
    args = p.parse_args(argv)
    jax.config.update("jax_platforms", "cpu")
    run = tiles.load_config(args.config)
    devices, nominal = compile_check.topology_devices(run.mesh.topology)
    usable = compile_check.usable_hbm_bytes(devices[0]) or nominal
    bytes_per_page = page_bytes(run)
    other = (args.largest_gib + PRINTED_GIB) * GIB - pool_of(run) * bytes_per_page
    fit = pages_that_fit(usable, other, bytes_per_page)
    own = run.rollout.max_step_tokens
    budgets = [int(b) for b in args.budgets.split(",")] if args.budgets else [own, 2 * own]
    options = sweep(run, [int(s) for s in args.slots.split(",")], budgets, fit, args.reshard_s)
    print(format_options(args.config, options, args.updates_s, fit, bytes_per_page, usable, other), flush=True)
    if args.compile:
        chosen = best(options)
        sized = with_slots(run, chosen.slots, chosen.pages, chosen.max_step_tokens)
        tiled = sized.replaced(rollout=dataclasses.replace(sized.rollout, **dataclasses.asdict(chosen.tiles)))
        print(compile_check.format_table(*compile_rollout(tiled)))
    return options


if __name__ == "__main__":
    main()
