"""The rollout's attention tiles and step token budget for a config, chosen by the kernel-faithful estimate (issue 67,
build 2; `step_estimate.FaithfulCost`): its expected rollout on one host at each candidate, cheapest first.

    python -m llds_jax.aot.tiles configs/qwen7b_v4.py --updates_s 72.2
    python -m llds_jax.aot.tiles configs/qwen3b_v4.py --updates_s 58.4 --budgets 1024,2048,4096

Nothing is compiled: the schedule is `rollout_schedule.for_run`'s at the expected lengths (`step_lengths.defaults`,
or a run's logged ones with --estimate_from); the rollout copy's weight bytes per chip are its abstract params'
shards on the config's topology (what the compiled step program's arguments less the pool hold); the weight
reshard's and the updates' seconds, which only the rollout's share needs, come from a `--mode=compile` of the
config (`--updates_s`, `--reshard_s`; docs/tpu.md prints them). The chosen tiles and budget go into the config
(rollout.kv_pages_per_block, queries_per_block, decode_kv_pages_per_block, decode_queries_per_block,
max_step_tokens), and a `--mode=compile` of it checks that every program still fits.

The tile of the ragged forwards above the slots' bucket and the decode tile (the slots' bucket and every decode
iteration) cost apart, their terms adding up, so each is chosen alone at each budget (`near_best`: of the tiles
within 1% of the cheapest, the largest kv blocks, then the smallest q blocks). Candidates: kv blocks of 4, 8, 16 or
32 pages (at most a sequence's), q blocks of 8, 16 or 32 tokens. JAX's tuned tables for TPU v5e and v6e use no
block under 4 pages or 32 queries, and the model leaves out what a block costs beyond its copies and its FLOPs
(its loop iteration, the copies' issue and latency), so smaller tiles would read as better than they are; q blocks
below 32 tokens are checked to compile for v4 (tests/aot/test_tiles.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import os
from collections.abc import Sequence

import jax
import numpy as np

from llds_jax import checks, parallel, topologies
from llds_jax.aot import compile_check, rollout_schedule, roofline, step_estimate, step_lengths
from llds_jax.config.sections import RunConfig
from llds_jax.rollout.config import KernelTiles, PagingConfig, SamplingConfig
from llds_jax.rollout.layout import abstract_rollout_params
from llds_jax.rollout.paged_sampler import token_budgets
from llds_jax.rollout.runner import decode_batches
from llds_jax.train import run_builder

KV_PAGES_PER_BLOCK = (4, 8, 16, 32)
QUERIES_PER_BLOCK = (8, 16, 32)
NEAR_BEST = 0.01  # a tile within 1% of the cheapest counts as as cheap (`near_best`)


@dataclasses.dataclass(frozen=True)
class Rollout:
    """What the estimate of one host's rollout of a run config takes, all but the tiles and the schedule: the run
    config, its hosts and trajectories per host, the ideal step cost (`step_estimate.StepCost`), the kernel-faithful
    one at the kernel's own tiles, and the chip's peaks."""

    run: RunConfig
    hosts: int
    sequences: int
    step: step_estimate.StepCost
    faithful: step_estimate.FaithfulCost
    peaks: roofline.ChipPeaks


def shard_bytes(tree) -> int:
    """Bytes per chip of a tree of ShapeDtypeStructs with shardings (each leaf's shard)."""
    return sum(math.prod(leaf.sharding.shard_shape(leaf.shape)) * np.dtype(leaf.dtype).itemsize
               for leaf in jax.tree.leaves(tree))


def rollout_of(run: RunConfig) -> Rollout:
    """The rollout estimate's inputs for the run config `run` on its topology (`mesh.topology`), laid out as the run
    lays it out (`run_builder`), at abstract params."""
    devices, _ = compile_check.topology_devices(run.mesh.topology)
    hosts = len({d.process_index for d in devices})
    layout = run_builder.run_layout(run, devices)
    parts = run_builder.build(run, layout, run_builder.abstract_model(layout), compile_check.PLACEHOLDER_STOP_IDS)
    params = abstract_rollout_params(layout.rollout, parts.step.abstract_state().params, run.rollout.params_dtype)
    rollout_cfg = run.rollout
    paging = PagingConfig.of(rollout_cfg)
    sequences = run.rollout_batch_size // hosts
    slots = run.engine_slots(sequences)
    model_cfg, tensor, mesh = layout.rollout.model_cfg, layout.rollout.tensor, layout.rollout.mesh
    step = step_estimate.step_cost(model_cfg, tensor, shard_bytes(params), paging.page_size, slots)
    faithful = step_estimate.faithful_cost(step, model_cfg, tensor, paging.page_size,
                                           -(-rollout_cfg.max_context_tokens // paging.page_size),
                                           parallel.axis_size(mesh, "sampled_rows"),
                                           SamplingConfig.of(rollout_cfg, compile_check.PLACEHOLDER_STOP_IDS),
                                           batches=decode_batches(mesh, slots))
    return Rollout(run, hosts, sequences, step, faithful, roofline.PEAKS[topologies.resolve(run.mesh.topology)[0]])


def with_budget(run: RunConfig, max_step_tokens: int) -> RunConfig:
    """The run config `run` with rollout.max_step_tokens = `max_step_tokens`."""
    return run.replaced(rollout=dataclasses.replace(run.rollout, max_step_tokens=max_step_tokens))


def device_seconds(rollout: Rollout, schedule: rollout_schedule.Schedule, tiles: KernelTiles) -> float:
    """The kernel-faithful device seconds of `schedule`'s calls at `tiles`."""
    cost = dataclasses.replace(rollout.faithful, tiles=tiles)
    return step_estimate.faithful_time(schedule, cost, rollout.peaks).device


def candidates(pages_per_seq: int) -> list[tuple[int, int]]:
    """The candidate tiles (kv pages, queries per block), kv blocks at most a sequence's pages."""
    return [(kv, q) for kv in KV_PAGES_PER_BLOCK if kv <= pages_per_seq for q in QUERIES_PER_BLOCK]


@dataclasses.dataclass(frozen=True)
class Choice:
    """The tiles chosen at one token budget: the budget, the rollout programs it makes (training's and evaluation's
    buckets), the tiles and the device seconds, with each candidate's seconds (ragged, decode: (kv, q) -> seconds
    with the other tile at its cheapest)."""

    max_step_tokens: int
    programs: int
    tiles: KernelTiles
    seconds: float
    ragged: dict[tuple[int, int], float]
    decode: dict[tuple[int, int], float]


def near_best(seconds: dict[tuple[int, int], float]) -> tuple[int, int]:
    """Of the tiles within `NEAR_BEST` of the cheapest, the one of the largest kv blocks, then of the smallest q
    blocks: the model leaves out a kv block's fixed cost (its loop iteration, its copies' issue and latency), which
    fewer, larger blocks pay less often, and the VPU's softmax over every row of a q block (in a decode iteration all
    but one of them other sequences' tokens, computed and masked), which smaller q blocks do less of."""
    best = min(seconds.values())
    return max((tile for tile, s in seconds.items() if s <= best * (1 + NEAR_BEST)), key=lambda t: (t[0], -t[1]))


def choose(rollout: Rollout, schedule: rollout_schedule.Schedule, max_step_tokens: int) -> Choice:
    """The ragged tile and the decode tile for `schedule`, each by `near_best` with the other at its cheapest
    (their terms add up: a candidate's seconds are the kernel's default tiles' plus what its own tile changes)."""
    tiles = candidates(rollout.faithful.kernel.pages_per_seq)
    base = KernelTiles()
    ragged = {t: device_seconds(rollout, schedule, dataclasses.replace(base, kv_pages_per_block=t[0],
                                                                       queries_per_block=t[1])) for t in tiles}
    decode = {t: device_seconds(rollout, schedule, dataclasses.replace(base, decode_kv_pages_per_block=t[0],
                                                                       decode_queries_per_block=t[1])) for t in tiles}
    cheapest = min(ragged.values()) + min(decode.values()) - device_seconds(rollout, schedule, base)
    ragged = {t: s - min(ragged.values()) + cheapest for t, s in ragged.items()}
    decode = {t: s - min(decode.values()) + cheapest for t, s in decode.items()}
    (rk, rq), (dk, dq) = near_best(ragged), near_best(decode)
    best = KernelTiles(rk, rq, dk, dq)
    return Choice(max_step_tokens, programs(rollout, max_step_tokens), best,
                  device_seconds(rollout, schedule, best), ragged, decode)


def programs(rollout: Rollout, max_step_tokens: int) -> int:
    """The rollout programs a run compiles at `max_step_tokens`: one per token bucket of its training and
    evaluation engines (`paged_sampler.token_budgets` from each engine's slots, as `run_builder.build` sizes them)."""
    slots = [rollout.run.engine_slots(n) for n in (rollout.sequences, rollout.run.eval.batch_size)]
    return sum(len(token_budgets(s, max(max_step_tokens, s))) for s in slots)


def sweep(run: RunConfig, budgets: Sequence[int], lengths: step_lengths.Lengths | None = None) -> list[Choice]:
    """The best tiles at each of `budgets` (rollout.max_step_tokens) for the run config `run` at `lengths` (default:
    the defaults'), cheapest first."""
    choices = []
    for budget in budgets:
        budgeted = with_budget(run, budget)
        rollout = rollout_of(budgeted)
        schedule = rollout_schedule.for_run(budgeted, lengths or step_lengths.defaults(budgeted), rollout.sequences)
        choices.append(choose(rollout, schedule, budget))
    return sorted(choices, key=lambda c: c.seconds)


def format_choices(name: str, choices: Sequence[Choice], updates_s: float, reshard_s: float,
                   kernel_default_s: float) -> str:
    """The sweep's lines: per budget its programs, best tiles, device seconds and (with `updates_s`) the
    expected rollout share, then the best budget's candidates."""
    def share(seconds: float) -> str:
        rollout = seconds + reshard_s
        return f", rollout share {rollout / (rollout + updates_s):.1%}" if updates_s else ""

    lines = [f"{name}: expected rollout, kernel-faithful, per host (device seconds; the kernel's own 32 x 32 tiles at "
             f"the config's budget: {kernel_default_s:.1f} s{share(kernel_default_s)})"]
    for c in choices:
        t = c.tiles
        lines.append(f"  max_step_tokens {c.max_step_tokens:>5} ({c.programs} rollout programs): ragged tile "
                     f"{t.kv_pages_per_block} x {t.queries_per_block}, decode tile {t.decode_kv_pages_per_block} x "
                     f"{t.decode_queries_per_block}: {c.seconds:.1f} s{share(c.seconds)}")
    best = choices[0]
    for label, seconds in (("ragged", best.ragged), ("decode", best.decode)):
        cells = ", ".join(f"{kv} x {q} {s:.1f}" for (kv, q), s in sorted(seconds.items()))
        lines.append(f"  at {best.max_step_tokens}, {label} tile (kv pages x queries per block: seconds): {cells}")
    return "\n".join(lines)


def load_config(spec: str) -> RunConfig:
    """The run config `get_config(ARG)` of the config file PATH of `spec` = PATH[:ARG] (as --config=PATH:ARG), checked
    against the components (`checks.check_components`)."""
    path, _, arg = spec.partition(":")
    module_spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return checks.check_components(module.get_config(*([arg] if arg else [])))


def main(argv=None) -> list[Choice]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="a config file, PATH[:ARG] as --config takes it")
    p.add_argument("--budgets", default="", help="rollout.max_step_tokens to try, comma-separated (default: the "
                                                 "config's, its double and its quadruple)")
    p.add_argument("--updates_s", type=float, default=0.0, help="the expected step's updates, seconds (--mode=compile)")
    p.add_argument("--reshard_s", type=float, default=0.0, help="the weight reshard's seconds (--mode=compile)")
    p.add_argument("--estimate_from", default="", help="a run folder whose logged lengths to take")
    args = p.parse_args(argv)
    jax.config.update("jax_platforms", "cpu")
    run = load_config(args.config)
    own = run.rollout.max_step_tokens
    budgets = [int(b) for b in args.budgets.split(",")] if args.budgets else [own, 2 * own, 4 * own]
    lengths = None
    if args.estimate_from:
        lengths = step_lengths.from_metrics(step_lengths.read_records(args.estimate_from),
                                            f"the run {args.estimate_from}")
    choices = sweep(run, budgets, lengths)
    rollout = rollout_of(run)
    schedule = rollout_schedule.for_run(run, lengths or step_lengths.defaults(run), rollout.sequences)
    print(format_choices(args.config, choices, args.updates_s, args.reshard_s,
                         device_seconds(rollout, schedule, KernelTiles())))
    return choices


if __name__ == "__main__":
    main()
