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
from collections.abc import Sequence

from llds_jax.programs import Role
from llds_jax.roofline import ChipPeaks, HloCost, roofline_seconds

ROLLOUT, UPDATES, RESHARD = "rollout", "updates", "weight reshard"  # RESHARD: counted in the rollout, shown apart


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
    totals = {ROLLOUT: 0.0, UPDATES: 0.0, RESHARD: 0.0}
    for p in programs:
        estimate = roofline_seconds(p.cost, peaks)
        per_step = estimate.seconds * p.calls
        if p.part:
            totals[p.part] += per_step
        lines.append(f"{p.name:<{width}}  {p.cost.flops / 1e9:9.1f} {p.cost.hbm_bytes / 1e9:8.2f} "
                     f"{p.cost.ici_bytes / 1e9:8.3f} {estimate.bound:>10} {estimate.seconds * 1e3:7.2f}ms "
                     f"{p.calls:7.1f} {per_step:8.2f}s")
    decode = next((p for p in programs if p.role is Role.DECODE_CHUNK and p.calls), None)
    if decode is not None:
        lines.append(f"decode: {decode_tokens_per_call / roofline_seconds(decode.cost, peaks).seconds:,.0f} "
                     "tokens/s per host with every row sampling")
    rollout = totals[ROLLOUT] + totals[RESHARD]
    step = rollout + totals[UPDATES]
    if any(p.part == RESHARD for p in programs):
        lines.append(f"weight reshard (the rollout's copy of the params, on the chips, once per step; in the "
                     f"rollout): {totals[RESHARD]:.2f} s")
    lines.append(f"estimated step: rollout {rollout:.1f} s + updates {totals[UPDATES]:.1f} s = {step:.1f} s; "
                 f"rollout {rollout / step:.1%} of the step" if step else "estimated step: no program runs")
    return "\n".join(lines)
