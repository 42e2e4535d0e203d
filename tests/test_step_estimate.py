"""The step-time estimate of --mode=compile: call counts per step from the config, and times from HLO costs."""
import pytest

from llds_jax import step_estimate, step_lengths
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
    assert lines[-1] == (f"worst-case step: rollout {rollout_s:.1f} s + updates {updates_s:.1f} s = "
                         f"{rollout_s + updates_s:.1f} s; rollout {rollout_s / (rollout_s + updates_s):.1%} of the "
                         "step")



def test_retrieval_is_costed_by_the_calls_that_hold_a_session():
    """configs/qwen7b_v4.py: 640 trajectories per host in 5 sessions, 3 search turns each: 15 calls hold a session,
    each of up to 960 / 15 = 64 searches at 1.5 per trajectory."""
    cfg = load("qwen7b_v4")
    assert step_estimate.retrieval_calls(cfg, sequences=640, rows=128, searches=1.5) == (15, 64.0)


def test_a_faiss_call_costs_one_scan_per_query_per_thread_below_the_blas_path(monkeypatch):
    """1 s per million rows for one query on one thread: a call of 64 queries on 240 vCPUs is one round, 21.0 s over
    wiki-18 (each thread scans every row); 166 queries on 2 vCPUs are 83 rounds; from 167 queries faiss multiplies
    through BLAS, at its per-query cost spread over the threads. HNSW: rounds of its per-query cost (300 queries on
    240 threads: 2)."""
    monkeypatch.setattr(step_estimate, "FLAT_SCAN_S_PER_MROW", 1.0)
    monkeypatch.setattr(step_estimate, "FLAT_BLAS_S_PER_QUERY_PER_MROW", 0.1)
    monkeypatch.setattr(step_estimate, "HNSW_S_PER_QUERY", 2e-3)
    rows = step_estimate.WIKI18_ROWS
    assert step_estimate.host_call_seconds(rows, 64, 240, hnsw=False) == pytest.approx(21.015324)
    assert step_estimate.host_call_seconds(rows, 166, 2, hnsw=False) == pytest.approx(83 * 21.015324)
    assert step_estimate.host_call_seconds(rows, 300, 240, hnsw=False) == pytest.approx(300 * 2.1015324 / 240)
    assert step_estimate.host_call_seconds(rows, 300, 240, hnsw=True) == pytest.approx(2 * 2e-3)


def test_retrieval_seconds_by_backend(monkeypatch):
    """15 calls of 64 queries on a v4 host: Flat at one scan per call; HNSW at one round; the e5_device search
    program at its roofline time per device call (1.2 GB read at v4's 1.2 TB/s: 1 ms), one call of 64 queries;
    BM25 none measured."""
    monkeypatch.setattr(step_estimate, "FLAT_SCAN_S_PER_MROW", 1.0)
    monkeypatch.setattr(step_estimate, "HNSW_S_PER_QUERY", 2e-3)
    v4 = PEAKS["v4"]
    cfg = load("qwen7b_v4")  # e5: Search-R1's e5_Flat.index
    seconds, how = step_estimate.retrieval_seconds(cfg, 15, 64, "v4", v4)
    assert seconds == pytest.approx(15 * 21.015324)
    assert how == ("21 s per call (e5 Flat over 21,015,324 rows, one query per thread scanning every row, on a host's "
                   "240 vCPUs; measured on 1 thread)")
    assert step_estimate.retrieval_seconds(load("qwen7b_v4", "e5_hnsw"), 15, 64, "v4", v4)[0] == pytest.approx(
        15 * 2e-3)
    search = step_estimate.ProgramCost("retrieval search", "64 queries x ...", HloCost(hbm_bytes=1.2e9), 15, "",
                                       Role.RETRIEVAL)
    seconds, how = step_estimate.retrieval_seconds(load("qwen7b_v4", "e5_device"), 15, 64, "v4", v4, search)
    assert seconds == pytest.approx(15 * 1e-3)
    assert how == "1.00 ms per call (e5_device, 64 queries x ...: 1.00 ms per device call, roofline from its HLO)"
    assert step_estimate.retrieval_seconds(load("qwen7b_v4", "e5_device"), 15, 65, "v4", v4, search)[0] == (
        pytest.approx(15 * 2e-3))  # 65 queries: two device calls of 64
    assert step_estimate.retrieval_seconds(load("qwen7b_v4", "bm25"), 15, 64, "v4", v4) == (
        0.0, "no measured cost per call for retriever 'bm25' (not counted)")


def test_the_expected_step_scales_the_decode_and_the_updates_and_adds_retrieval(monkeypatch):
    """Worst case: 100 decode chunks of 1 ms and 10 updates of 1 s (memory-bound at 1.2 TB/s), a 2 ms reshard.
    Expected: the decode at 375 / 0.25 = 1500 of 2000 steps (75 ms), the updates at 1024 of 4096 tokens (2.5 s),
    960 searches (640 trajectories x 1.5) in 15 calls that hold a session, each of up to 64 queries, one round of
    64 ms scans on a 240-vCPU host, added to the rollout."""
    monkeypatch.setattr(step_estimate, "FLAT_SCAN_S_PER_MROW", 64e-3 / step_estimate.WIKI18_ROWS * 1e6)
    cfg = load("qwen7b_v4")
    v4 = PEAKS["v4"]
    programs = [
        step_estimate.ProgramCost("decode chunk", "", HloCost(hbm_bytes=1.2e9), 100, step_estimate.ROLLOUT,
                                  Role.DECODE_CHUNK),
        step_estimate.ProgramCost("rollout reshard", "", HloCost(hbm_bytes=2.4e9), 1, step_estimate.RESHARD,
                                  Role.RESHARD),
        step_estimate.ProgramCost("update", "", HloCost(hbm_bytes=1.2e12), 10, step_estimate.UPDATES, Role.UPDATE),
    ]
    lengths = step_lengths.Lengths(375.0, 1024.0, 1.5, 0.25, 0.0, "the run r")
    lines = step_estimate.expected(programs, v4, "v4", cfg, lengths, sequences=640, rows=128).splitlines()
    assert lines[0] == ("expected lengths from the run r: per trajectory 375 sampled tokens, 1,024 trained, 1.50 "
                        "searches; the decode at 75.0% of the worst case's calls, the forwards and updates at 25.0%, "
                        "other programs as in the worst case")
    assert lines[1] == ("retrieval (in the rollout, what rows wait for): 960 searches per host and step; 15 calls held a "
                        "session (each session's last call of each search turn) of up to 64 queries x 0.064 s per call "
                        "(e5 Flat over 21,015,324 rows, one query per thread scanning every row, on a host's 240 vCPUs; "
                        "measured on 1 thread) = 1.0 s")
    rollout = 0.075 + 0.002 + 0.96
    assert lines[2] == (f"expected step: rollout {rollout:.1f} s (of which retrieval 1.0 s, weight reshard 0.00 s) + "
                        f"updates 2.5 s = {rollout + 2.5:.1f} s; rollout {rollout / (rollout + 2.5):.1%} of the step (an "
                        "estimate, not a measurement)")
