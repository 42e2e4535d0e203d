"""An ESTIMATED training-step time for `--mode=compile`: the rollout as the paged engine runs it at given lengths
(`llds_jax.aot.rollout_schedule`: its step calls per token bucket), each call costed by a roofline at its tokens, plus
retrieval where it blocks, plus the updates: each compiled training program's roofline time (`llds_jax.aot.roofline`,
read from its HLO) times the calls a step makes of it.

Not a measurement: peak rates are never reached, and the lengths are stated assumptions or a run's logged means.
- A rollout call (`StepCost`, per chip of the rollout's tensor-parallel group): its ragged forward at its token
  bucket's T tokens (the compiled shape: padding computes too), then its decode iterations, each a forward of
  the engine's S sequence slots. A forward reads the rollout copy's weights once (their bytes per chip from the
  compiled step program: its arguments less the page pool), the pages its sequences read (each sequence's pages up
  to its length; bytes per page per chip from the pool's shape), and computes 2 x (a layer's matrix parameters x
  layers) FLOPs per token plus the output projection's 2 x V x D per sequence slot (divided over the group); its
  tensor-parallel all-reduces move 2 per layer of [tokens, D] in the compute dtype (2 (n-1)/n of it per chip).
  Its time: max(FLOPs / peak, HBM bytes / bandwidth) + ICI bytes / ICI bandwidth. Not counted: attention's FLOPs
  (inside the ragged paged attention kernel), sampling, the host's work between calls.
- Retrieval (`retrieval_seconds`): at the retriever's cost per call (a faiss Flat or HNSW index on the host, by
  its measured cost per call; e5_device, by its compiled search program's roofline). Under `barrier` a session
  waits, after each turn, for its last search call: those calls' seconds add to the rollout. Under `continuous`
  a row waits for its search while the others decode: the host serves one call at a time and at most the rows in
  flight R wait, so the searches Q of a step need at least Q / R calls of R queries; their seconds, busy time
  B = (Q / R) x seconds(call of R queries), overlap the device's D seconds, and the rollout is max(D, B): the
  retrieval line is what blocks, max(0, B - D).
- The updates: `optim` updates per step, each with its reference and policy log-probs; the LLD measurement
  (`train.lld_every`) its two float32 forwards per update and its metrics, spread over the steps between; at
  expected lengths scaled by the trained tokens' share of the compiled length (`step_lengths.update_share`).
- Partial rollouts (issue 59) beside the expected step: the rollout of a simulated run's steady state
  (`rollout_schedule.partial_run`: the calls up to the cut, the carried conversations' re-prefill among them),
  costed as above, at the config's rollout.over_sampling when rollout.partial is on, else a what-if at 1.5 and 2
  (`partial_time`, `format_partial`); the updates unchanged (P groups
  trained either way; the trained trajectories' lengths, which a cut biases toward the short, are not followed).
- Hosts sample their own sequences at the same time (a step's rollout is one host's); evaluation is left out
  (it runs every `train.eval_every` steps); the weight reshard runs once per step, in the rollout.
- Kernel-faithful (issue 67, `FaithfulCost`, printed beside the ideal above by `beside.format_faithful`): the same
  schedule's calls costed as the step program runs them: each layer's attention as JAX's ragged paged attention
  kernel executes it at the tiles the runner passes (`KernelTiles`, rollout.kv_pages_per_block and the like;
  `llds_jax.aot.kernel_cost`: whole kv blocks copied, pages past a sequence's end included; whole q blocks
  against whole kv blocks on the MXU), each decode iteration over the rows still sampling in the runner's ragged
  batches (one per tensor-parallel group split over data, each on its own chips; the layers' rows split over
  those groups), the KV write, the copy-on-write scan, the sampler's passes over the vocabulary, the all-reduces;
  each op by its own roofline, the ops in series. Each term names its source (`TERM_SOURCES`: "HLO", "kernel
  grid", "program"). Beside the step programs: the host's time between calls, retrieval and the collectives'
  latency (`llds_jax.aot.beside`, whose `format_faithful` prints the estimate). The partial rollouts' what-if
  stays ideal.
"""
from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence

import numpy as np

from llds_jax.aot import kernel_cost, rollout_schedule, step_lengths
from llds_jax.model import paged_attention
from llds_jax.programs import Role
from llds_jax.aot.roofline import ChipPeaks, HloCost, roofline_seconds
from llds_jax.config.sections import RetrieverConfig, RolloutConfig, RunConfig
from llds_jax.rollout import nucleus
from llds_jax.rollout.config import KernelTiles, SamplingConfig, Tile
from llds_jax.search.factory import resolve_config

ROLLOUT, UPDATES, RESHARD = "rollout", "updates", "weight reshard"  # RESHARD: counted in the rollout, shown apart
FORWARDS = (Role.REFERENCE_LOGP, Role.POLICY_LOGP, Role.LLD_LOGP, Role.UPDATE)  # follow the tokens trained on
# Retrieval's cost per call on one thread, from `python bench/retrieval.py --calls` (the measurements, their machine
# and date: docs/benchmarks.md). faiss searches a call of fewer than BLAS_MIN_QUERIES queries one query per thread,
# each scanning every row (its per-query path); a larger call through BLAS, which reads the rows once per block of
# queries. HNSW64 at efSearch 16 reads a few hundred rows per query; its cost grows with about the log of the rows
# (HNSW_S_PER_QUERY, at 200,000 rows, is a lower bound at wiki-18's size).
FLAT_SCAN_S_PER_MROW = 0.575  # one query scanning a million rows, one thread
FLAT_BLAS_S_PER_QUERY_PER_MROW = 0.0285  # per query and million rows, one thread, faiss's BLAS path
HNSW_S_PER_QUERY = 1.4e-3  # one thread, 200,000 rows
BLAS_MIN_QUERIES = 167  # faiss's distance_compute_blas_threshold (128,000) over 768 dimensions
WIKI18_ROWS = 21_015_324  # Search-R1's e5_Flat.index
HOST_VCPUS = {"v4": 240}  # a Cloud TPU v4 VM host (ct4p-hightpu-4t); other generations: this machine's 2
MEASURED_VCPUS = 2


@dataclasses.dataclass(frozen=True)
class ProgramCost:
    """One compiled program in the estimate: its name and shapes, its cost per call on one chip, its calls per
    training step, which part of the step it belongs to (ROLLOUT, UPDATES, RESHARD or "" for neither) and its role
    (None: a program of no run)."""

    name: str
    shapes: str
    cost: HloCost
    calls: float
    part: str
    role: Role | None = None


def part(role: Role | None, rollout: bool) -> str:
    """The part of the step a program of `role` belongs to (`rollout`: it runs on the rollout's copy of the
    params). The paged engine's step programs are costed by `StepCost`, not by their HLO: ""."""
    if role is Role.RESHARD:
        return RESHARD
    if role in (Role.RETRIEVAL, Role.ROLLOUT_STEP):
        return ""
    return ROLLOUT if rollout else UPDATES


def update_calls(run: RunConfig, updates: int) -> dict[Role, float]:
    """Calls per training step of each training program (module docstring) of the run config `run` with `updates`
    optimizer updates."""
    lld = 1 / run.train.lld_every if run.train.lld_every else 0.0
    return {Role.REFERENCE_LOGP: updates, Role.POLICY_LOGP: updates, Role.LIKELIHOOD_METRICS: 1,
            Role.LLD_LOGP: 2 * updates * lld, Role.LLD_METRICS: lld, Role.UPDATE: updates}


def part_seconds(programs: Sequence[ProgramCost], peaks: ChipPeaks,
                 scale: dict[Role, float] | None = None) -> dict[str, float]:
    """Seconds per step of each part (ROLLOUT, UPDATES, RESHARD): every program's roofline time per call times its
    calls, times `scale[role]` (1 for a role it does not name)."""
    totals = {ROLLOUT: 0.0, UPDATES: 0.0, RESHARD: 0.0}
    for p in programs:
        if p.part:
            totals[p.part] += roofline_seconds(p.cost, peaks).seconds * p.calls * (scale or {}).get(p.role, 1.0)
    return totals


def format_programs(programs: Sequence[ProgramCost], peaks: ChipPeaks, generation: str) -> str:
    """The table of each HLO-costed program's estimated time per call and per step."""
    programs = [p for p in programs if p.part]
    width = max(len(p.name) for p in programs)
    header = (f"{'program':<{width}}  {'GFLOP':>9} {'HBM GB':>8} {'ICI GB':>8} {'bound':>10} {'per call':>9} "
              f"{'calls':>7} {'per step':>9}")
    lines = [f"estimated time per chip (roofline from each program's HLO at {generation} peaks, worst-case calls; "
             "an estimate, not a measurement)", header, "-" * len(header)]
    for p in programs:
        estimate = roofline_seconds(p.cost, peaks)
        lines.append(f"{p.name:<{width}}  {p.cost.flops / 1e9:9.1f} {p.cost.hbm_bytes / 1e9:8.2f} "
                     f"{p.cost.ici_bytes / 1e9:8.3f} {estimate.bound:>10} {estimate.seconds * 1e3:7.2f}ms "
                     f"{p.calls:7.1f} {estimate.seconds * p.calls:8.2f}s")
    return "\n".join(lines)


# ----- the paged engine's calls --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StepCost:
    """What one forward of the rollout model costs on one chip of its tensor-parallel group (module docstring).

    Attributes:
      weight_bytes: bytes of the rollout copy's weights per chip, read once per forward.
      flops_per_token: matrix FLOPs per token per chip in the layers (2 x their matrix parameters / group).
      logit_flops_per_slot: FLOPs per chip of the output projection for one sequence slot (2 x V x D / group).
      page_bytes: bytes of one page of every layer's keys and values per chip.
      ici_bytes_per_token: tensor-parallel all-reduce bytes per token per chip.
      slots: the engine's sequence slots S (a decode iteration's tokens).
    """

    weight_bytes: float
    flops_per_token: float
    logit_flops_per_slot: float
    page_bytes: float
    ici_bytes_per_token: float
    slots: int

    def flops(self, tokens: int) -> float:
        """Matrix FLOPs of one forward of `tokens` tokens: the layers' and the output projection's of every slot."""
        return tokens * self.flops_per_token + self.slots * self.logit_flops_per_slot

    def all_reduce_seconds(self, tokens: int, peaks: ChipPeaks) -> float:
        """Seconds of one forward's tensor-parallel all-reduces over ICI."""
        return tokens * self.ici_bytes_per_token / peaks.ici_bandwidth

    def forward_seconds(self, tokens: int, pages: float, peaks: ChipPeaks) -> float:
        """Seconds of one forward of `tokens` tokens whose sequences read `pages` pages."""
        hbm = self.weight_bytes + pages * self.page_bytes
        return max(self.flops(tokens) / peaks.flops, hbm / peaks.hbm_bandwidth) + self.all_reduce_seconds(tokens, peaks)

    def call_seconds(self, call: rollout_schedule.Call, peaks: ChipPeaks) -> float:
        """Seconds of one step call: its ragged forward at its bucket, then its decode iterations at S slots."""
        per_iteration_pages = call.iteration_pages_read / call.iterations if call.iterations else 0.0
        return (self.forward_seconds(call.bucket, call.pages_read, peaks)
                + call.iterations * self.forward_seconds(self.slots, per_iteration_pages, peaks))


def step_cost(model_cfg, tensor: int, weight_bytes: float, page_size: int, slots: int) -> StepCost:
    """The `StepCost` of a rollout model of `model_cfg` (its compute dtype) split over `tensor` chips, with
    `weight_bytes` per chip (read from the compiled step program), pages of `page_size` slots and `slots` sequence
    slots."""
    m = model_cfg
    itemsize = 2 if m.dtype in ("bfloat16", "float16") else 4
    attention = m.hidden_size * m.head_dim * (2 * m.num_heads + 2 * m.num_kv_heads)  # q, k, v, o
    layer = attention + 3 * m.hidden_size * m.intermediate_size  # and the SwiGLU MLP
    page = m.num_layers * page_size * 2 * m.num_kv_heads * m.head_dim * itemsize / tensor
    all_reduce = 2 * m.num_layers * m.hidden_size * itemsize * 2 * (tensor - 1) / tensor
    return StepCost(weight_bytes, 2 * layer * m.num_layers / tensor, 2 * m.vocab_size * m.hidden_size / tensor, page,
                    all_reduce, slots)


@dataclasses.dataclass(frozen=True)
class RolloutTime:
    """A rollout's seconds per host: the device's (per token bucket), retrieval's blocking ones, and how retrieval
    was costed, in words."""

    bucket_seconds: dict[int, float]
    retrieval: float
    retrieval_how: str

    @property
    def device(self) -> float:
        return sum(self.bucket_seconds.values())


def rollout_time(schedule: rollout_schedule.Schedule, cost: StepCost, peaks: ChipPeaks, retriever: RetrieverConfig,
                 generation: str, searches: float, device_search: ProgramCost | None = None) -> RolloutTime:
    """The device seconds of `schedule`'s calls per bucket, and retrieval's blocking seconds for `searches`
    searches per trajectory under its policy with the run's `retriever` (module docstring)."""
    seconds: dict[int, float] = {}
    for call in schedule.calls:
        seconds[call.bucket] = seconds.get(call.bucket, 0.0) + cost.call_seconds(call, peaks)
    device = sum(seconds.values())
    queries = schedule.sequences * searches
    if schedule.policy == "barrier":
        calls, per_call = schedule.search_waits, queries / max(schedule.search_waits, 1)
    else:
        per_call = min(schedule.rows_in_flight, queries)
        calls = queries / per_call if per_call else 0.0
    per_call_s, how = retrieval_call_seconds(retriever, per_call, generation, peaks, device_search)
    busy = calls * per_call_s
    if schedule.policy == "barrier":
        return RolloutTime(seconds, busy, f"{calls:,.0f} calls held a session (each session's last call of each "
                                          f"turn with searches) of up to {per_call:,.0f} queries x {how}")
    return RolloutTime(seconds, max(0.0, busy - device),
                       f"{queries:,.0f} searches in at least {calls:,.1f} calls of {per_call:,.0f} (the rows in "
                       f"flight) x {how} = {busy:.1f} s busy beside {device:.1f} s of device time; what exceeds it "
                       "blocks")


PARTIAL_OVER_SAMPLING = (1.5, 2.0)  # the what-if's over-sampling factors (issue 59's), for a config without partial


def partial_factors(rollout: RolloutConfig) -> tuple[float, ...]:
    """The over-sampling factors the estimate simulates: the `rollout` section's over_sampling when its partial is
    on, else the what-if's `PARTIAL_OVER_SAMPLING`."""
    return (float(rollout.over_sampling),) if rollout.partial else PARTIAL_OVER_SAMPLING


@dataclasses.dataclass(frozen=True)
class PartialTime:
    """A partial run's steady state (`rollout_schedule.partial_run`): means per step over its steps after
    `rollout_schedule.PARTIAL_WARMUP`.

    Attributes:
      over_sampling: its groups started per step over those trained.
      rollout: seconds of the rollout's calls up to the cut, and retrieval's blocking ones (`rollout_time`).
      started: groups started (carried and fresh); trained: groups trained (P).
      resumed: carried conversations resumed with their tokens; reprefill_tokens: their contexts' tokens.
      carried: conversations handed on with their tokens; dropped: groups dropped for staleness.
    """

    over_sampling: float
    rollout: float
    started: float
    trained: float
    resumed: float
    reprefill_tokens: float
    carried: float
    dropped: float


def partial_time(steps: Sequence[rollout_schedule.PartialStep], over_sampling: float, cost: StepCost,
                 peaks: ChipPeaks, retriever: RetrieverConfig, generation: str, searches: float,
                 device_search: ProgramCost | None = None) -> PartialTime:
    """The steady state of a partial run's `steps` at `over_sampling`: each step's rollout costed as `rollout_time`
    costs a synchronous one (its searches those of the trajectories it trains), averaged over the steps after
    `rollout_schedule.PARTIAL_WARMUP`."""
    steady = steps[rollout_schedule.PARTIAL_WARMUP:]
    if not steady:
        raise ValueError(f"partial_time: {len(steps)} steps, none after the first "
                         f"{rollout_schedule.PARTIAL_WARMUP}")

    def mean(values) -> float:
        return sum(values) / len(steady)

    times = [rollout_time(step.schedule, cost, peaks, retriever, generation, searches, device_search)
             for step in steady]
    return PartialTime(over_sampling, mean(t.device + t.retrieval for t in times), mean(s.started for s in steady),
                       mean(s.trained for s in steady), mean(s.resumed for s in steady),
                       mean(s.reprefill_tokens for s in steady),
                       mean(s.carried for s in steady), mean(s.dropped for s in steady))


def format_partial(sync: RolloutTime, partials: Sequence[PartialTime], reshard: float, updates: float,
                   groups: int, max_staleness: int, what_if: bool) -> str:
    """Lines of partial rollouts (issue 59) beside the synchronous step of `sync`'s rollout, `groups` groups (P)
    trained per step: each over-sampling's steady-state rollout and step (`partial_time`, carried groups dropped
    past `max_staleness` policy versions), each rollout with the weight reshard's `reshard` seconds, each step with
    the updates' `updates` seconds; `what_if`: the config does not turn rollout.partial on."""
    sync_rollout = sync.device + sync.retrieval + reshard
    which = "what-if, rollout.partial is off" if what_if else "rollout.partial"
    lines = [f"  partial rollouts ({which}): the steady state, means of steps "
             f"{rollout_schedule.PARTIAL_WARMUP + 1}-{rollout_schedule.PARTIAL_STEPS} of a simulated run "
             f"(max_staleness {max_staleness}), an estimate, not a measurement",
             f"    synchronous        rollout {sync_rollout:6.1f} s, step {sync_rollout + updates:6.1f} s: "
             f"{groups} groups trained; the rollout ends with its slowest conversation"]
    for p in partials:
        rollout = p.rollout + reshard
        lines.append(f"    over-sampling {p.over_sampling:<4g} rollout {rollout:6.1f} s "
                     f"({rollout / sync_rollout - 1:+.1%}), step {rollout + updates:6.1f} s: {p.trained:.0f} of "
                     f"{p.started:.0f} groups trained; {p.resumed:.1f} conversations resumed "
                     f"({p.reprefill_tokens:,.0f} tokens re-prefilled), {p.carried:.1f} carried on, "
                     f"{p.dropped:.1f} groups dropped")
    return "\n".join(lines)


def host_call_seconds(index_rows: int, queries: float, vcpus: int, hnsw: bool) -> float:
    """Seconds of one faiss call of `queries` queries on a host of `vcpus` threads: HNSW and Flat's per-query path
    one query per thread (ceil(queries / vcpus) rounds); Flat's BLAS path (>= BLAS_MIN_QUERIES) its measured
    per-query cost spread over the threads."""
    rounds = math.ceil(queries / vcpus)
    if hnsw:
        return rounds * HNSW_S_PER_QUERY
    if queries < BLAS_MIN_QUERIES:
        return rounds * FLAT_SCAN_S_PER_MROW * index_rows / 1e6
    return queries * FLAT_BLAS_S_PER_QUERY_PER_MROW * index_rows / 1e6 / vcpus


def retrieval_call_seconds(retriever: RetrieverConfig, queries: float, generation: str, peaks: ChipPeaks,
                           device_search: ProgramCost | None = None) -> tuple[float, str]:
    """Seconds of one retriever call of `queries` queries with the run's `retriever`, and how, in words: the
    e5_device search program's roofline time per device call (`device_search`, compiled at
    `retriever.search_batch` queries or fewer); a faiss Flat (wiki-18's rows) or HNSW64 index by the measured cost
    of such a call on a host's vCPUs (`host_call_seconds`); (0, why) for a retriever without a measured cost."""
    backend = retriever.backend
    if backend == "e5_device" and device_search is not None:
        per_device_call = roofline_seconds(device_search.cost, peaks).seconds
        per_call = per_device_call * math.ceil(queries / resolve_config(retriever).search_batch)
        return per_call, (f"{per_call * 1e3:.2f} ms per call (e5_device, {device_search.shapes}: "
                          f"{per_device_call * 1e3:.2f} ms per device call, roofline from its HLO)")
    index = os.path.basename(resolve_config(retriever).index_path) if backend == "faiss" else ""
    if "Flat" not in index and "HNSW" not in index:
        return 0.0, f"no measured cost per call for retriever {backend!r} (not counted)"
    vcpus = HOST_VCPUS.get(generation, MEASURED_VCPUS)
    hnsw = "HNSW" in index
    per_call = host_call_seconds(WIKI18_ROWS, queries, vcpus, hnsw)
    kind = ("e5 HNSW64 (efSearch 16), one query per thread" if hnsw else
            f"e5 Flat over {WIKI18_ROWS:,} rows, " + ("one query per thread scanning every row"
                                                      if queries < BLAS_MIN_QUERIES else "faiss's BLAS path"))
    return per_call, f"{per_call:.3g} s per call ({kind}, on a host's {vcpus} vCPUs; measured on 1 thread)"


def format_step(label: str, schedule: rollout_schedule.Schedule, time: RolloutTime, reshard: float,
                updates: float, lengths: step_lengths.Lengths) -> str:
    """The lines of one step estimate: the lengths, the rollout's calls, tokens and seconds per token bucket,
    retrieval, and the step with the rollout's share."""
    lines = [f"{label} step at {lengths.source}: per trajectory a prompt of {lengths.prompt_tokens:,.0f} tokens, "
             f"{lengths.turns:.2f} turns sampling {lengths.sampled_tokens:,.0f} tokens, observations of "
             f"{lengths.observation_tokens:,.0f}, {lengths.searches:.2f} searches, {lengths.trajectory_tokens:,.0f} "
             "tokens trained",
             f"  rollout ({schedule.policy}, {schedule.sequences} trajectories per host, up to "
             f"{schedule.rows_in_flight} in flight): token bucket, calls, batch tokens, decode iterations, seconds"]
    for bucket in sorted(time.bucket_seconds):
        calls = [c for c in schedule.calls if c.bucket == bucket]
        lines.append(f"  {bucket:>6} {len(calls):>7,} {sum(c.tokens for c in calls):>11,} "
                     f"{sum(c.iterations for c in calls):>9,} {time.bucket_seconds[bucket]:9.2f}s")
    rollout = time.device + time.retrieval + reshard
    step = rollout + updates
    lines += [f"  retrieval (in the rollout, what rows wait for): {time.retrieval_how}: {time.retrieval:.1f} s",
              f"  {label} step: rollout {rollout:.1f} s (device {time.device:.1f} s, retrieval {time.retrieval:.1f} s, "
              f"weight reshard {reshard:.2f} s) + updates {updates:.1f} s = {step:.1f} s; rollout {rollout / step:.1%} "
              "of the step (an estimate, not a measurement)"]
    return "\n".join(lines)


def format_counts(schedule: rollout_schedule.Schedule, logged: dict[int, tuple[float, float]], source: str) -> str:
    """Predicted against logged step calls and batch tokens per token bucket (per host and step)."""
    lines = [f"step calls per host and step, predicted (at the run's lengths) vs logged ({source}): token bucket, "
             "calls, batch tokens"]
    for bucket in sorted(set(logged) | set(schedule.calls_per_bucket)):
        calls, tokens = logged.get(bucket, (0.0, 0.0))
        lines.append(f"  {bucket:>6} {schedule.calls_per_bucket.get(bucket, 0):>8,} vs {calls:>10,.1f}   "
                     f"{schedule.tokens_per_bucket.get(bucket, 0):>10,} vs {tokens:>12,.1f}")
    total = sum(c for c, _ in logged.values())
    lines.append(f"  all    {len(schedule.calls):>8,} vs {total:>10,.1f}")
    return "\n".join(lines)


# ----- the step call as the kernel runs it (issue 67) ----------------------------------------------------------------

# Where a term of the kernel-faithful estimate comes from: modelled from the compiled program's HLO (its FLOPs equal
# the HLO's, its weight bytes are the program's arguments), from the kernel's grid (`kernel_cost`), counted from the
# step program's code at its shapes, or measured (a bench's figure; a placeholder until one is).
HLO, KERNEL_GRID, PROGRAM, MEASURED = "HLO", "kernel grid", "program", "measured"
# The sampler's passes over a row's float32 logits per draw (`rollout.sampling.sample_tokens`), reads and writes of
# [rows, V] each: a softmax or log-softmax 3 (the row's max, its sum of exponentials, the result written); the
# inverse-CDF draw 3 (the cumulative sum read and written, the count below u read); the nucleus' bisection
# `nucleus.BISECTION_STEPS` masked sums and its kept set 2 (read, written); greedy's argmax 1, top-k's 1.
SOFTMAX_PASSES, DRAW_PASSES, KEPT_SET_PASSES, ARGMAX_PASSES, TOP_K_PASSES = 3, 3, 2, 1, 1


def sampler_passes(sampling: SamplingConfig) -> int:
    """Passes over a row's vocabulary of one draw of `sampling` (the log-probs' log-softmax included)."""
    if sampling.greedy:
        return SOFTMAX_PASSES + ARGMAX_PASSES
    if sampling.top_k:
        return SOFTMAX_PASSES + TOP_K_PASSES
    nucleus_passes = nucleus.BISECTION_STEPS + KEPT_SET_PASSES if sampling.top_p < 1 else 0
    return 2 * SOFTMAX_PASSES + nucleus_passes + DRAW_PASSES


# The terms of a step call, each with its source.
LAYERS, ATTENTION, KV_WRITE, COPIES, SAMPLER, ALL_REDUCE = (
    "layers (matrices, weights)", "attention kernel", "KV write", "copy-on-write scan", "sampler",
    "tensor-parallel all-reduces")
TERM_SOURCES = {LAYERS: HLO, ATTENTION: KERNEL_GRID, KV_WRITE: PROGRAM, COPIES: PROGRAM, SAMPLER: PROGRAM,
                ALL_REDUCE: PROGRAM}


@dataclasses.dataclass(frozen=True)
class FaithfulCost:
    """A step call on one chip as the step program and the shipped kernel run it (issue 67): `StepCost`'s forwards,
    each layer's attention costed from the kernel's grid (`kernel_cost`) instead of the pages the sequences hold, at
    the tile the runner passes (`tiles`: per token bucket, and in decode iterations), and the work around it. A
    decode iteration runs only the rows still sampling, dealt to `batches` ragged batches (`runner.decode_rows`:
    the i-th sampling row in slot order to batch i mod B, each batch's kernel call on its own chips: a chip's is
    the first batch's, which holds the most); the layers' rows (tokens, logits) are split over the B batches. Each
    of its ops is costed by its own roofline, max(FLOPs / peak, bytes / bandwidth), and the ops add up (a layer's
    attention waits for its projections, the sampler for the logits).

    Attributes:
      step: the forward's layers (`StepCost`: FLOPs as the HLO's on one group, the weights' bytes, the
        all-reduces).
      kernel: one layer's kernel call's shape on the chip (its heads, pages; the tile comes from `tiles`).
      tiles: the kernel's tiles (`KernelTiles`; 0: the kernel's default).
      batches: B, the ragged batches of a decode iteration and the shares of the layers' rows
        (`runner.decode_batches`: the rollout's tensor-parallel groups split over data).
      layers: L, kernel calls per forward.
      kv_write_bytes_per_token: every layer's keys and values of one token on the chip (the scatter into the pool;
        padding tokens and rows not sampling dropped; every chip writes every batch's tokens).
      sampler_passes: a draw's passes over its logits (`sampler_passes`).
      logits_bytes: the chip's share of a draw's float32 logits [S, V] (the rows split over every mesh axis:
        "sampled_rows").
    """

    step: StepCost
    kernel: kernel_cost.KernelShape
    tiles: KernelTiles
    batches: int
    layers: int
    kv_write_bytes_per_token: float
    sampler_passes: int
    logits_bytes: float

    def kernel_at(self, tile: Tile) -> kernel_cost.KernelShape:
        """The kernel's shape at `tile` (0: the kernel's default, `paged_attention.KERNEL_*`)."""
        return dataclasses.replace(
            self.kernel, kv_pages_per_block=tile.kv_pages_per_block or paged_attention.KERNEL_KV_PAGES_PER_BLOCK,
            queries_per_block=tile.queries_per_block or paged_attention.KERNEL_QUERIES_PER_BLOCK)

    def forward_terms(self, tokens: int, written: int, q_lens, kv_lens, tile: Tile, peaks: ChipPeaks,
                      operand: int = 0) -> tuple[dict[str, float], kernel_cost.KernelCall]:
        """Seconds per term of one forward of `tokens` tokens (their rows split over the batches), `written` of them
        real, whose chip's kernel call at `tile` takes sequences of `q_lens` new tokens and `kv_lens` slots in a q
        operand of `operand` tokens (0: `tokens`); and that kernel call."""
        s = self.step
        call = kernel_cost.kernel_call(self.kernel_at(tile), operand or tokens, q_lens, kv_lens)
        return {LAYERS: max(s.flops(tokens) / self.batches / peaks.flops, s.weight_bytes / peaks.hbm_bandwidth),
                ATTENTION: self.layers * max(call.flops / peaks.flops, call.hbm_bytes / peaks.hbm_bandwidth),
                KV_WRITE: written * self.kv_write_bytes_per_token / peaks.hbm_bandwidth,
                SAMPLER: self.sampler_passes * self.logits_bytes / peaks.hbm_bandwidth,
                ALL_REDUCE: s.all_reduce_seconds(tokens, peaks) / self.batches}, call

    def call_terms(self, call: rollout_schedule.Call, peaks: ChipPeaks) -> tuple[dict[str, float], KernelTally]:
        """Seconds per term of one step call (its copy-on-write scan over the S page copies it is compiled with,
        its ragged forward at its bucket, whole on every chip, then its decode iterations over the rows still
        sampling), and its chip's kernel calls' work over all its layers."""
        slots = self.step.slots
        terms, first = self.forward_terms(call.bucket, call.tokens, call.q_lens, call.kv_lens,
                                          self.tiles.forward(call.bucket, slots), peaks)
        terms[COPIES] = slots * 2 * self.step.page_bytes / peaks.hbm_bandwidth  # each copy read and written
        tally = KernelTally.of(first, self.layers)
        samples_s, kv_lens_s = np.asarray(call.samples), np.asarray(call.kv_lens)
        for i in range(1, call.iterations + 1):
            sampling_s = samples_s > i
            first_batch = (kv_lens_s + i)[sampling_s][::self.batches]  # its 1st, (B + 1)-th, ... sampling rows
            more, kernel = self.forward_terms(slots, int(sampling_s.sum()), np.ones_like(first_batch), first_batch,
                                              self.tiles.decode, peaks, operand=slots // self.batches)
            terms = {name: seconds + more.get(name, 0.0) for name, seconds in terms.items()}
            tally = tally + KernelTally.of(kernel, self.layers)
        return terms, tally


@dataclasses.dataclass(frozen=True)
class KernelTally:
    """Kernel calls' work added up (`kernel_cost.KernelCall`): grid steps, pages copied, of which the pages the
    sequences hold, bytes copied from the pool, MXU FLOPs."""

    grid_steps: int = 0
    page_copies: int = 0
    useful_page_copies: int = 0
    pool_bytes: float = 0.0
    flops: float = 0.0

    @classmethod
    def of(cls, call: kernel_cost.KernelCall, layers: int) -> KernelTally:
        """`call` made once in each of `layers` layers."""
        return cls(layers * call.grid_steps, layers * call.page_copies, layers * call.useful_page_copies,
                   layers * call.pool_bytes, layers * call.flops)

    def __add__(self, other: KernelTally) -> KernelTally:
        return KernelTally(*(getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self)))


def faithful_cost(step: StepCost, model_cfg, tensor: int, page_size: int, pages_per_seq: int, row_shards: int,
                  sampling: SamplingConfig, tiles: KernelTiles = KernelTiles(), batches: int = 1) -> FaithfulCost:
    """The `FaithfulCost` of `step` (`step_cost`'s) for a rollout model of `model_cfg` over `tensor` chips (its
    heads split over them), pages of `page_size` slots, `pages_per_seq` per sequence, the sampled rows split
    `row_shards` ways, drawn as `sampling` says, at the kernel's `tiles` (default: the kernel's own), decode
    iterations in `batches` ragged batches (`runner.decode_batches`)."""
    m = model_cfg
    kernel = kernel_cost.KernelShape(m.num_heads // tensor, m.num_kv_heads // tensor, m.head_dim, page_size,
                                     pages_per_seq, m.dtype, paged_attention.KERNEL_KV_PAGES_PER_BLOCK,
                                     paged_attention.KERNEL_QUERIES_PER_BLOCK)
    rows = -(-step.slots // row_shards)
    return FaithfulCost(step, kernel, tiles, batches, m.num_layers, m.num_layers * kernel.page_bytes / page_size,
                        sampler_passes(sampling), rows * m.vocab_size * 4)


@dataclasses.dataclass(frozen=True)
class FaithfulTime:
    """A rollout's device seconds per term (`TERM_SOURCES`) as the kernel runs its calls, its kernel calls' work
    (`KernelTally`) and each call's device seconds (all its terms), in the schedule's order."""

    terms: dict[str, float]
    kernel: KernelTally
    call_seconds: tuple[float, ...] = ()

    @property
    def device(self) -> float:
        return sum(self.terms.values())


def faithful_time(schedule: rollout_schedule.Schedule, cost: FaithfulCost, peaks: ChipPeaks) -> FaithfulTime:
    """Every call of `schedule` costed by `cost` (`FaithfulCost.call_terms`), added up."""
    terms, tally, per_call = dict.fromkeys(TERM_SOURCES, 0.0), KernelTally(), []
    for call in schedule.calls:
        more, kernel = cost.call_terms(call, peaks)
        terms = {name: seconds + more[name] for name, seconds in terms.items()}
        tally = tally + kernel
        per_call.append(sum(more.values()))
    return FaithfulTime(terms, tally, tuple(per_call))
