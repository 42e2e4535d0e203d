"""The kernel-faithful step estimate's terms beside the step programs, and its printout: the host's time between calls
(measured: `measured.HOST`, bench/engine_host.py on this machine, per call at its sequences in flight; beside the
device's for the engine that dispatches each call before it absorbs the one in flight, `overlapped`, else in series),
retrieval (e5_device: on the rollout's chips in series with the step programs, `retrieval_in_series`: a retriever call
after each step call that closed searching turns, its search programs' roofline from their HLO, the second pass at
the measured rate `measured.SECOND_PASS`; a host backend: the ideal's overlap model, `step_estimate.rollout_time`) and
the collectives' latency (`Collectives`: the step program's collectives per call and per decode iteration counted from
its HLO, x ICI_HOP_LATENCY_S per ring step, a modelled figure). `format_faithful` prints the device terms of
`step_estimate.FaithfulCost` with these.

Units: seconds, bytes, FLOPs; per chip of the rollout's tensor-parallel group.
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence

from llds_jax.aot import measured, rollout_schedule
from llds_jax.aot.roofline import ChipPeaks, HloCost, roofline_seconds
from llds_jax.config.sections import RetrieverConfig
from llds_jax.aot.step_estimate import (ATTENTION, HLO, MEASURED, SAMPLER, TERM_SOURCES, FaithfulCost, FaithfulTime,
                                        ProgramCost, RolloutTime)
from llds_jax.programs import Role
from llds_jax.search import device_search
from llds_jax.search.factory import resolve_config

def format_faithful(label: str, cost: FaithfulCost, time: FaithfulTime, ideal: RolloutTime, reshard: float,
                    updates: float, beside: dict[str, Beside]) -> str:
    """The lines of one step estimate as the kernel runs its calls, beside the ideal one (`format_step`'s, whose
    rollout is `ideal`): each device term with its source and seconds, then the terms `beside` the step programs
    (`beside_terms`: the host's time, retrieval, the collectives' latency), and the step with the rollout's share
    of it, the ideal's beside it."""
    tally = time.kernel
    useful = tally.useful_page_copies / max(tally.page_copies, 1)
    notes = {ATTENTION: f"{tally.grid_steps:,} grid steps, {tally.pool_bytes / 1e9:,.1f} GB of pages copied "
                        f"({useful:.0%} of them pages the sequences hold), {tally.flops / 1e12:,.1f} TFLOP on the MXU",
             SAMPLER: f"{cost.sampler_passes} passes per draw over the chip's rows of float32 logits"}
    forward, decode = cost.kernel_at(cost.tiles.ragged), cost.kernel_at(cost.tiles.decode)
    batches = f"{cost.batches} batches" if cost.batches > 1 else "one batch"
    lines = [f"  {label} step, kernel-faithful (issue 67): each call as JAX's ragged paged attention runs it, at the "
             f"tile {forward.kv_pages_per_block} kv pages x {forward.queries_per_block} queries (the slots' bucket and "
             f"decode iterations: {decode.kv_pages_per_block} x {decode.queries_per_block}), pages of "
             f"{cost.kernel.page_size} slots, each decode iteration over its sampling rows in {batches}: term, source, "
             "seconds"]
    for name, source in TERM_SOURCES.items():
        note = f"  ({notes[name]})" if name in notes else ""
        lines.append(f"    {name:<30} {source:<12} {time.terms[name]:8.2f} s{note}")
    for name, term in beside.items():
        lines.append(f"    {name:<30} {term.source:<12} {term.seconds:8.2f} s  ({term.how})")
    rest = {name: term.seconds for name, term in beside.items()}
    rollout = time.device + sum(rest.values()) + reshard
    step = rollout + updates
    ideal_rollout = ideal.device + ideal.retrieval + reshard
    lines.append(f"  {label} step, kernel-faithful: rollout {rollout:.1f} s (device {time.device:.1f} s, host "
                 f"{rest.get(HOST_TERM, 0.0):.1f} s, retrieval {rest.get(RETRIEVAL_TERM, 0.0):.1f} s, collectives' "
                 f"latency {rest.get(COLLECTIVES_TERM, 0.0):.1f} s, weight reshard {reshard:.2f} s) + updates "
                 f"{updates:.1f} s = {step:.1f} s; rollout {rollout / step:.1%} of the step (ideal: "
                 f"{ideal_rollout / (ideal_rollout + updates):.1%}; an estimate, not a measurement)")
    return "\n".join(lines)


# ----- beside the step programs: the host between calls, retrieval in series, the collectives' latency -----------

HOST_TERM, RETRIEVAL_TERM, COLLECTIVES_TERM = "host time between calls", "retrieval", "collectives' latency"
COLLECTIVES_SOURCE = "HLO (count) x modelled latency"
# One ICI hop's latency: 1 us, the link latency ASTRA-sim's validation on TPU v3 takes "as per the TPU research
# team" (https://astra-sim.github.io/astra-sim-docs/validation/hardware/tpu-validation.html); no v4 figure is
# published. A collective run as a ring of s steps (`roofline.ring_steps`: 2 (n - 1) for an all-reduce over n chips)
# waits s hops in series. A modelled figure, and a low one: the runtime's own overhead per collective is not added.
ICI_HOP_LATENCY_S = 1e-6


@dataclasses.dataclass(frozen=True)
class Beside:
    """A term of the rollout beside the step programs' device terms: its seconds, its source and how it was
    counted, in words."""

    seconds: float
    source: str
    how: str


def host_seconds(schedule: rollout_schedule.Schedule, table: measured.HostTable,
                 call_seconds: Sequence[float] = (), overlapped: bool = False) -> float:
    """The host's seconds between the calls of `schedule`: per call the measured host time at its sequences in
    flight (`measured.HostTable.seconds`). In series with the device (the engine absorbs a call's results, then
    schedules and dispatches the next: host and device take turns) all of it adds to the rollout; `overlapped`
    (the next call scheduled while one runs) only what exceeds the call's own device seconds (`call_seconds`, in
    the schedule's order): per call max(host, device) - device."""
    hosts = [table.seconds(call.in_flight) for call in schedule.calls]
    if not overlapped:
        return sum(hosts)
    return sum(max(0.0, host - device) for host, device in zip(hosts, call_seconds, strict=True))


@dataclasses.dataclass(frozen=True)
class SearchPrograms:
    """The e5_device search as the rollout's chips run it (`search.device_search.ExactSearcher`): each device call's
    roofline seconds by its (queries, candidates) program (`retriever_programs.search_programs`, from their HLO),
    the first pass's candidates, the queries of a device call at most (`retriever.search_batch`) and the share of
    queries a first pass leaves unproven (`measured.SECOND_PASS`)."""

    seconds: dict[tuple[int, int], float]
    first: int
    max_batch: int
    second_pass: float

    @property
    def second(self) -> int | None:
        """The candidates of the second pass: the next count a program was compiled at (None: none)."""
        return min((m for _, m in self.seconds if m > self.first), default=None)

    def call_seconds(self, queries: int) -> float:
        """Expected seconds of one retriever call of `queries` queries: its device calls of up to `max_batch`
        queries, each its first pass's program at the queries' batch bucket, plus, with the chance that one of its
        n queries is unproven (1 - (1 - rate)^n, queries independent), a second pass at the next candidate count
        over the bucket of its ceil(rate x n) unproven queries (at least 1). Third passes are left out."""
        total = 0.0
        for start in range(0, queries, self.max_batch):
            n = min(self.max_batch, queries - start)
            total += self.seconds[device_search.batch_bucket(n, self.max_batch), self.first]
            if self.second is not None and self.second_pass:
                unproven = max(1, math.ceil(self.second_pass * n))
                total += ((1 - (1 - self.second_pass) ** n)
                          * self.seconds[device_search.batch_bucket(unproven, self.max_batch), self.second])
        return total


SEARCH_SHAPE = re.compile(r"(\d+) queries, (\d+) candidates")  # a search program's name (`abstract_program`)


def search_programs(costs: Sequence[ProgramCost], retriever: RetrieverConfig, peaks: ChipPeaks,
                    second_pass: float) -> SearchPrograms | None:
    """The `SearchPrograms` of the compiled search programs among `costs` (role RETRIEVAL, named "... (Q queries,
    M candidates)"; the first of them the first pass's, `retriever_programs.search_programs`), at `peaks`, with
    retriever.search_batch (the run's `retriever`) and the `second_pass` rate; None without any (another backend)."""
    found = [(SEARCH_SHAPE.search(c.name), c) for c in costs if c.role is Role.RETRIEVAL]
    if not found:
        return None
    seconds = {(int(m.group(1)), int(m.group(2))): roofline_seconds(c.cost, peaks).seconds for m, c in found}
    return SearchPrograms(seconds, int(found[0][0].group(2)), resolve_config(retriever).search_batch,
                          second_pass)


def retrieval_in_series(schedule: rollout_schedule.Schedule, search: SearchPrograms) -> tuple[float, int, int]:
    """(seconds, retriever calls, queries) of the searches of `schedule` on the rollout's chips, in series with its
    step programs: one retriever call after each step call that closed searching turns, of its `Call.searches`
    queries (`SearchPrograms.call_seconds`)."""
    calls = [call.searches for call in schedule.calls if call.searches]
    return sum(search.call_seconds(q) for q in calls), len(calls), sum(calls)


@dataclasses.dataclass(frozen=True)
class Collectives:
    """The step program's collectives per call read from its compiled HLO (`roofline.HloCost.collective_runs`, its
    decode loop counted once): runs and ring steps in series (`roofline.ring_steps`) outside the decode iterations'
    loop (the copy scan, the ragged forward's layers, its draw) and inside it, per decode iteration (its body once
    and its condition twice, `hlo_costs`' count of 1 for a loop of run-time length: an upper bound of one
    iteration's)."""

    runs: float
    hops: float
    iteration_runs: float
    iteration_hops: float

    @classmethod
    def of(cls, cost: HloCost) -> Collectives:
        def total(loop: bool, steps_weight: bool) -> float:
            return sum(n * (steps if steps_weight else 1) for (inside, steps), n in cost.collective_runs.items()
                       if inside is loop)
        return cls(total(False, False), total(False, True), total(True, False), total(True, True))

    def seconds(self, schedule: rollout_schedule.Schedule) -> float:
        """The collectives' latency of `schedule`'s calls: each call's hops (its decode iterations' too) x
        ICI_HOP_LATENCY_S."""
        iterations = sum(call.iterations for call in schedule.calls)
        return (len(schedule.calls) * self.hops + iterations * self.iteration_hops) * ICI_HOP_LATENCY_S


def beside_terms(schedule: rollout_schedule.Schedule, time: FaithfulTime, ideal: RolloutTime,
                 retriever: RetrieverConfig, host: measured.HostTable, search: SearchPrograms | None,
                 collectives: Collectives, overlapped: bool = False) -> dict[str, Beside]:
    """The rollout's terms beside the step programs' device terms, each with its source: the host's time between
    calls (`host_seconds`, measured; in series unless `overlapped`), retrieval (e5_device: in series on the same
    chips, `retrieval_in_series`; a host backend: the ideal's overlap model, `rollout_time`) and the collectives'
    latency (`Collectives.seconds`)."""
    in_flight = sum(call.in_flight for call in schedule.calls) / max(len(schedule.calls), 1)
    how = ("beside the device's (overlapped: per call max(host, device))" if overlapped else
           "in series with the device (host and device take turns)")
    terms = {HOST_TERM: Beside(
        host_seconds(schedule, host, time.call_seconds, overlapped), MEASURED,
        f"{len(schedule.calls):,} calls at {in_flight:.0f} sequences in flight on average, each at `{host.command}`'s "
        f"ms per call at {'/'.join(map(str, host.sequences))} sequences "
        f"({'/'.join(f'{ms:g}' for ms in host.ms_per_call)}) interpolated; {host.machine}, at {host.commit}: "
        f"this machine's figure, a TPU VM's host is faster or slower; {how}")}
    if search is not None:
        seconds, calls, queries = retrieval_in_series(schedule, search)
        every = retrieval_in_series(schedule, dataclasses.replace(search, second_pass=1.0))[0]
        terms[RETRIEVAL_TERM] = Beside(seconds, f"{HLO} + {MEASURED}", (
            f"e5_device on the rollout's chips, in series with the step programs: {calls:,} retriever calls of "
            f"{queries / max(calls, 1):.1f} queries on average (the schedule's), each its search programs' roofline "
            f"from their HLO (first pass at {search.first} candidates) and a second pass at {search.second} at the "
            f"measured second-pass rate {search.second_pass:.2%} per query (`{measured.SECOND_PASS.command}`); with "
            f"a second pass for every query: {every:.1f} s"))
    else:
        source = MEASURED if ideal.retrieval or "measured" in ideal.retrieval_how else "-"
        terms[RETRIEVAL_TERM] = Beside(ideal.retrieval, source, (
            f"{retriever.backend} on the host's CPUs beside the device (the ideal's overlap model: what "
            f"exceeds the device's time blocks): {ideal.retrieval_how}"))
    iterations = sum(call.iterations for call in schedule.calls)
    terms[COLLECTIVES_TERM] = Beside(collectives.seconds(schedule), COLLECTIVES_SOURCE, (
        f"{collectives.runs:g} collectives per call ({collectives.hops:g} hops in series) + "
        f"{collectives.iteration_runs:g} per decode iteration ({collectives.iteration_hops:g} hops) from the step "
        f"program's HLO, over {len(schedule.calls):,} calls and {iterations:,} decode iterations, x "
        f"{ICI_HOP_LATENCY_S * 1e6:g} us per ICI hop"))
    return terms
