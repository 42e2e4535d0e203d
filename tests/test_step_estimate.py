"""The step-time estimate of --mode=compile: call counts per step from the config, and times from HLO costs."""
from llds_jax import step_estimate
from llds_jax.programs import Role
from llds_jax.roofline import PEAKS, HloCost
from tests.configs import load


def test_calls_per_step_of_the_flagship_config():
    """configs/qwen7b_v4.py: 2560 trajectories over 4 hosts, 640 each in 5 sessions of 128 rows; 3 search turns
    and the answer turn of 500 tokens in chunks of 32 (15 whole chunks and one of 20 steps a turn: 500 / 32 chunks'
    worth of steps); 10 updates, LLD measured every step."""
    cfg = load("qwen7b_v4")
    assert step_estimate.rollout_calls(cfg, sequences=640, rows=128) == {
        Role.PREFILL: 5, Role.DECODE_CHUNK: 5 * 4 * 500 / 32, Role.EXTEND: 5 * 3, Role.CACHE_GROWTH: 5,
        Role.COMPACTION: 5}
    cfg.rollout.continuous_batching = True  # extends of at most 16 rows: 8 calls for every row of a 128-row batch
    assert step_estimate.rollout_calls(cfg, sequences=640, rows=128) == {
        Role.EMPTY_BATCH: 1, Role.PROMPT_EXTEND: 5 * 8, Role.ROW_EXTEND: 5 * 3 * 8,
        Role.DECODE_CHUNK: 5 * 4 * 500 / 32, Role.CACHE_GROWTH: 5, Role.COMPACTION: 5}
    cfg.rollout.max_extend_rows = 0  # one call for every row
    calls = step_estimate.rollout_calls(cfg, sequences=640, rows=128)
    assert (calls[Role.PROMPT_EXTEND], calls[Role.ROW_EXTEND]) == (5, 5 * 3)
    cfg.train.lld_every = 4
    assert step_estimate.update_calls(cfg, updates=10) == {
        Role.REFERENCE_LOGP: 10, Role.POLICY_LOGP: 10, Role.LIKELIHOOD_METRICS: 1, Role.LLD_LOGP: 5.0,
        Role.LLD_METRICS: 0.25, Role.UPDATE: 10}
    cfg.train.lld_every = 0
    assert step_estimate.update_calls(cfg, updates=10)[Role.LLD_LOGP] == 0
    assert step_estimate.assumptions(cfg, 640, 128) == (
        "assumed per host and step: 640 trajectories in 5 session(s) of 128 rows, each 4 turns of 500 decode steps "
        "(the longest row) in chunks of 32, 3 extends of 500 tokens, reading the filled cache in blocks of 512 "
        "slots")
    cfg.rollout.cache_block = 0
    assert step_estimate.assumptions(cfg, 640, 128).endswith(
        "3 extends of 500 tokens, attending over every slot of the largest cache capacity")


def test_filled_blocks_follow_the_conversation():
    """Blocks of 4 slots; a prompt bucket of 8, turns of 2 tokens, observations of 3 (bucket 4) appended in
    passes of 2, one search turn: decode queries sit at slots 8, 9 (turn 1: 3 blocks each) and 13, 14 (turn 2,
    after 2 + 3 tokens: 4 blocks); the extend's 2 passes see up to slots 11 and 13 (3 and 4 blocks). At most
    capacity / block; without cache_block, one block: the whole capacity."""
    cfg = load("qwen7b_v4")
    r = cfg.rollout
    r.cache_block, r.max_turn_tokens, r.max_observation_tokens, r.extend_chunk, r.max_turns = 4, 2, 3, 2, 1
    assert step_estimate.filled_blocks(cfg, prompt=8, observation=4, capacity=32) == (3.5, 3.5)
    assert step_estimate.filled_blocks(cfg, prompt=8, observation=4, capacity=12) == (3.0, 3.0)
    r.cache_block = 0
    assert step_estimate.filled_blocks(cfg, prompt=8, observation=4, capacity=32) == (1.0, 1.0)


def test_step_time_adds_each_programs_roofline_time_per_call_times_its_calls():
    """v4: 275 TFLOP/s, 1.2 TB/s HBM, 300 GB/s ICI. A decode chunk of 1.2 GB (1 ms, memory-bound) called 100
    times and a prefill of 275 TFLOP (1 s) once make the rollout; an update of 2 x 275 TFLOP plus 300 MB of
    collectives (2 s + 1 ms) called 10 times and an uncalled program make the updates."""
    v4 = PEAKS["v4"]
    programs = [
        step_estimate.ProgramCost("prefill", "", HloCost(flops=275e12), 1, step_estimate.ROLLOUT, Role.PREFILL),
        step_estimate.ProgramCost("decode chunk", "", HloCost(flops=1e9, hbm_bytes=1.2e9), 100, step_estimate.ROLLOUT,
                                  Role.DECODE_CHUNK),
        step_estimate.ProgramCost("update (10 per step)", "", HloCost(flops=550e12, collective_bytes={
            "all-reduce": 0.3e9}), 10, step_estimate.UPDATES),
        step_estimate.ProgramCost("optimizer init", "", HloCost(flops=1e15), 0, step_estimate.UPDATES),
    ]
    text = step_estimate.format_estimate(programs, v4, "v4", decode_tokens_per_call=128 * 32)
    lines = text.splitlines()
    assert lines[0].startswith("estimated time per chip (roofline from each program's HLO at v4 peaks; an estimate")
    decode = next(line for line in lines if line.startswith("decode chunk"))
    assert decode.split() == ["decode", "chunk", "1.0", "1.20", "0.000", "memory", "1.00ms", "100.0", "0.10s"]
    assert "decode: 4,096,000 tokens/s per host with every row sampling" in lines
    rollout_s, updates_s = 1.0 + 0.1, 10 * (2.0 + 0.001)
    assert lines[-1] == (f"estimated step: rollout {rollout_s:.1f} s + updates {updates_s:.1f} s = "
                         f"{rollout_s + updates_s:.1f} s; rollout {rollout_s / (rollout_s + updates_s):.1%} of the "
                         "step")

