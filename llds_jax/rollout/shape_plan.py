"""The static shapes of the sampler's programs: which bucket each call of a session takes, which shapes have run,
and which shapes to compile ahead of time once the shapes are frozen.

Each program of `sampler` has its own shape type (a NamedTuple of sizes in rows or cache / token slots):
`PrefillShape`, `DecodeShape`, `EndTurnShape` (roll back and observation extend), `GrowShape` (a larger cache) and
`SelectShape` (compaction to fewer rows). Before `ShapePlan.freeze`, a call takes the buckets of what it needs
(`buckets`): rows the power of two of its sequences (a multiple of the mesh's batch shards), prompt, cache and
observation slots powers of two. After it, a call takes the smallest bucket already run that fits, if any, instead
of compiling a program for a new smaller one, and `ShapePlan.grid` lists what to compile ahead: every program at
every combination of the row, capacity and observation buckets run so far.
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
    """

    rows: int
    prompt: int
    capacity: int


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


Shape = Union[PrefillShape, DecodeShape, EndTurnShape, GrowShape, SelectShape]
_KINDS = (PrefillShape, DecodeShape, EndTurnShape, GrowShape, SelectShape)


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

    def prefill(self, sequences: int, longest_prompt: int, first_turn: int) -> PrefillShape:
        """The prefill of `sequences` prompts of at most `longest_prompt` tokens into a cache with room for a first
        turn of `first_turn` tokens (and the slot a finished row writes per decode step).

        Frozen: the smallest prompt bucket run at these rows that holds the longest prompt, then the smallest
        capacity run with that prompt bucket that holds the turn."""
        rows = self.batch_rows(sequences)
        prompt = (self._smallest_run(PrefillShape, "prompt", longest_prompt, rows=rows)
                  or buckets.pow2_bucket(longest_prompt, self.config.min_prompt_bucket))
        needed = prompt + first_turn + 1
        capacity = (self._smallest_run(PrefillShape, "capacity", needed, rows=rows, prompt=prompt)
                    or buckets.pow2_bucket(needed, self.config.min_capacity_bucket))
        return PrefillShape(rows, prompt, capacity)

    def compaction(self, rows: int, capacity: int, live: int) -> Optional[SelectShape]:
        """The move of `live` unfinished sequences out of a batch of `rows` rows into a smaller row bucket; None
        when the batch stays (compaction off, no sequence left, no smaller bucket holds them, or, frozen, no
        compaction to a smaller bucket that holds them has run from this shape)."""
        rows_out = self.batch_rows(live)
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
        observation = buckets.pow2_bucket(longest_observation, self.config.min_observation_bucket)
        if self.frozen:
            at = lambda t: EndTurnShape(rows, self.grown_capacity(rows, capacity, end + t), t)  # noqa: E731
            observation = min((s.observation for s in self._run[EndTurnShape] if s.rows == rows
                               and s.observation >= longest_observation and self.has_run(at(s.observation))),
                              default=observation)
        return EndTurnShape(rows, self.grown_capacity(rows, capacity, end + observation), observation)

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
        """The shapes not run yet on the grid of the row and capacity buckets of the decode states run so far: at
        every (rows, capacity), a decode chunk, an extend of each observation bucket run, growth to each larger
        capacity and compaction to each smaller row bucket. Ordered by rows, then capacity."""
        states = self._states()
        rows, capacities = sorted({r for r, _ in states}), sorted({c for _, c in states})
        observations = sorted({s.observation for s in self._run[EndTurnShape]})
        grid = []
        for r in rows:
            for c in capacities:
                grid += [DecodeShape(r, c), *(EndTurnShape(r, c, t) for t in observations),
                         *(GrowShape(r, c, g) for g in capacities if g > c),
                         *(SelectShape(r, c, k) for k in rows if k < r)]
        return [shape for shape in grid if not self.has_run(shape)]

    def compile_grid(self, lower: Callable[[Shape], jax.stages.Lowered]) -> int:
        """Compiles the program of each shape of `grid()`, lowered by `lower`, and records it. Returns how many."""
        shapes = self.grid()
        for shape in shapes:
            lower(shape).compile()
            self.record(shape)
        return len(shapes)

    def _states(self) -> set[tuple[int, int]]:
        """(rows, capacity) of the decode states run: made by a prefill or compaction, or taken by a decode chunk,
        an extend or a growth."""
        return ({(s.rows, s.capacity) for s in self._run[PrefillShape]}
                | {(s.rows, s.capacity) for kind in (DecodeShape, EndTurnShape, GrowShape) for s in self._run[kind]}
                | {(s.rows_out, s.capacity) for s in self._run[SelectShape]})
