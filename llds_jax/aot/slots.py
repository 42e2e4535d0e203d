"""The rollout's sequence slots and page pool for a config, chosen by the kernel-faithful estimate within the chip's
HBM (issue 67, build 3: rows in flight become a memory budget).

    python -m llds_jax.aot.slots configs/qwen7b_v4.py --largest_gib 24.97 --updates_s 72.2 --reshard_s 0.06

The engine admits by the pages its sequences hold and preempts by recompute when the pool runs short
(`rollout.engine`), so `rollout.max_batch_size` (the slots S: the rows a decode iteration may run) and
`rollout.num_pages` (the pool) are free to trade: more slots read the weights once for more rows, a pool short of
every slot's worst case makes sequences wait or re-encode. The pool is the HBM left beside the largest program: a
`--mode=compile` of the config prints every program's memory per chip, each of which holds the pool (an argument of
the rollout programs, resident beside the others), so the largest one less its pool (`--largest_gib` less
`rollout.num_pages` x `page_bytes`) is what stays whatever the pool, and the pool gets the rest of the usable HBM
down to `HEADROOM` (`pages_that_fit`; no more than every slot's worst case). The step programs' temporaries grow
with S (their [S, V] logits) and are not in that figure: a `--mode=compile` of the chosen config checks that every
program still fits.

Each candidate S (default `SLOTS`) is costed as `llds_jax.aot.tiles` costs tiles: the real engine's schedule of one
host's rollout at the expected lengths (`rollout_schedule.for_run`, its admission and preemption with this pool)
costed call by call by `step_estimate.FaithfulCost` at the config's tiles; the rollout is that device time plus the
weight reshard's seconds, its share of the step beside `--updates_s` (both from the `--mode=compile`). Nothing is
compiled.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Sequence

import jax

from llds_jax import config as config_lib
from llds_jax.aot import compile_check, rollout_schedule, step_estimate, step_lengths, tiles
from llds_jax.config.sections import RolloutConfig
from llds_jax.rollout.config import KernelTiles, PagingConfig
from llds_jax.rollout.paged_sampler import pool_pages
from llds_jax.rollout.runner import pool_shape
from llds_jax.train import run_builder

SLOTS = (128, 192, 256, 384)
HEADROOM = 0.10  # the share of the usable HBM every program leaves free
GIB = 1 << 30


def page_bytes(cfg) -> float:
    """Bytes per chip of one page of the rollout's pool of `cfg` (every layer's keys and values of `rollout.page_size`
    slots, split over the rollout's tensor-parallel chips as the run lays the pool out: `runner.pool_shape`)."""
    devices, _ = compile_check.topology_devices(cfg.mesh.topology)
    layout = run_builder.run_layout(cfg, devices)
    engine = run_builder.rollout_shapes(cfg, len({d.process_index for d in devices}))[0][1]
    pool = pool_shape(layout.rollout.model_cfg, engine, layout.rollout.mesh)  # split over heads, never over pages
    return tiles.shard_bytes(pool) / engine.num_pages


def pool_of(cfg) -> int:
    """Pages of `cfg`'s pool as `--mode=compile` sizes it (`run_builder.build` in this process: `rollout.num_pages`,
    0: the training or evaluation engine's slots at their worst case, whichever is larger)."""
    return max(engine.num_pages for _, engine in run_builder.rollout_shapes(cfg, jax.process_count()))


def pages_that_fit(usable_bytes: float, other_bytes: float, bytes_per_page: float,
                   headroom: float = HEADROOM) -> int:
    """The most pages whose pool, beside `other_bytes` per chip (the largest program less its pool), leaves
    `headroom` of `usable_bytes` free."""
    return max(0, math.floor(((1 - headroom) * usable_bytes - other_bytes) / bytes_per_page))


def with_slots(cfg, slots: int, num_pages: int):
    """A copy of `cfg` with rollout.max_batch_size = `slots` and rollout.num_pages = `num_pages`."""
    cfg = cfg.copy_and_resolve_references()
    cfg.rollout.max_batch_size, cfg.rollout.num_pages = slots, num_pages
    return cfg


@dataclasses.dataclass(frozen=True)
class Option:
    """One slot count's expected rollout per host: its slots and pool, the most sequences the engine held at once,
    the decode iterations' share of slots that sampled, the step calls, the kernel-faithful device seconds and the
    rollout's seconds (device and reshard)."""

    slots: int
    pages: int
    rows_in_flight: int
    occupancy: float
    calls: int
    device_s: float
    rollout_s: float

    def share(self, updates_s: float) -> float:
        """The rollout's share of a step of `updates_s` seconds of updates."""
        return self.rollout_s / (self.rollout_s + updates_s)


def evaluate(cfg, slots: int, num_pages: int, reshard_s: float = 0.0,
             lengths: step_lengths.Lengths | None = None) -> Option:
    """`cfg`'s expected rollout per host at `slots` slots and a pool of `num_pages`, kernel-faithful at the config's
    tiles (module docstring)."""
    run_cfg = with_slots(cfg, slots, num_pages)
    rollout = tiles.rollout_of(run_cfg)
    schedule = rollout_schedule.for_run(run_cfg, lengths or step_lengths.defaults(run_cfg), rollout.sequences)
    device = tiles.device_seconds(rollout, schedule,
                                  KernelTiles.of(config_lib.build(RolloutConfig, run_cfg.rollout)))
    return Option(slots, num_pages, schedule.rows_in_flight, schedule.occupancy, len(schedule.calls), device,
                  device + reshard_s)


def sweep(cfg, slot_counts: Sequence[int], fit_pages: int, reshard_s: float = 0.0,
          lengths: step_lengths.Lengths | None = None) -> list[Option]:
    """Each of `slot_counts` (at most the host's trajectories) with the pool that fits, `fit_pages`, or every slot's
    worst case where that is less; in `slot_counts`' order."""
    paging = PagingConfig.of(config_lib.build(RolloutConfig, cfg.rollout))
    sequences = tiles.rollout_of(cfg).sequences
    options = []
    for slots in slot_counts:
        if slots > sequences:
            continue
        worst = pool_pages(slots, cfg.rollout.max_context_tokens, paging.page_size)
        options.append(evaluate(cfg, slots, min(fit_pages, worst), reshard_s, lengths))
    return options


def best(options: Sequence[Option]) -> Option:
    """The option of the least rollout seconds (of equal ones, the fewest slots)."""
    return min(options, key=lambda o: (round(o.rollout_s, 6), o.slots))


def format_options(name: str, options: Sequence[Option], updates_s: float, fit_pages: int, bytes_per_page: float,
                   usable_bytes: float, other_bytes: float) -> str:
    """The sweep's lines: the pool that fits, then per slot count its pool, rows held, calls, seconds and share."""
    lines = [f"{name}: the pool beside the largest program less its pool ({other_bytes / GIB:.2f} GiB per chip) within "
             f"{1 - HEADROOM:.0%} of {usable_bytes / GIB:.2f} GiB usable: {fit_pages:,} pages of "
             f"{bytes_per_page / (1 << 20):.3f} MiB per chip; expected rollout per host, kernel-faithful at the "
             "config's tiles (an estimate, not a measurement)"]
    for o in options:
        share = f", rollout share {o.share(updates_s):.1%}" if updates_s else ""
        lines.append(f"  slots {o.slots:>4}, pages {o.pages:>6,} ({o.pages * bytes_per_page / GIB:5.2f} GiB): "
                     f"{o.rows_in_flight:>4} sequences in flight at most, decode occupancy {o.occupancy:.0%}, "
                     f"{o.calls:,} calls, device {o.device_s:.1f} s, rollout {o.rollout_s:.1f} s{share}")
    chosen = best(options)
    lines.append(f"  least: slots {chosen.slots}, pages {chosen.pages:,} (rollout.max_batch_size, rollout.num_pages)")
    return "\n".join(lines)


def main(argv=None) -> list[Option]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="a config file, PATH[:ARG] as --config takes it")
    p.add_argument("--largest_gib", type=float, required=True,
                   help="the largest program's total per chip, GiB, as --mode=compile prints it for the config")
    p.add_argument("--slots", default=",".join(map(str, SLOTS)), help="rollout.max_batch_size to try, comma-separated")
    p.add_argument("--updates_s", type=float, default=0.0, help="the expected step's updates, seconds (--mode=compile)")
    p.add_argument("--reshard_s", type=float, default=0.0, help="the weight reshard's seconds (--mode=compile)")
    args = p.parse_args(argv)
    jax.config.update("jax_platforms", "cpu")
    cfg = tiles.load_config(args.config)
    devices, nominal = compile_check.topology_devices(cfg.mesh.topology)
    usable = compile_check.usable_hbm_bytes(devices[0]) or nominal
    bytes_per_page = page_bytes(cfg)
    other = args.largest_gib * GIB - pool_of(cfg) * bytes_per_page
    fit = pages_that_fit(usable, other, bytes_per_page)
    options = sweep(cfg, [int(s) for s in args.slots.split(",")], fit, args.reshard_s)
    print(format_options(args.config, options, args.updates_s, fit, bytes_per_page, usable, other))
    return options


if __name__ == "__main__":
    main()
