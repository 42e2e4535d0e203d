"""`python -m llds_jax.aot.slots` (issue 67, build 3): the pool that fits beside the largest program, and each slot
count's expected rollout through the real engine's admission at that pool, kernel-faithful."""
import pytest

from llds_jax.aot import compile_check, rollout_schedule, slots, step_lengths, tiles
from llds_jax.train import run_builder
from tests.aot.test_compile_check import PAGED, flagship, paged_model_dir  # noqa: F401 (a fixture)

MIB, GIB = 1 << 20, 1 << 30


def test_the_pool_gets_what_the_largest_program_leaves_down_to_the_headroom():
    assert slots.pages_that_fit(10 * GIB, 5 * GIB, MIB) == 4096  # 90% of 10 GiB less 5 GiB, in pages of 1 MiB
    assert slots.pages_that_fit(10 * GIB, 5 * GIB, MIB, headroom=0.2) == 3072
    assert slots.pages_that_fit(10 * GIB, 5 * GIB + 1, MIB) == 4095  # a byte over: a page fewer
    assert slots.pages_that_fit(10 * GIB, 10 * GIB, MIB) == 0


def test_a_page_is_what_the_compiled_pool_holds_per_page(paged_model_dir):  # noqa: F811
    """The shrunk flagship on v4:2x2x4: its rollout split over a host's 4 chips repeats its 2 key/value heads to 4,
    one per chip: 2 layers x 16 slots x (a key and a value) x 128 lanes x 2 bytes (bfloat16) = 16 KiB per page and
    chip, as the pool of the run's samplers (what `--mode=compile` counts as the pool) holds."""
    run = flagship(paged_model_dir, **PAGED)
    assert slots.page_bytes(run) == 2 * 16 * 2 * 128 * 2
    devices, _ = compile_check.topology_devices(run.mesh.topology)
    layout = run_builder.run_layout(run, devices)
    parts = run_builder.build(run, layout, run_builder.abstract_model(layout), compile_check.PLACEHOLDER_STOP_IDS)
    # As --mode=compile sizes it in one process: 16 slots (rollout.max_batch_size) of 256 tokens in pages of 16.
    assert slots.pool_of(run) == parts.sampler.engine_config.num_pages == 16 * 16 + 1
    assert parts.sampler.runner.pool.bytes_per_device() == slots.pool_of(run) * slots.page_bytes(run)


def test_each_slot_count_runs_the_engine_at_the_pool_that_fits(paged_model_dir):  # noqa: F811
    """8 trajectories per host: slot counts above them are left out; the pool is the one that fits, or every slot's
    worst case where that is less; a pool of one sequence holds fewer rows at once than the slots; each option's
    tiles are `tiles.choose`'s for the engine's schedule at its slots, pool and budget, its seconds the
    kernel-faithful estimate of that schedule at them, the reshard's added; its programs training's and
    evaluation's buckets."""
    run = flagship(paged_model_dir, **PAGED)
    roomy = slots.sweep(run, [4, 8, 16], [64, 128], 10_000, reshard_s=0.5)
    assert [(o.slots, o.pages, o.max_step_tokens) for o in roomy] == [
        (4, 4 * 16 + 1, 64), (4, 65, 128), (8, 8 * 16 + 1, 64), (8, 129, 128)]
    assert [o.rows_in_flight for o in roomy] == [4, 4, 8, 8]
    # Training's slots and evaluation's (min(8, slots)), each doubling up to the budget.
    assert [o.programs for o in roomy] == [5 + 5, 6 + 6, 4 + 4, 5 + 5]
    tight = slots.sweep(run, [8], [64], 17)[0]
    assert tight.pages == 17 and tight.rows_in_flight < 8
    for option in roomy + [tight]:
        sized = slots.with_slots(run, option.slots, option.pages, option.max_step_tokens)
        rollout = tiles.rollout_of(sized)
        schedule = rollout_schedule.for_run(sized, step_lengths.defaults(sized), rollout.sequences)
        assert option.calls == len(schedule.calls)
        assert option.tiles == tiles.choose(rollout, schedule, option.max_step_tokens).tiles
        assert option.device_s == pytest.approx(tiles.device_seconds(rollout, schedule, option.tiles))
    assert [o.rollout_s for o in roomy] == pytest.approx([o.device_s + 0.5 for o in roomy])
    assert slots.best(roomy + [tight]) == min(roomy + [tight], key=lambda o: o.rollout_s)
    assert slots.sweep(run, [8], [64, 128], 10_000, reshard_s=0.5) == roomy[2:]  # a sweep's options are its own
    lines = slots.format_options("flagship", roomy, 10.0, 10_000, 16 * 1024, 30 * GIB, 20 * GIB).splitlines()
    assert lines[0].startswith("flagship: the pool beside the largest program less its pool (20.00 GiB per chip) "
                               "within 90% of 30.00 GiB usable: 10,000 pages of 0.016 MiB per chip")
    assert lines[1].startswith("  slots    4, pages     65 ( 0.00 GiB), steps of    64 (10 rollout programs), tiles ")
    chosen = slots.best(roomy)
    assert lines[-1].startswith(f"  least: rollout.max_batch_size {chosen.slots}, rollout.num_pages {chosen.pages}, "
                                f"rollout.max_step_tokens {chosen.max_step_tokens}, tiles ")


@pytest.mark.slow
def test_the_chosen_options_step_programs_compile_with_the_pool_as_compile_mode_counts_it(paged_model_dir):  # noqa: F811
    """`compile_rollout` compiles, for v4:2x2x1 (one host's 4 chips), the programs the resident arrays are read from and every rollout
    step program, each row's total with its resident arrays as `--mode=compile` adds them: a larger pool (1,000
    pages instead of 8 x 16 + 1) adds its bytes (16 KiB a page per chip) to each step program's arguments and to
    the others' resident arrays; the temporaries stay within 1 MiB."""
    run = flagship(paged_model_dir, **PAGED, **{"mesh.topology": "v4:2x2x1"})
    (small, hbm), (large, _) = (slots.compile_rollout(slots.with_slots(run, 8, pages)) for pages in (8 * 16 + 1, 1000))
    assert hbm > 30 * GIB
    steps = [r.name for r in small if "rollout step" in r.name]
    assert steps == [f"rollout step ({t} tokens)" for t in (8, 16, 32, 64)] + [
        f"eval rollout step ({t} tokens)" for t in (8, 16, 32, 64)]
    assert [r.name for r in small][:2] == ["optimizer init", "reference copy"]
    grown = (1000 - 129) * slots.page_bytes(run)
    for a, b in zip(small, large):
        step = "rollout step" in a.name
        assert b.arguments - a.arguments == (grown if step else 0), a.name
        assert b.resident - a.resident == (0 if step else grown), a.name
        assert abs(b.temporaries - a.temporaries) <= 1 << 20, a.name  # XLA's buffers move, within 1 MiB
