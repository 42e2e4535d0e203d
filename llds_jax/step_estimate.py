"""An ESTIMATED training-step time for `--mode=compile`: each compiled program's roofline time (`llds_jax.roofline`,
read from its HLO) times the calls a step makes of it, split into the rollout and the updates.

Not a measurement: peak rates are never reached, and the call counts rest on stated assumptions, the worst case
the config allows:
- every sampler session (`rollout.max_batch_size` rows, or the host's share) runs `rollout.max_turns` + 1 turns
  and waits in each for a row that samples `rollout.max_turn_tokens` tokens (turn-synchronous sessions wait for
  their longest row), in decode chunks of `rollout.decode_chunk` steps (a chunk stops once every row is done, so
  a turn's last chunk runs only the steps left: max_turn_tokens / decode_chunk chunks' worth of steps), each at
  the largest cache capacity a conversation can reach;
- each session prefills once, extends `rollout.max_turns` observations, grows its cache and compacts once;
- with `rollout.cache_block`, decode and extends read the cache's filled blocks alone (`filled_blocks`): a
  conversation's slots are its prompt bucket, then each turn's `rollout.max_turn_tokens` and each observation's
  `rollout.max_observation_tokens` (padded to its bucket while it is appended), a short prompt padded to the
  largest prompt bucket (the `max_context_tokens` cap never binds);
- continuous batching (`rollout.continuous_batching`): at the worst case every row's sequences run in lockstep,
  so its calls are the sessions' (one empty batch, prompt extends of every row in place of prefills, observation
  extends of every row; `rollout.max_extend_rows` rows per call);
- tree rollouts (`rollout.trees`): each session's chains and its `rollout.tree_rounds` forked rounds each run as
  a session at the largest round's rows (an upper bound: a forked round starts from the fork's turn), with one fork
  per round;
- hosts sample their sessions at the same time (a step's rollout is one host's); evaluation is left out (it runs
  every `train.eval_every` steps);
- the updates: `optim` updates per step, each with its reference and policy log-probs; the LLD measurement
  (`train.lld_every`) its two float32 forwards per update and its metrics, spread over the steps between.
"""
from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence

from llds_jax import step_lengths
from llds_jax.programs import Role
from llds_jax.roofline import ChipPeaks, HloCost, roofline_seconds

ROLLOUT, UPDATES, RESHARD = "rollout", "updates", "weight reshard"  # RESHARD: counted in the rollout, shown apart
FORWARDS = (Role.REFERENCE_LOGP, Role.POLICY_LOGP, Role.LLD_LOGP, Role.UPDATE)  # follow the tokens trained on
# Retrieval's cost per call (issue 55), measured on this project's 2-vCPU machine with faiss on one thread
# (`python bench/retrieval.py --calls --dense-rows 200000`, docs/benchmarks.md, 2026-12-05). faiss searches a call
# of fewer than BLAS_MIN_QUERIES queries one query per thread, each scanning every row (its per-query path); a
# larger call through BLAS, which reads the rows once per block of queries. HNSW64 at efSearch 16 reads a few
# hundred rows per query (seconds per query at 200,000 rows; its cost grows with about the log of the rows: a lower
# bound at wiki-18's size).
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
    training step, which part of the step it belongs to (ROLLOUT, UPDATES or "" for neither) and its role (None:
    a program of no run)."""

    name: str
    shapes: str
    cost: HloCost
    calls: float
    part: str
    role: Role | None = None


def part(role: Role | None, rollout: bool) -> str:
    """The part of the step a program of `role` belongs to (`rollout`: it runs on the rollout's copy of the
    params)."""
    if role is Role.RESHARD:
        return RESHARD
    if role is Role.RETRIEVAL:
        return ""  # retrieval is its own line of the expected step (`retrieval_seconds`)
    return ROLLOUT if rollout else UPDATES


def rollout_calls(cfg, sequences: int, rows: int) -> dict[Role, float]:
    """Calls per training step of each rollout program (module docstring) for one host's `sequences` sequences in
    sessions of `rows` rows."""
    r = cfg.rollout
    sessions = _sessions(cfg, sequences, rows)
    turns = r.max_turns + 1
    if r.trees:  # every round of a session at the largest round's rows, each forked round from its first turn
        rounds = 1 + r.tree_rounds
        return {Role.PREFILL: sessions, Role.EXTEND: sessions * rounds * r.max_turns,
                Role.FORK: sessions * r.tree_rounds,
                Role.DECODE_CHUNK: sessions * rounds * turns * r.max_turn_tokens / r.decode_chunk,
                Role.CACHE_GROWTH: sessions * rounds, Role.COMPACTION: sessions}
    calls = {Role.DECODE_CHUNK: sessions * turns * r.max_turn_tokens / r.decode_chunk, Role.CACHE_GROWTH: sessions,
             Role.COMPACTION: sessions}
    if r.continuous_batching:  # one batch; each row's sequences at the worst case run in lockstep, as sessions
        per_batch = rows / min(rows, r.max_extend_rows or rows)  # extend calls for every row of the batch
        return {Role.EMPTY_BATCH: 1, Role.PROMPT_EXTEND: sessions * per_batch,
                Role.ROW_EXTEND: sessions * r.max_turns * per_batch, **calls}
    return {Role.PREFILL: sessions, Role.EXTEND: sessions * r.max_turns, **calls}


def _sessions(cfg, sequences: int, rows: int) -> int:
    """Sampler sessions of one host's `sequences` sequences in sessions of `rows` rows; a tree rollout's sessions
    hold `rollout.max_batch_size` samples each (its rows are those of its largest round)."""
    if cfg.rollout.trees:
        return math.ceil(sequences / (cfg.rollout.max_batch_size or sequences))
    return math.ceil(sequences / rows)


def filled_blocks(cfg, prompt: int, observation: int, capacity: int) -> tuple[float, float]:
    """(mean cache blocks a decode step reads, mean blocks an extend pass reads) under the module's assumptions,
    with `prompt` and `observation` the largest buckets and `capacity` the largest cache: a query at slot q reads
    q // block + 1 blocks of `rollout.cache_block` slots (at most capacity / block). The decode chunk's and the
    extend's block loops are counted at these means (their costs are linear in the count)."""
    r = cfg.rollout
    block = min(r.cache_block or capacity, capacity)
    cap = capacity // block
    per_turn = r.max_turn_tokens + r.max_observation_tokens
    decode = [min(cap, (prompt + t * per_turn + i) // block + 1)
              for t in range(r.max_turns + 1) for i in range(r.max_turn_tokens)]
    chunk = min(r.extend_chunk or observation, observation)
    extend = [min(cap, (prompt + t * per_turn + r.max_turn_tokens + (p + 1) * chunk - 1) // block + 1)
              for t in range(r.max_turns) for p in range(observation // chunk)]
    return sum(decode) / len(decode), (sum(extend) / len(extend) if extend else float(cap))


def update_calls(cfg, updates: int) -> dict[Role, float]:
    """Calls per training step of each training program (module docstring) with `updates` optimizer updates."""
    lld = 1 / cfg.train.lld_every if cfg.train.lld_every else 0.0
    return {Role.REFERENCE_LOGP: updates, Role.POLICY_LOGP: updates, Role.LIKELIHOOD_METRICS: 1,
            Role.LLD_LOGP: 2 * updates * lld, Role.LLD_METRICS: lld, Role.UPDATE: updates}


def assumptions(cfg, sequences: int, rows: int) -> str:
    """The call counts' assumptions in one line."""
    r = cfg.rollout
    read = (f"reading the filled cache in blocks of {r.cache_block} slots" if r.cache_block
            else "attending over every slot of the largest cache capacity")
    rounds = f" in each of 1 + {r.tree_rounds} tree round(s) (chains, then forks)" if r.trees else ""
    return (f"assumed per host and step: {sequences} trajectories in {_sessions(cfg, sequences, rows)} session(s) "
            f"of {rows} rows, each "
            f"{r.max_turns + 1} turns of {r.max_turn_tokens} decode steps (the longest row){rounds} in chunks of "
            f"{r.decode_chunk}, {r.max_turns} extends of {r.max_observation_tokens} tokens, {read}")


def part_seconds(programs: Sequence[ProgramCost], peaks: ChipPeaks,
                 scale: dict[Role, float] | None = None) -> dict[str, float]:
    """Seconds per step of each part (ROLLOUT, UPDATES, RESHARD): every program's roofline time per call times its
    calls, times `scale[role]` (1 for a role it does not name)."""
    totals = {ROLLOUT: 0.0, UPDATES: 0.0, RESHARD: 0.0}
    for p in programs:
        if p.part:
            totals[p.part] += roofline_seconds(p.cost, peaks).seconds * p.calls * (scale or {}).get(p.role, 1.0)
    return totals


def format_estimate(programs: Sequence[ProgramCost], peaks: ChipPeaks, generation: str,
                    decode_tokens_per_call: int) -> str:
    """The table of each program's estimated time per call and per step, the decode chunk's tokens/s (with every
    one of its `decode_tokens_per_call` = rows x steps sampling), and the step's rollout and update time and the
    rollout's share."""
    width = max(len(p.name) for p in programs)
    header = (f"{'program':<{width}}  {'GFLOP':>9} {'HBM GB':>8} {'ICI GB':>8} {'bound':>10} {'per call':>9} "
              f"{'calls':>7} {'per step':>9}")
    lines = [f"estimated time per chip (roofline from each program's HLO at {generation} peaks; an estimate, not a "
             "measurement)", header, "-" * len(header)]
    for p in programs:
        estimate = roofline_seconds(p.cost, peaks)
        per_step = estimate.seconds * p.calls
        lines.append(f"{p.name:<{width}}  {p.cost.flops / 1e9:9.1f} {p.cost.hbm_bytes / 1e9:8.2f} "
                     f"{p.cost.ici_bytes / 1e9:8.3f} {estimate.bound:>10} {estimate.seconds * 1e3:7.2f}ms "
                     f"{p.calls:7.1f} {per_step:8.2f}s")
    decode = next((p for p in programs if p.role is Role.DECODE_CHUNK and p.calls), None)
    if decode is not None:
        lines.append(f"decode: {decode_tokens_per_call / roofline_seconds(decode.cost, peaks).seconds:,.0f} "
                     "tokens/s per host with every row sampling")
    totals = part_seconds(programs, peaks)
    rollout = totals[ROLLOUT] + totals[RESHARD]
    step = rollout + totals[UPDATES]
    if any(p.part == RESHARD for p in programs):
        lines.append(f"weight reshard (the rollout's copy of the params, on the chips, once per step; in the "
                     f"rollout): {totals[RESHARD]:.2f} s")
    lines.append(f"worst-case step: rollout {rollout:.1f} s + updates {totals[UPDATES]:.1f} s = {step:.1f} s; "
                 f"rollout {rollout / step:.1%} of the step" if step else "worst-case step: no program runs")
    return "\n".join(lines)


def retrieval_calls(cfg, sequences: int, rows: int, searches: float) -> tuple[float, float]:
    """(calls per host and step that rows wait for, queries per such call) for one host's `sequences` trajectories
    of `searches` searches each in sessions of `rows` rows. A session sends the searches of the rows whose turn ended
    in a decode chunk as one call, while its other rows decode on; what holds the session is the last call of each
    of its `rollout.max_turns` search turns (sessions decode at the worst case: some row searches in every turn).
    Its size is bounded by every search of that turn: the step's searches over its calls."""
    calls = _sessions(cfg, sequences, rows) * cfg.rollout.max_turns
    return calls, sequences * searches / calls


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


def retrieval_seconds(cfg, calls: float, queries: float, generation: str, peaks: ChipPeaks,
                      device_search: ProgramCost | None = None) -> tuple[float, str]:
    """Seconds per host and step that rows wait for `calls` calls of `queries` queries with `cfg`'s retriever, and
    how, in words: the e5_device search program's roofline time per device call (`device_search`, compiled at
    `retriever.search_batch` queries or fewer); a faiss Flat (wiki-18's rows) or HNSW64 index by the measured cost
    of such a call on a host's vCPUs (`host_call_seconds`); (0, why) for a retriever without a measured cost."""
    ret = cfg.retriever
    backend = ret.get("backend")
    if backend == "e5_device" and device_search is not None:
        per_device_call = roofline_seconds(device_search.cost, peaks).seconds
        per_call = per_device_call * math.ceil(queries / ret.get("search_batch", 64))
        return calls * per_call, (f"{per_call * 1e3:.2f} ms per call (e5_device, {device_search.shapes}: "
                                  f"{per_device_call * 1e3:.2f} ms per device call, roofline from its HLO)")
    index = os.path.basename(str(ret.get("index_path", ""))) if backend == "faiss" else ""
    if "Flat" not in index and "HNSW" not in index:
        return 0.0, f"no measured cost per call for retriever {backend!r} (not counted)"
    vcpus = HOST_VCPUS.get(generation, MEASURED_VCPUS)
    hnsw = "HNSW" in index
    per_call = host_call_seconds(WIKI18_ROWS, queries, vcpus, hnsw)
    kind = ("e5 HNSW64 (efSearch 16), one query per thread" if hnsw else
            f"e5 Flat over {WIKI18_ROWS:,} rows, " + ("one query per thread scanning every row"
                                                      if queries < BLAS_MIN_QUERIES else "faiss's BLAS path"))
    return calls * per_call, f"{per_call:.3g} s per call ({kind}, on a host's {vcpus} vCPUs; measured on 1 thread)"


def expected(programs: Sequence[ProgramCost], peaks: ChipPeaks, generation: str, cfg, lengths: step_lengths.Lengths,
             sequences: int, rows: int) -> str:
    """The expected step at `lengths` (`llds_jax.step_lengths`) for one host's `sequences` in sessions of `rows`:
    each program's worst-case time per step scaled by its share (the decode chunk by `decode_share`, the forwards
    and updates by `update_share`, every other program as in the worst case), plus retrieval
    (`retrieval_seconds`), with the lengths' source."""
    decode = step_lengths.decode_share(cfg, lengths, sequences, rows)
    update = step_lengths.update_share(cfg, lengths)
    totals = part_seconds(programs, peaks, {Role.DECODE_CHUNK: decode, **dict.fromkeys(FORWARDS, update)})
    calls, queries = retrieval_calls(cfg, sequences, rows, lengths.searches)
    device_search = next((p for p in programs if p.role is Role.RETRIEVAL), None)
    retrieval, how = retrieval_seconds(cfg, calls, queries, generation, peaks, device_search)
    rollout = totals[ROLLOUT] + totals[RESHARD] + retrieval
    step = rollout + totals[UPDATES]
    return "\n".join([
        f"expected lengths from {lengths.source}: per trajectory {lengths.sampled_tokens:,.0f} sampled tokens, "
        f"{lengths.trajectory_tokens:,.0f} trained, {lengths.searches:.2f} searches; the decode at {decode:.1%} of the "
        f"worst case's calls, the forwards and updates at {update:.1%}, other programs as in the worst case",
        f"retrieval (in the rollout, what rows wait for): {sequences * lengths.searches:,.0f} searches per host and "
        f"step; {calls:,.0f} calls held a session (each session's last call of each search turn) of up to "
        f"{queries:,.0f} queries x {how} = {retrieval:.1f} s",
        f"expected step: rollout {rollout:.1f} s (of which retrieval {retrieval:.1f} s, weight reshard "
        f"{totals[RESHARD]:.2f} s) + updates {totals[UPDATES]:.1f} s = {step:.1f} s; rollout {rollout / step:.1%} of "
        "the step (an estimate, not a measurement)"])
