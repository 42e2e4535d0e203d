"""Figures the kernel-faithful step estimate (`llds_jax.aot.step_estimate`) takes from benches, not models: each
with the command, the commit and the machine that produced it (the dates: docs/benchmarks.md). Rerun the command and copy what it prints
here to update one (`bench/engine_host.py --emit`, `bench/retrieval.py --second-pass`).

The host's time per call is this machine's: a Cloud TPU VM's host CPUs are faster or slower.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class HostTable:
    """The rollout engine's host milliseconds per step call at several sequences in flight (`bench/engine_host.py`:
    `Engine.step` less the device's call, with a device that answers at once).

    Attributes:
      sequences: sequences in flight, ascending.
      ms_per_call: host milliseconds per call at each.
      command, commit, machine: what produced it.
    """

    sequences: tuple[int, ...]
    ms_per_call: tuple[float, ...]
    command: str
    commit: str
    machine: str

    def seconds(self, in_flight: float) -> float:
        """Host seconds of a call with `in_flight` sequences: the table's figures joined by straight lines, the
        first and last segments extended beyond the ends (at least 0)."""
        xs, ys = self.sequences, self.ms_per_call
        i = min(max(sum(x <= in_flight for x in xs) - 1, 0), len(xs) - 2)
        slope = (ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i])
        return max(0.0, ys[i] + slope * (in_flight - xs[i])) / 1e3


@dataclasses.dataclass(frozen=True)
class SecondPass:
    """The share of the e5_device searcher's queries not proven at its first pass (`device_search.ExactSearcher`:
    searched again at 4x the candidates), measured by `bench/retrieval.py --second-pass`.

    Attributes:
      rate: the share of queries that needed a second device pass.
      queries, rows: how many queries were searched, over how many rows.
      what, command, commit: the vectors and queries, and what produced it.
    """

    rate: float
    queries: int
    rows: int
    what: str
    command: str
    commit: str


# `PYTHONPATH=. python bench/engine_host.py --repeats 3 --emit` at b09cb03 (the bench as at fd8e38c), best of 3
# batches per sequence count; an earlier best of 2 on the same tree read 0.35 / 0.52 / 1.43 / 1.74 ms (the machine
# shared with other jobs: the figures move by up to 2x between runs).
HOST = HostTable((32, 64, 128, 256), (0.4, 0.67, 0.79, 0.84), "PYTHONPATH=. python bench/engine_host.py --repeats 3",
                 "b09cb03", "x86_64 CPU, 2 cores, load average 3.25 2.67 3.08")
# The demo's own world (400 people, 500 passages) needed no second pass (0 of 1,200 queries) and 4,000 people (5,000
# passages) 1.12% of 12,000: the rate grows with the rows (a first pass's 32 candidates hold a smaller share of
# the near ties), so the largest world measured is taken; wiki-18's 21M rows of e5-base-v2's 768 dimensions are
# not measured here (the step estimate prints the retrieval term with a second pass for every query beside it).
SECOND_PASS = SecondPass(
    0.0972, 60_000, 25_000,
    "the demo world at 20,000 people (25,000 passages) embedded by the demo's random BERT of e5's layout (32 "
    "dimensions), the demonstrator's search queries (every hop of 50,000 questions), top 3, 32 candidates first: "
    "5,768 queries took 2 passes, 64 took 3",
    "python bench/retrieval.py --second-pass --world-people 20000", "fd8e38c")
