"""The shape plan: which bucket each sampler call takes before and after freezing, and the grid compiled ahead."""
from llds_jax.rollout.config import SamplingConfig
from llds_jax.rollout.shape_plan import (DecodeShape, EmptyShape, EndTurnShape, ExtendRowsShape, ForkShape,
                                         GrowShape, PrefillShape, SelectShape, ShapePlan)

CONFIG = SamplingConfig(min_prompt_bucket=16, min_capacity_bucket=16, min_observation_bucket=4)


def test_buckets_before_freezing_are_those_of_what_is_needed():
    plan = ShapePlan(CONFIG, batch_multiple=1)
    assert plan.prefill(3, longest_prompt=20, first_turn=10) == PrefillShape(4, 32, 64)  # 32 + 10 + 1 slots
    assert plan.compaction(4, 64, live=1) == SelectShape(4, 64, 1)
    assert plan.compaction(4, 64, live=3) is None  # 3 sequences need the 4 rows
    assert plan.compaction(4, 64, live=0) is None
    assert plan.grown_capacity(4, 64, needed=64) == 64
    assert plan.grown_capacity(4, 64, needed=65) == 128
    assert plan.end_turn(4, 64, longest_observation=5, end=60) == EndTurnShape(4, 128, 8)  # 60 + 8 slots
    assert ShapePlan(CONFIG, batch_multiple=4).prefill(5, 3, 1) == PrefillShape(8, 16, 32)
    assert ShapePlan(SamplingConfig(compact=False), batch_multiple=1).compaction(4, 64, live=1) is None


def test_frozen_plan_takes_the_smallest_bucket_run_that_fits():
    plan = ShapePlan(CONFIG, batch_multiple=1)
    for shape in (PrefillShape(4, 32, 64), PrefillShape(4, 32, 128), GrowShape(4, 64, 256), SelectShape(4, 64, 2),
                  EndTurnShape(4, 64, 16), EndTurnShape(4, 256, 8)):
        plan.record(shape)
    assert plan.prefill(3, longest_prompt=5, first_turn=10) == PrefillShape(4, 16, 32)  # not frozen yet
    assert plan.end_turn(4, 64, longest_observation=3, end=40) == EndTurnShape(4, 64, 4)
    plan.freeze()
    # Prompt bucket 32 (run), then the smallest capacity run with it that holds 32 + 10 + 1 (or 32 + 40 + 1) slots.
    assert plan.prefill(3, longest_prompt=5, first_turn=10) == PrefillShape(4, 32, 64)
    assert plan.prefill(3, longest_prompt=5, first_turn=40) == PrefillShape(4, 32, 128)
    assert plan.prefill(3, longest_prompt=5, first_turn=200) == PrefillShape(4, 32, 256)  # none run holds 233
    assert plan.prefill(3, longest_prompt=40, first_turn=10) == PrefillShape(4, 64, 128)  # no prompt bucket >= 40
    assert plan.prefill(2, longest_prompt=5, first_turn=10) == PrefillShape(2, 16, 32)  # nothing run at 2 rows
    assert plan.compaction(4, 64, live=1) == SelectShape(4, 64, 2)
    assert plan.compaction(4, 128, live=1) is None  # no compaction run from 128 slots
    assert plan.grown_capacity(4, 64, needed=65) == 256
    assert plan.grown_capacity(4, 64, needed=300) == 512
    assert plan.grown_capacity(4, 32, needed=65) == 128
    # At slot 40, observation bucket 8 would run at 64 slots (not run), 16 does; at slot 60, 8 grows the cache to
    # 256 slots (run) and 16 would too (not run at 256).
    assert plan.end_turn(4, 64, longest_observation=3, end=40) == EndTurnShape(4, 64, 16)
    assert plan.end_turn(4, 64, longest_observation=3, end=60) == EndTurnShape(4, 256, 8)
    # No observation bucket run holds 20 tokens: bucket 32, and the cache grows to the 256 slots run.
    assert plan.end_turn(4, 64, longest_observation=20, end=40) == EndTurnShape(4, 256, 32)


class Lowered:
    def compile(self):
        return None


def test_grid_lists_the_programs_not_run_on_the_buckets_run_and_compile_grid_records_them():
    """The shapes of the conversation of test_sampler's grid test: 4 rows at capacities 32 and 64, 2 at 64."""
    plan = ShapePlan(CONFIG, batch_multiple=1)
    for shape in (PrefillShape(4, 16, 32), DecodeShape(4, 32), EndTurnShape(4, 32, 8), GrowShape(4, 32, 64),
                  DecodeShape(4, 64), EndTurnShape(4, 64, 8), SelectShape(4, 64, 2), DecodeShape(2, 64),
                  EndTurnShape(2, 64, 8)):
        plan.record(shape)
    expected = [DecodeShape(2, 32), EndTurnShape(2, 32, 8), GrowShape(2, 32, 64), SelectShape(4, 32, 2)]
    assert plan.grid() == expected
    assert not plan.has_run(SelectShape(4, 32, 64))  # equal fields, another program than GrowShape(4, 32, 64)
    lowered = []
    assert plan.compile_grid(lambda shape: lowered.append(shape) or Lowered()) == 4
    assert lowered == expected
    assert all(plan.has_run(shape) for shape in expected) and plan.grid() == []


def test_grid_holds_each_fork_run_at_every_capacity_its_source_rows_reach():
    """A tree rollout's first step: 4 chains end at 64 slots and fork into 8 rows; a later step's chains may end at
    32 (or 64) slots, so the fork from 4 rows is compiled at both; none from the 8-row batch, which never forked."""
    plan = ShapePlan(CONFIG, batch_multiple=1)
    for shape in (PrefillShape(4, 16, 32), DecodeShape(4, 32), GrowShape(4, 32, 64), DecodeShape(4, 64),
                  ForkShape(4, 64, 8), DecodeShape(8, 64)):
        plan.record(shape)
    forks = [shape for shape in plan.grid() if isinstance(shape, ForkShape)]
    assert forks == [ForkShape(4, 32, 8)]
    plan.compile_grid(lambda shape: Lowered())
    assert plan.grid() == []


def test_continuous_batching_grid_holds_every_row_bucket_below_its_batch():
    """A first continuous rollout whose 8-row batch compacted straight to 2 rows: the frozen plan can still compact
    3 live rows to 3 and 4 to 4 (every compacted row bucket from the smallest run up to the batch is compiled
    ahead); a session's plan keeps the row buckets it ran."""
    run = (DecodeShape(8, 32), SelectShape(8, 32, 2), DecodeShape(2, 32))
    plan = ShapePlan(CONFIG, batch_multiple=1)
    for shape in (EmptyShape(8, 32), ExtendRowsShape(8, 32, 8, 16, True), ExtendRowsShape(8, 32, 2, 16, False), *run):
        plan.record(shape)
    assert {DecodeShape(4, 32), SelectShape(8, 32, 4), SelectShape(4, 32, 2),
            ExtendRowsShape(4, 32, 2, 16, False)} <= set(plan.grid())
    assert not any(shape.rows == 1 for shape in plan.grid())  # not below the smallest bucket run
    plan.compile_grid(lambda shape: Lowered())
    plan.freeze()
    assert plan.compaction(8, 32, live=3, continuous=True) == SelectShape(8, 32, 3)
    assert plan.compaction(8, 32, live=4, continuous=True) == SelectShape(8, 32, 4)
    assert plan.compaction(8, 32, live=2, continuous=True) == SelectShape(8, 32, 2)
    sessions = ShapePlan(CONFIG, batch_multiple=1)
    for shape in (PrefillShape(8, 16, 32), *run):
        sessions.record(shape)
    assert all(shape.rows in (2, 8) for shape in sessions.grid())
    sessions.compile_grid(lambda shape: Lowered())
    sessions.freeze()
    assert sessions.compaction(8, 32, live=3) is None
    # With batch shards, the buckets between are multiples of them: 4 -> 8 -> 12 -> 16 rows (6 rounds up to 8).
    sharded = ShapePlan(CONFIG, batch_multiple=4)
    for shape in (EmptyShape(16, 32), SelectShape(16, 32, 4)):
        sharded.record(shape)
    assert {shape.rows for shape in sharded.grid()} == {4, 8, 12, 16}


def test_continuous_batching_compacts_to_powers_of_two_and_the_1_5x_buckets_between():
    """The demo's third rollout: 47 live rows of 64 compact to 48 rows (today's buckets keep them in 64), as the
    frozen plan of a first rollout that went 64 -> 32 -> 16 rows allows: its grid holds 24 and 48 rows. A
    session's plan of the same run keeps powers of two: its buckets, grid and compactions are as before."""
    plan = ShapePlan(CONFIG, batch_multiple=1)
    assert [plan.compacted_rows(n) for n in (1, 2, 3, 4, 5, 7, 9, 13, 17, 25, 33, 47, 49)] == [
        1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 48, 64]
    assert plan.compaction(64, 128, live=47, continuous=True) == SelectShape(64, 128, 48)
    assert plan.compaction(64, 128, live=47) is None
    assert plan.compaction(64, 128, live=17, continuous=True) == SelectShape(64, 128, 24)
    assert plan.compaction(48, 128, live=33, continuous=True) is None  # 33 live rows need the 48
    # Multiples of the batch shards and at least min_batch_bucket.
    assert [ShapePlan(CONFIG, batch_multiple=4).compacted_rows(n) for n in (1, 5, 7, 9, 13, 17, 33)] == [
        4, 8, 8, 12, 16, 24, 48]
    assert [ShapePlan(CONFIG, batch_multiple=8).compacted_rows(n) for n in (9, 17, 33)] == [16, 24, 48]
    at_least_8 = ShapePlan(SamplingConfig(min_batch_bucket=8), batch_multiple=1)
    assert [at_least_8.compacted_rows(n) for n in (1, 8, 9)] == [8, 8, 12]
    # A row extend of a batch compacted to 48 rows takes at most its 48 rows (the power of two of 40 is 64).
    assert plan.extend_rows(48, 128, rows_in=40, longest=3, end=60, prefill=False) == ExtendRowsShape(
        48, 128, 48, 4, False)
    assert plan.extend_rows(64, 128, rows_in=40, longest=3, end=60, prefill=False).rows_in == 64

    run = (DecodeShape(64, 128), SelectShape(64, 128, 32), DecodeShape(32, 128), SelectShape(32, 128, 16),
           DecodeShape(16, 128))
    for shape in (EmptyShape(64, 128), ExtendRowsShape(64, 128, 64, 16, True), *run):
        plan.record(shape)
    grid = plan.grid()
    assert {shape.rows for shape in grid if isinstance(shape, DecodeShape)} == {24, 48}  # 16, 32 and 64 ran
    assert {shape.rows_out for shape in grid if isinstance(shape, SelectShape)} == {16, 24, 32, 48}
    plan.compile_grid(lambda shape: Lowered())
    plan.freeze()
    assert plan.compaction(64, 128, live=47, continuous=True) == SelectShape(64, 128, 48)
    assert plan.compaction(48, 128, live=20, continuous=True) == SelectShape(48, 128, 24)
    assert plan.compaction(64, 128, live=5, continuous=True) == SelectShape(64, 128, 16)  # nothing below 16 ran
    sessions = ShapePlan(CONFIG, batch_multiple=1)
    for shape in (PrefillShape(64, 16, 128), *run):
        sessions.record(shape)
    assert sessions.grid() == [SelectShape(64, 128, 16)]
    sessions.compile_grid(lambda shape: Lowered())
    sessions.freeze()
    assert sessions.compaction(64, 128, live=47) is None
    assert sessions.compaction(64, 128, live=20) == SelectShape(64, 128, 32)


def test_a_shared_prefill_takes_the_row_bucket_of_the_distinct_prompts_and_frozen_compiles_nothing_new():
    plan = ShapePlan(CONFIG, batch_multiple=1)
    assert plan.prefill(16, 20, 10, distinct=5) == PrefillShape(16, 32, 64, 8)  # 5 distinct prompts: 8 rows
    assert plan.prefill(7, 20, 10, distinct=5) == PrefillShape(8, 32, 64, 0)  # 8 rows either way: every row
    plan.record(PrefillShape(16, 32, 64, 8))
    plan.record(PrefillShape(8, 32, 64))
    plan.freeze()
    assert plan.prefill(16, 20, 10, distinct=3) == PrefillShape(16, 32, 64, 8)  # the smallest run that holds 3
    assert plan.prefill(16, 20, 10, distinct=9) == PrefillShape(16, 32, 64, 0)  # none run holds 9: 16 rows
    assert plan.prefill(8, 20, 10, distinct=2) == PrefillShape(8, 32, 64, 0)  # the plain prefill has run here
    assert plan.prefill(4, 20, 10, distinct=2) == PrefillShape(4, 32, 64, 2)  # nothing has run at 4 rows
