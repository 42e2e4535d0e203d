"""The rollout's attention tiles (issue 67, build 2): the tiles the config names reach the kernel, each tensor-parallel
group of a rollout split over data decodes its own rows (read in the step program compiled for v4 and its HLO), and
`python -m llds_jax.aot.tiles` picks the tiles and budget the kernel-faithful estimate costs least."""
import jax
import pytest
from flax import nnx
from jax.extend import core as jcore

from llds_jax import parallel
from llds_jax.aot import compile_check, hlo_text, tiles
from llds_jax.model import ModelConfig, Transformer
from llds_jax.rollout.config import KernelTiles, SamplingConfig
from llds_jax.rollout.engine import EngineConfig
from llds_jax.rollout.runner import DeviceRunner
from tests.aot.test_compile_check import PAGED, flagship, paged_model_dir  # noqa: F401 (a fixture)

# Two tensor-parallel pairs (data 2, tensor 2) on v4:2x2x1; 4 query heads and 2 key/value heads of 128 lanes (the
# kernel's), D 256, F 384 (192 per chip); 8 sequence slots, the 32-token bucket, pages of 16 slots, 16 per sequence.
SLOTS, BUCKET, F = 8, 32, 384


@pytest.fixture(autouse=True)
def _tpu_programs_out_of_the_persistent_cache():
    with compile_check.no_persistent_cache_writes():
        yield


def pallas_calls(jaxpr: jcore.Jaxpr) -> list[jcore.JaxprEqn]:
    """Every pallas_call of `jaxpr` and the jaxprs inside it (scans, loops, shard_maps), in order."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            found.append(eqn)
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, (jcore.Jaxpr, jcore.ClosedJaxpr)):
                    found += pallas_calls(getattr(sub, "jaxpr", sub))
    return found


def tile_of(eqn: jcore.JaxprEqn) -> tuple[int, int]:
    """(kv pages, queries) per block of a ragged paged attention pallas_call: its kv double buffer's pages and its
    q block's tokens."""
    q_block = eqn.params["grid_mapping"].block_mappings[0].block_shape[0]
    kv_buffers = next(v.aval for v in eqn.params["jaxpr"].invars if len(v.aval.shape) == 5)  # [2, bkv, Z, c, H]
    return kv_buffers.shape[1], getattr(q_block, "block_size", q_block)


@pytest.mark.slow
def test_each_pair_decodes_its_own_rows_and_the_configs_tiles_reach_the_kernel():
    """The ragged forward at its tile (4 kv pages x 16 queries) over the whole bucket on every chip, its layers'
    rows split over the pairs (16 per chip); each decode iteration at the decode tile (2 pages, q blocks of at most
    8 tokens) over its pair's 4 of the 8 slots: the kernel's q operand bf16[4, 2, 128] and the MLP's dots at 4 rows
    per chip. (Before: both pairs ran all 8 slots, q bf16[8, 2, 128], and the forward's 32 rows on each chip, at
    the kernel's 32 x 32 clipped to the bucket and the pages.) No collective moves more than a layer's keys and
    values of the bucket."""
    devices, _ = compile_check.topology_devices("v4:2x2x1")
    mesh = parallel.make_mesh(data=2, fsdp=1, tensor=2, devices=devices)
    cfg = ModelConfig.tiny(vocab_size=512, hidden_size=256, intermediate_size=F, num_heads=4, num_kv_heads=2,
                           head_dim=128, dtype="bfloat16", param_dtype="bfloat16", attention_platform="tpu")
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    engine = EngineConfig(max_seqs=SLOTS, token_budgets=(SLOTS, BUCKET), decode_chunk=4, page_size=16,
                          num_pages=SLOTS * 16 + 1, max_context=256)
    runner = DeviceRunner(graphdef, cfg, SamplingConfig(decode_chunk=4), engine, mesh, tiles=KernelTiles(4, 16, 2, 8))
    assert runner.batches == 2
    args = (parallel.abstract_params(state, mesh), *runner.abstract_args(BUCKET))
    with jax.set_mesh(mesh):
        forward, decode = pallas_calls(jax.make_jaxpr(runner.step(BUCKET))(*args).jaxpr)
        hlo = runner.step(BUCKET).lower(*args).compile().as_text()
    assert (tile_of(forward), tile_of(decode)) == ((4, 16), (2, 4))  # the decode's 8 clipped to its 4 rows
    instructions = [i for c in hlo_text.parse_module(hlo).computations.values() for i in c.instructions.values()]
    kernels = [i for i in instructions if i.opcode == "custom-call" and "ragged_paged_attention" in i.name]
    assert sorted(i.shape[0].dims for i in kernels) == [(4, 2, 128), (32, 2, 128)]
    mlp_rows = {i.shape[0].dims[0] for i in instructions
                if i.opcode in ("convolution", "dot") and i.shape[0].dims[-1:] == (F // 2,)}
    assert mlp_rows == {BUCKET // 2, SLOTS // 2}
    keys_and_values = BUCKET * 2 * 128 * 2  # a layer's keys and values of the bucket per chip, bf16
    assert max(hlo_text.array_bytes(i.shape) for i in instructions if i.opcode.startswith((
        "all-gather", "all-reduce", "all-to-all", "collective-permute"))) <= keys_and_values


def test_the_tile_within_one_percent_of_the_cheapest_has_the_largest_kv_blocks_then_the_smallest_q_blocks():
    seconds = {(4, 8): 10.0, (4, 32): 9.96, (8, 8): 10.05, (8, 32): 10.05, (16, 8): 10.1, (16, 32): 10.0}
    assert tiles.near_best(seconds) == (16, 32)  # 1% of 9.96: up to 10.0596
    assert tiles.near_best({**seconds, (16, 32): 10.1}) == (8, 8)
    assert tiles.near_best({**seconds, (16, 32): 10.1, (8, 8): 10.1}) == (8, 32)


def test_the_sweep_costs_every_candidate_and_picks_by_the_estimate(paged_model_dir):  # noqa: F811
    """The shrunk flagship (8 slots per host, pages of 16 slots, 16 per sequence) at budgets 64 and 128: each budget's
    tiles are `near_best` of its ragged and decode candidates (each with the other tile at its cheapest, their
    seconds adding up), its seconds the estimate's at those tiles; the programs count training's and evaluation's
    buckets; the lines name the budgets and the candidates."""
    run = flagship(paged_model_dir, **PAGED)
    choices = tiles.sweep(run, [64, 128])
    assert sorted(c.max_step_tokens for c in choices) == [64, 128]
    assert choices[0].seconds <= choices[1].seconds
    for c in choices:
        assert set(c.ragged) == set(c.decode) == {(kv, q) for kv in (4, 8, 16) for q in (8, 16, 32)}
        t = c.tiles
        assert (t.kv_pages_per_block, t.queries_per_block) == tiles.near_best(c.ragged)
        assert (t.decode_kv_pages_per_block, t.decode_queries_per_block) == tiles.near_best(c.decode)
        ragged, decode = c.ragged[(t.kv_pages_per_block, t.queries_per_block)], c.decode[(
            t.decode_kv_pages_per_block, t.decode_queries_per_block)]
        assert min(c.ragged.values()) == pytest.approx(min(c.decode.values()))  # the other tile at its cheapest
        assert c.seconds == pytest.approx(ragged + decode - min(c.ragged.values()))
        budgeted = tiles.with_budget(run, c.max_step_tokens)
        rollout = tiles.rollout_of(budgeted)
        schedule = tiles.rollout_schedule.for_run(budgeted, tiles.step_lengths.defaults(budgeted), rollout.sequences)
        assert tiles.device_seconds(rollout, schedule, t) == pytest.approx(c.seconds)
    # Training's 8 slots (32 trajectories over v4:2x2x4's 4 hosts) and evaluation's 8, each doubling to the budget:
    # 4 + 4 programs at 64 tokens, 5 + 5 at 128.
    assert {c.max_step_tokens: c.programs for c in choices} == {64: 8, 128: 10}
    lines = tiles.format_choices("flagship", choices, 10.0, 0.0, 5.0).splitlines()
    assert lines[0].startswith("flagship: expected rollout, kernel-faithful, per host")
    assert lines[1].startswith(f"  max_step_tokens {choices[0].max_step_tokens:>5} ({choices[0].programs} rollout "
                               "programs): ragged tile ")
    assert lines[3].startswith(f"  at {choices[0].max_step_tokens}, ragged tile (kv pages x queries per block: "
                               "seconds): 4 x 8 ")
