"""The static shapes of the sampler's programs: which bucket each call of a session takes, which shapes have run,
and which shapes to compile ahead of time once the shapes are frozen.

Each program of `sampler` has its own shape type (a NamedTuple of sizes in rows or cache / token slots):
`PrefillShape`, `DecodeShape`, `EndTurnShape` (roll back and observation extend), `GrowShape` (a larger cache) and
`SelectShape` (compaction to fewer rows); continuous batching adds `EmptyShape` (an empty batch of rows) and
`ExtendRowsShape` (tokens appended to some rows of a batch); tree rollouts add `ForkShape` (a new batch of copies
of some rows, each rolled back to an agent-step boundary). Before `ShapePlan.freeze`, a call takes the buckets
of what it needs (`buckets`): rows the power of two of its sequences (a multiple of the mesh's batch shards;
continuous batching compacts to finer row buckets, powers of two and 1.5x them: `buckets.compact_bucket`),
prompt, cache and observation slots powers of two. After it, a call takes the smallest bucket already run that
fits, if any, instead of compiling a program for a new smaller one, and `ShapePlan.grid` lists what to compile
ahead: every program at every combination of the row, capacity and observation buckets run so far (continuous
batching: and of every row bucket between the smallest run and its batch, which it can compact to at any point).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Optional, Union

import jax

from llds_jax.rollout import buckets
from llds_jax.rollout.config import SamplingConfig


class PrefillShape(NamedTuple):
    """Prompts encoded into an empty cache.

    Attributes:
      rows: batch rows.
      prompt: token slots per row (prompts are left-padded).
      capacity: cache slots per row of the new cache.
      distinct: rows the forward runs at when it encodes each distinct prompt once (a row bucket below `rows`);
        0: every row is encoded.
    """

    rows: int
    prompt: int
    capacity: int
    distinct: int = 0


class DecodeShape(NamedTuple):
    """A decode chunk.

    Attributes:
      rows: batch rows.
      capacity: cache slots per row.
    """

    rows: int
    capacity: int


class EndTurnShape(NamedTuple):
    """The roll back of a turn and the extend of the observations after it.

    Attributes:
      rows: batch rows.
      capacity: cache slots per row.
      observation: token slots per row of the observations (right-padded).
    """

    rows: int
    capacity: int
    observation: int


class GrowShape(NamedTuple):
    """The cache moved into more slots.

    Attributes:
      rows: batch rows.
      capacity: cache slots per row before.
      capacity_out: cache slots per row after.
    """

    rows: int
    capacity: int
    capacity_out: int


class SelectShape(NamedTuple):
    """The unfinished rows moved into a smaller batch (compaction).

    Attributes:
      rows: batch rows before.
      capacity: cache slots per row.
      rows_out: batch rows after.
    """

    rows: int
    capacity: int
    rows_out: int


class EmptyShape(NamedTuple):
    """An empty batch of rows (continuous batching: sequences enter it with `ExtendRowsShape`).

    Attributes:
      rows: batch rows.
      capacity: cache slots per row.
    """

    rows: int
    capacity: int


class ExtendRowsShape(NamedTuple):
    """Some rows of a batch rolled back (or emptied) and extended by right-padded tokens; the other rows untouched.

    Attributes:
      rows: batch rows.
      capacity: cache slots per row.
      rows_in: rows taking part (a row bucket, padded).
      tokens: token slots per row taking part.
      prefill: the rows start new sequences (their tokens are prompts; attention over them alone).
    """

    rows: int
    capacity: int
    rows_in: int
    tokens: int
    prefill: bool


class ForkShape(NamedTuple):
    """Tree rollouts: a new batch whose rows are copies of some rows of a batch, each rolled back to an agent-step
    boundary and re-extended by one token (`kernels.fork_rows`).

    Attributes:
      rows: batch rows of the source.
      capacity: cache slots per row (source and new batch).
      rows_out: batch rows of the new batch.
    """

    rows: int
    capacity: int
    rows_out: int


Shape = Union[PrefillShape, DecodeShape, EndTurnShape, GrowShape, SelectShape, EmptyShape, ExtendRowsShape,
              ForkShape]
_KINDS = (PrefillShape, DecodeShape, EndTurnShape, GrowShape, SelectShape, EmptyShape, ExtendRowsShape, ForkShape)


class ShapePlan:
    """The buckets of one sampler: the shape of each program call of a session, the shapes run so far (or compiled
    ahead), and the grid of shapes to compile ahead once frozen.

    Args:
      config: the sampler's SamplingConfig (its smallest buckets and `compact`).
      batch_multiple: batch shards of the mesh (data x fsdp); every row bucket is a multiple of it.
    """

    def __init__(self, config: SamplingConfig, batch_multiple: int):
        self.config = config
        self.batch_multiple = batch_multiple
        self.frozen = False
        self._run: dict[type, set[Shape]] = {kind: set() for kind in _KINDS}

    def freeze(self) -> None:
        """From now on a call takes the smallest bucket already run that fits, where there is one."""
        self.frozen = True

    def record(self, shape: Shape) -> None:
        """Notes that `shape`'s program has run (or is compiled)."""
        self._run[type(shape)].add(shape)

    def has_run(self, shape: Shape) -> bool:
        return shape in self._run[type(shape)]

    # -- the shape of a call ---------------------------------------------------------------------------------------

    def batch_rows(self, sequences: int) -> int:
        """Rows of a batch of `sequences` sequences."""
        return buckets.batch_bucket(sequences, self.batch_multiple, self.config.min_batch_bucket)

    def compacted_rows(self, live: int) -> int:
        """Rows of a continuous batch compacted to `live` sequences: a power of two or 1.5x one (a multiple of the
        mesh's batch shards, `buckets.compact_bucket`), so that they fill more than 2/3 of it."""
        return buckets.compact_bucket(live, self.batch_multiple, self.config.min_batch_bucket)

    def prefill(self, sequences: int, longest_prompt: int, first_turn: int, distinct: int = 0) -> PrefillShape:
        """The prefill of `sequences` prompts of at most `longest_prompt` tokens into a cache with room for a first
        turn of `first_turn` tokens (and the slot a finished row writes per decode step); with `distinct` (> 0)
        distinct prompts among them, encoded once each at their row bucket when that is below the batch's.

        Frozen: the smallest prompt bucket run at these rows that holds the longest prompt, then the smallest
        capacity run with that prompt bucket that holds the turn, then the smallest distinct-prompt bucket run
        there that holds them (or, where none has, the prefill of every row, if that has run)."""
        rows = self.batch_rows(sequences)
        prompt = (self._smallest_run(PrefillShape, "prompt", longest_prompt, rows=rows)
                  or buckets.pow2_bucket(longest_prompt, self.config.min_prompt_bucket))
        needed = prompt + first_turn + 1
        capacity = (self._smallest_run(PrefillShape, "capacity", needed, rows=rows, prompt=prompt)
                    or buckets.pow2_bucket(needed, self.config.min_capacity_bucket))
        if distinct:
            run = self._smallest_run(PrefillShape, "distinct", distinct, below=rows, rows=rows, prompt=prompt,
                                     capacity=capacity)
            plain_run = self.frozen and self.has_run(PrefillShape(rows, prompt, capacity))
            distinct = run or (rows if plain_run else self.batch_rows(distinct))  # frozen: compile nothing new
        return PrefillShape(rows, prompt, capacity, distinct if distinct < rows else 0)

    def largest(self, sequences: int, longest_prompt: int, first_turn: int, context: int, longest_observation: int,
                distinct: int = 0) -> tuple[PrefillShape, EndTurnShape]:
        """The largest buckets a session of `sequences` sequences can reach (not frozen): its prefill (`prefill`)
        and an extend of the longest observation when a row has used all of its `context` tokens after the
        prompt bucket, whose capacity is the largest the cache can grow to (an upper bound: a row takes at most
        `context` tokens after its prompt slots, then one observation bucket for an extend's padding and the slot
        a finished row writes per decode step)."""
        prefill = self.prefill(sequences, longest_prompt, first_turn, distinct)
        return prefill, self.end_turn(prefill.rows, prefill.capacity, longest_observation, prefill.prompt + context)

    def compaction(self, rows: int, capacity: int, live: int, continuous: bool = False) -> Optional[SelectShape]:
        """The move of `live` unfinished sequences out of a batch of `rows` rows into a smaller row bucket
        (`batch_rows`; with `continuous`, a continuous batch's: `compacted_rows`); None when the batch stays
        (compaction off, no sequence left, no smaller bucket holds them, or, frozen, no compaction to a smaller
        bucket that holds them has run from this shape)."""
        rows_out = self.compacted_rows(live) if continuous else self.batch_rows(live)
        if not self.config.compact or rows_out >= rows or live == 0:
            return None
        if self.frozen:
            rows_out = self._smallest_run(SelectShape, "rows_out", rows_out, below=rows, rows=rows, capacity=capacity)
            if rows_out is None:
                return None
        return SelectShape(rows, capacity, rows_out)

    def grown_capacity(self, rows: int, capacity: int, needed: int) -> int:
        """Cache slots per row for `needed` slots in a batch of `rows` rows with `capacity` slots: `capacity` when
        they fit, else a larger bucket (frozen: the smallest growth run from this shape that holds them)."""
        if needed <= capacity:
            return capacity
        return (self._smallest_run(GrowShape, "capacity_out", needed, rows=rows, capacity=capacity)
                or buckets.pow2_bucket(needed, self.config.min_capacity_bucket))

    def end_turn(self, rows: int, capacity: int, longest_observation: int, end: int) -> EndTurnShape:
        """The extend of observations of at most `longest_observation` tokens in a batch of `rows` rows with
        `capacity` slots, where the furthest row taking one writes from slot `end`; its capacity is the one the
        cache grows to (`grown_capacity`) for the observation bucket.

        Frozen: the smallest observation bucket run at these rows that holds the observations and whose extend
        has run at the capacity it leads to."""
        at = lambda t: EndTurnShape(rows, self.grown_capacity(rows, capacity, end + t), t)  # noqa: E731
        return at(self._token_bucket(EndTurnShape, "observation", longest_observation, at, rows=rows))

    def empty(self, sequences: int, first_turn: int) -> EmptyShape:
        """The empty batch of continuous batching for `sequences` rows at a time, with room for prompts and a first
        turn of `first_turn` slots (frozen: the smallest capacity run at these rows that holds them)."""
        rows = self.batch_rows(sequences)
        capacity = (self._smallest_run(EmptyShape, "capacity", first_turn, rows=rows)
                    or buckets.pow2_bucket(first_turn, self.config.min_capacity_bucket))
        return EmptyShape(rows, capacity)

    def extend_rows(self, rows: int, capacity: int, rows_in: int, longest: int, end: int, prefill: bool
                    ) -> ExtendRowsShape:
        """The extend of `rows_in` rows of a batch of `rows` rows with `capacity` slots by at most `longest` tokens
        (prompts with `prefill`), where the furthest of them writes from slot `end`; its capacity is the one the
        cache grows to for the token bucket. The rows taking part are padded to their `batch_rows` bucket, at most
        `rows` (a batch compacted to a 1.5x bucket); frozen: to the smallest such bucket run from these rows that
        holds them, then the token bucket is the smallest run whose extend has run there."""
        rows_in = (self._smallest_run(ExtendRowsShape, "rows_in", rows_in, rows=rows, prefill=prefill)
                   or min(self.batch_rows(rows_in), rows))
        at = lambda t: ExtendRowsShape(  # noqa: E731
            rows, self.grown_capacity(rows, capacity, end + t), rows_in, t, prefill)
        return at(self._token_bucket(ExtendRowsShape, "tokens", longest, at, rows=rows, rows_in=rows_in,
                                     prefill=prefill))

    def extend_rows_limit(self, rows: int, prefill: bool) -> Optional[int]:
        """The most rows one extend of a batch of `rows` rows takes (more run as several extends): at most
        `config.max_extend_rows` (when set), and frozen, the largest row bucket of the extends of its kind run
        there (compiling nothing); None: any."""
        limits = [self.config.max_extend_rows]  # 0: none
        if self.frozen:
            run = (s.rows_in for s in self._run[ExtendRowsShape] if s.rows == rows and s.prefill == prefill)
            limits.append(max(run, default=0))
        return min((n for n in limits if n), default=None)

    def _token_bucket(self, kind: type, field: str, longest: int, at: Callable[[int], Shape], **fixed: int) -> int:
        """The token slots of an extend of at most `longest` tokens: a power of two (>= min_observation_bucket),
        or, frozen, the smallest `field` of the `kind` shapes run with `fixed` fields that holds them and whose
        shape `at(slots)` has run."""
        slots = buckets.pow2_bucket(longest, self.config.min_observation_bucket)
        if not self.frozen:
            return slots
        return min((getattr(s, field) for s in self._run[kind]
                    if all(getattr(s, name) == value for name, value in fixed.items())
                    and getattr(s, field) >= longest and self.has_run(at(getattr(s, field)))), default=slots)

    def _smallest_run(self, kind: type, field: str, at_least: int, below: Optional[int] = None, **fixed: int
                      ) -> Optional[int]:
        """When frozen: the smallest `field` in [at_least, below) of the `kind` shapes run whose other fields are
        as `fixed` says (None when not frozen or none fits)."""
        if not self.frozen:
            return None
        return min((getattr(s, field) for s in self._run[kind]
                    if all(getattr(s, name) == value for name, value in fixed.items())
                    and at_least <= getattr(s, field) and (below is None or getattr(s, field) < below)),
                   default=None)

    # -- ahead of time ---------------------------------------------------------------------------------------------

    def grid(self) -> list[Shape]:
        """The shapes not run yet on the grid of the row and capacity buckets of the decode states run so far (with
        continuous batching, every compacted row bucket between the smallest run and its batch: `_continuous_rows`):
        at every (rows, capacity), a decode chunk, an extend of each observation bucket run (continuous batching:
        row extends of each row and token bucket run of their kind, of at most `rows` rows), growth to each larger
        capacity, compaction to each smaller row bucket and (tree rollouts) each fork run from these rows: the
        capacity a fork copies is wherever its source session ended, which changes from step to step. Ordered by
        rows, then capacity."""
        states = self._states()
        rows = sorted({r for r, _ in states} | self._continuous_rows({r for r, _ in states}))
        capacities = sorted({c for _, c in states})
        observations = sorted({s.observation for s in self._run[EndTurnShape]})
        row_extends = {(s.rows_in, s.prefill) for s in self._run[ExtendRowsShape]}  # with each token bucket of its kind
        tokens = {prefill: sorted({s.tokens for s in self._run[ExtendRowsShape] if s.prefill == prefill})
                  for prefill in (False, True)}
        forks = sorted({(s.rows, s.rows_out) for s in self._run[ForkShape]})
        grid = []
        for r in rows:
            for c in capacities:
                grid += [DecodeShape(r, c), *(EndTurnShape(r, c, t) for t in observations),
                         *(ExtendRowsShape(r, c, k, t, p) for k, p in sorted(row_extends) for t in tokens[p] if k <= r),
                         *(GrowShape(r, c, g) for g in capacities if g > c),
                         *(SelectShape(r, c, k) for k in rows if k < r),
                         *(ForkShape(r, c, k) for source, k in forks if source == r)]
        return [shape for shape in grid if not self.has_run(shape)]

    def compile_grid(self, lower: Callable[[Shape], jax.stages.Lowered]) -> int:
        """Compiles the program of each shape of `grid()`, lowered by `lower`, and records it. Returns how many."""
        shapes = self.grid()
        for shape in shapes:
            lower(shape).compile()
            self.record(shape)
        return len(shapes)

    def _continuous_rows(self, rows_run: set[int]) -> set[int]:
        """The compacted row buckets (`compacted_rows`: powers of two and 1.5x them) from the smallest of `rows_run`
        up to the largest empty batch run (none without one).

        A continuous batch compacts to the bucket of its live rows whenever they fit a smaller one, and how many
        are live when depends on the sampled turns: a first rollout whose batch went from 64 rows straight to 16
        would otherwise leave a frozen plan without the 24-, 32- and 48-row buckets a later one needs. (The
        sessions' grid keeps the row buckets they ran.)"""
        batches = [s.rows for s in self._run[EmptyShape]]
        if not batches:
            return set()
        out, rows = set(), self.compacted_rows(1)
        while rows <= max(batches):
            if rows >= min(rows_run):
                out.add(rows)
            rows = self.compacted_rows(rows + 1)
        return out

    def _states(self) -> set[tuple[int, int]]:
        """(rows, capacity) of the decode states run: made by a prefill, an empty batch, compaction or a fork, or taken
        by a decode chunk, an extend, a growth or a fork."""
        kinds = (PrefillShape, EmptyShape, DecodeShape, EndTurnShape, ExtendRowsShape, GrowShape, ForkShape)
        return ({(s.rows, s.capacity) for kind in kinds for s in self._run[kind]}
                | {(s.rows_out, s.capacity) for kind in (SelectShape, ForkShape) for s in self._run[kind]})
