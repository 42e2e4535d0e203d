"""The step-time estimate of --mode=compile: a rollout call's roofline cost against a hand formula, retrieval where
it blocks under each policy, the training programs' time per step, the printed lines."""
import dataclasses

import pytest

from llds_jax import config as config_lib
from llds_jax.aot import beside, kernel_cost, measured, rollout_schedule, step_estimate, step_lengths
from llds_jax.model import ModelConfig
from llds_jax.programs import Role
from llds_jax.rollout.config import KernelTiles, SamplingConfig
from llds_jax.aot.roofline import PEAKS, ChipPeaks, HloCost
from llds_jax.config.sections import RolloutConfig
from tests.configs import load

# Round peaks: 1e12 FLOP/s, 1e9 HBM bytes/s, 1e8 ICI bytes/s.
PEAKS_1 = ChipPeaks(1e12, 1e9, 1e8, "test")


def typed_retriever(*args: str):
    """The typed retriever section of configs/qwen7b_v4.py (`get_config(*args)`)."""
    return config_lib.typed(load("qwen7b_v4", *args)).retriever


def tiny_cost(tensor=2):
    """A model of 2 layers, D 64, 4 heads and 2 key/value heads of 16, F 96, V 640 in bfloat16 over `tensor` chips,
    1e6 weight bytes per chip, pages of 8 slots, 4 sequence slots."""
    cfg = ModelConfig.tiny(vocab_size=640, hidden_size=64, intermediate_size=96, num_heads=4, num_kv_heads=2,
                           head_dim=16, num_layers=2, dtype="bfloat16")
    return step_estimate.step_cost(cfg, tensor, 1e6, page_size=8, slots=4)


def test_a_forward_costs_its_weights_pages_and_tokens_flops():
    """Per layer q, k, v, o 64 x 16 x (4 + 2 + 2 + 4) and the MLP 3 x 64 x 96 matrix parameters, 2 FLOPs each per
    token, halved over 2 chips; the output projection 2 x 640 x 64 / 2 per slot; a page 2 layers x 8 slots x 4
    key/value rows x 16 x 2 bytes / 2; all-reduces 2 per layer of 64 x 2 bytes x 2 (2 - 1) / 2 per token."""
    cost = tiny_cost()
    layer = 64 * 16 * 12 + 3 * 64 * 96
    assert cost.flops_per_token == 2 * layer * 2 / 2
    assert cost.logit_flops_per_slot == 2 * 640 * 64 / 2
    assert cost.page_bytes == 2 * 8 * 4 * 16 * 2 / 2
    assert cost.ici_bytes_per_token == 2 * 2 * 64 * 2 * 2 * 1 / 2
    # A forward of 1e6 tokens: compute-bound at 1e6 x flops_per_token / 1e12; one of 4 tokens reading 100 pages:
    # memory-bound at (1e6 + 100 pages) / 1e9.
    big = 1e6 * cost.flops_per_token + 4 * cost.logit_flops_per_slot
    assert cost.forward_seconds(10**6, 0, PEAKS_1) == pytest.approx(big / 1e12 + 1e6 * cost.ici_bytes_per_token / 1e8)
    assert cost.forward_seconds(4, 100, PEAKS_1) == pytest.approx((1e6 + 100 * cost.page_bytes) / 1e9
                                                                 + 4 * cost.ici_bytes_per_token / 1e8)
    # A call: its ragged forward at its bucket's 16 tokens, then 3 decode iterations of the 4 slots reading 30 pages
    # in all (10 each).
    call = rollout_schedule.Call(bucket=16, tokens=11, pages_read=12, iterations=3, iteration_pages_read=30)
    assert cost.call_seconds(call, PEAKS_1) == pytest.approx(cost.forward_seconds(16, 12, PEAKS_1)
                                                             + 3 * cost.forward_seconds(4, 10, PEAKS_1))


def schedule(policy, calls, sequences=100, rows=20, waits=0):
    return rollout_schedule.Schedule(tuple(calls), {}, {}, sequences, policy, rows, waits, 1.0)


def test_retrieval_blocks_a_barrier_at_every_wait_and_a_continuous_stream_beyond_the_device(monkeypatch):
    """A Flat call of fewer than 167 queries on a v4 host (240 vCPUs) is one round of 2 s (monkeypatched). 100
    trajectories x 1.5 searches = 150 searches. Barrier: 6 turn rounds waited for their last call: 12 s. Continuous:
    at most the 20 rows in flight wait, so 150 / 20 = 7.5 calls of 20 queries, 15 s busy beside the device's 10 s:
    5 s block; beside 20 s of device time none."""
    monkeypatch.setattr(step_estimate, "FLAT_SCAN_S_PER_MROW", 2.0 / step_estimate.WIKI18_ROWS * 1e6)
    retriever = typed_retriever("e5")  # faiss Flat
    one_second = step_estimate.StepCost(1e9, 0, 0, 0, 0, 4)  # 1e9 weight bytes at 1e9 B/s: 1 s per forward
    calls = [rollout_schedule.Call(64, 10, 0, 0, 0)] * 10
    barrier = step_estimate.rollout_time(schedule("barrier", calls, waits=6), one_second, PEAKS_1, retriever, "v4",
                                         1.5)
    assert (barrier.device, barrier.retrieval) == (pytest.approx(10.0), pytest.approx(12.0))
    assert barrier.bucket_seconds == {64: pytest.approx(10.0)}
    continuous = step_estimate.rollout_time(schedule("continuous", calls), one_second, PEAKS_1, retriever, "v4", 1.5)
    assert continuous.retrieval == pytest.approx(5.0)
    assert "150 searches in at least 7.5 calls of 20 (the rows in flight)" in continuous.retrieval_how
    longer = step_estimate.rollout_time(schedule("continuous", calls * 2), one_second, PEAKS_1, retriever, "v4", 1.5)
    assert longer.retrieval == 0.0


def test_the_step_lines_add_device_retrieval_reshard_and_updates():
    lengths = step_lengths.defaults(load("qwen7b_v4"))
    calls = [rollout_schedule.Call(128, 100, 5, 7, 35), rollout_schedule.Call(1024, 1000, 50, 7, 350)]
    time = step_estimate.RolloutTime({128: 1.0, 1024: 3.0}, 2.0, "2 calls x 1 s")
    text = step_estimate.format_step("expected", schedule("continuous", calls, 640, 128), time, 0.5, 13.5, lengths)
    lines = text.splitlines()
    assert lines[0].startswith("expected step at defaults (assumed, not measured")
    assert lines[2].split() == ["128", "1", "100", "7", "1.00s"]
    assert lines[3].split() == ["1024", "1", "1,000", "7", "3.00s"]
    assert lines[-1] == ("  expected step: rollout 6.5 s (device 4.0 s, retrieval 2.0 s, weight reshard 0.50 s) + "
                         "updates 13.5 s = 20.0 s; rollout 32.5% of the step (an estimate, not a measurement)")


def test_training_programs_cost_their_roofline_time_per_call_times_their_calls():
    """v4: 275 TFLOP/s, 1.2 TB/s HBM, 300 GB/s ICI. An update of 2 x 275 TFLOP plus 300 MB of collectives (2 s +
    1 ms) called 10 times, a reshard of 2.4 GB once (2 ms); the paged step programs are not HLO-costed (part "")."""
    v4 = PEAKS["v4"]
    programs = [
        step_estimate.ProgramCost("update (10 per step)", "", HloCost(flops=550e12, collective_bytes={
            "all-reduce": 0.3e9}), 10, step_estimate.UPDATES, Role.UPDATE),
        step_estimate.ProgramCost("rollout reshard", "", HloCost(hbm_bytes=2.4e9), 1, step_estimate.RESHARD,
                                  Role.RESHARD),
        step_estimate.ProgramCost("rollout step (128 tokens)", "", HloCost(hbm_bytes=1e12), 0,
                                  step_estimate.part(Role.ROLLOUT_STEP, True), Role.ROLLOUT_STEP),
    ]
    assert step_estimate.part_seconds(programs, v4) == {step_estimate.ROLLOUT: 0.0, step_estimate.UPDATES:
                                                        pytest.approx(10 * 2.001), step_estimate.RESHARD:
                                                        pytest.approx(0.002)}
    half = step_estimate.part_seconds(programs, v4, {Role.UPDATE: 0.5})
    assert half[step_estimate.UPDATES] == pytest.approx(5 * 2.001)
    lines = step_estimate.format_programs(programs, v4, "v4").splitlines()
    assert lines[3].split() == ["update", "(10", "per", "step)", "550000.0", "0.00", "0.300", "compute", "2001.00ms",
                                "10.0", "20.01s"]
    assert not any(line.startswith("rollout step") for line in lines)


def test_predicted_counts_are_printed_beside_the_logged_ones():
    s = dataclasses.replace(schedule("barrier", [rollout_schedule.Call(16, 9, 0, 0, 0)] * 3),
                            calls_per_bucket={16: 3}, tokens_per_bucket={16: 27})
    lines = step_estimate.format_counts(s, {16: (3.5, 30.0), 32: (1.0, 20.0)}, "r").splitlines()
    assert lines[1].split() == ["16", "3", "vs", "3.5", "27", "vs", "30.0"]
    assert lines[2].split() == ["32", "0", "vs", "1.0", "0", "vs", "20.0"]
    assert lines[3].split() == ["all", "3", "vs", "4.5"]


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
    """A call of 64 queries on a v4 host: Flat one scan; HNSW one round; the e5_device search
    program at its roofline time per device call (1.2 GB read at v4's 1.2 TB/s: 1 ms), one call of 64 queries;
    BM25 none measured."""
    monkeypatch.setattr(step_estimate, "FLAT_SCAN_S_PER_MROW", 1.0)
    monkeypatch.setattr(step_estimate, "HNSW_S_PER_QUERY", 2e-3)
    v4 = PEAKS["v4"]
    seconds, how = step_estimate.retrieval_call_seconds(typed_retriever("e5"), 64, "v4", v4)  # faiss, e5_Flat.index
    assert seconds == pytest.approx(21.015324)
    assert how == ("21 s per call (e5 Flat over 21,015,324 rows, one query per thread scanning every row, on a host's "
                   "240 vCPUs; measured on 1 thread)")
    assert step_estimate.retrieval_call_seconds(typed_retriever("e5_hnsw"), 64, "v4", v4)[0] == pytest.approx(2e-3)
    search = step_estimate.ProgramCost("retrieval search", "64 queries x ...", HloCost(hbm_bytes=1.2e9), 15, "",
                                       Role.RETRIEVAL)
    seconds, how = step_estimate.retrieval_call_seconds(typed_retriever("e5_device"), 64, "v4", v4, search)
    assert seconds == pytest.approx(1e-3)
    assert how == "1.00 ms per call (e5_device, 64 queries x ...: 1.00 ms per device call, roofline from its HLO)"
    assert step_estimate.retrieval_call_seconds(typed_retriever("e5_device"), 65, "v4", v4, search)[0] == (
        pytest.approx(2e-3))  # 65 queries: two device calls of 64
    assert step_estimate.retrieval_call_seconds(typed_retriever("bm25"), 64, "v4", v4) == (
        0.0, "no measured cost per call for retriever 'bm25' (not counted)")




def test_a_partial_runs_steady_state_averages_the_steps_after_the_warmup_and_prints_beside_the_synchronous():
    """Each step's calls at 1 s each (retrieval off: no searches); the first PARTIAL_WARMUP steps are left out of
    the means. The lines: the synchronous rollout (its device and retrieval seconds plus the reshard) and the step
    with the updates, then each over-sampling's steady state with its change against the synchronous rollout."""
    retriever = typed_retriever()
    one_second = step_estimate.StepCost(1e9, 0, 0, 0, 0, 4)
    warmup = rollout_schedule.PARTIAL_WARMUP

    def step(calls, resumed, reprefill, carried, dropped):
        return rollout_schedule.PartialStep(schedule("continuous", [rollout_schedule.Call(64, 10, 0, 0, 0)] * calls),
                                            started=6, trained=4, resumed=resumed, reprefill_tokens=reprefill,
                                            carried=carried, carried_groups=2, dropped=dropped)

    steps = [step(50, 0, 0, 9, 0)] * warmup + [step(8, 2, 100, 3, 0), step(10, 4, 300, 5, 1)]
    p = step_estimate.partial_time(steps, 1.5, one_second, PEAKS_1, retriever, "v4", 0.0)
    assert p == step_estimate.PartialTime(1.5, rollout=9.0, started=6, trained=4, resumed=3, reprefill_tokens=200,
                                          carried=4, dropped=0.5)
    with pytest.raises(ValueError, match="none after the first"):
        step_estimate.partial_time(steps[:warmup], 1.5, one_second, PEAKS_1, retriever, "v4", 0.0)
    lines = step_estimate.format_partial(step_estimate.RolloutTime({64: 10.0}, 0.0, ""), [p], 0.5, 20.0,
                                         4, 1, what_if=True).splitlines()
    assert lines[0].startswith("  partial rollouts (what-if, rollout.partial is off): ")
    assert "(max_staleness 1), an estimate, not a measurement" in lines[0]
    assert lines[1].split() == ["synchronous", "rollout", "10.5", "s,", "step", "30.5", "s:", "4", "groups",
                                "trained;", "the", "rollout", "ends", "with", "its", "slowest", "conversation"]
    assert lines[2] == ("    over-sampling 1.5  rollout    9.5 s (-9.5%), step   29.5 s: 4 of 6 groups trained; 3.0 "
                        "conversations resumed (200 tokens re-prefilled), 4.0 carried on, 0.5 groups dropped")


def test_the_estimate_simulates_the_configs_over_sampling_when_partial_is_on_else_the_what_if():
    rollout = RolloutConfig()
    assert step_estimate.partial_factors(rollout) == (1.5, 2.0)
    assert step_estimate.partial_factors(dataclasses.replace(rollout, partial=True, over_sampling=3.0)) == (3.0,)


def test_a_draw_makes_the_samplers_passes_over_its_rows_vocabulary():
    """The log-softmax and softmax (3 passes each: max, sum, result), the inverse-CDF draw (3), the nucleus' 30
    bisection sums and its kept set (2); greedy: the log-softmax and the argmax; top-k: the log-softmax and top_k."""
    sampling = SamplingConfig(top_p=0.95, top_k=0)
    assert step_estimate.sampler_passes(sampling) == 3 + 3 + 30 + 2 + 3
    assert step_estimate.sampler_passes(dataclasses.replace(sampling, top_p=1.0)) == 3 + 3 + 3
    assert step_estimate.sampler_passes(dataclasses.replace(sampling, greedy=True)) == 3 + 1
    assert step_estimate.sampler_passes(dataclasses.replace(sampling, top_k=50)) == 3 + 1


def faithful_tiny(tensor=2, batches=1):
    """`tiny_cost`'s model over 2 chips (2 query heads and 1 key/value head each, heads of 16, bfloat16), pages of
    8 slots, 8 per sequence, every tile 2 pages x 4 queries, its 4 rows of logits split 2 ways, top-p sampling,
    decode iterations in `batches` batches."""
    cfg = ModelConfig.tiny(vocab_size=640, hidden_size=64, intermediate_size=96, num_heads=4, num_kv_heads=2,
                           head_dim=16, num_layers=2, dtype="bfloat16")
    return step_estimate.faithful_cost(tiny_cost(tensor), cfg, tensor, page_size=8, pages_per_seq=8, row_shards=2,
                                       sampling=SamplingConfig(top_p=0.95, top_k=0), tiles=KernelTiles(2, 4, 2, 4),
                                       batches=batches)


def test_a_call_as_the_kernel_runs_it_costs_whole_blocks_the_sampling_rows_and_the_work_around_the_layers():
    """A call at the 16-token bucket of two sequences (8 tokens at 8 slots, 3 at 20; sampling 1 and 3 tokens), then
    2 decode iterations of its one sampling row. Per chip a page is 8 slots x 2 rows x 16 x 2 bytes = 512 bytes, a
    kv block 2 pages (16 slots), a q block 4 tokens. The forward: sequence 0 visited by q blocks 0 and 1 (1 kv block
    each), sequence 1 by block 2 (2 kv blocks): 4 visits, 8 page copies of which 5 pages held; 4 q blocks copied in
    and out. Each decode iteration: one q block of the 4 slots' operand, sequence 1 alone at 21 then 22 slots (2 kv
    blocks; the slots not sampling are not run): 2 visits, 4 page copies of which 3 held. Two layers. PEAKS_1: 1e12
    FLOP/s, 1e9 B/s, 1e8 ICI B/s."""
    cost = faithful_tiny()
    call = rollout_schedule.Call(16, 11, 4, 2, 7, q_lens=(8, 3), kv_lens=(8, 20), samples=(1, 3))
    terms, tally = cost.call_terms(call, PEAKS_1)
    flops_forward = 4 * 4 * 4 * 2 * 16 * 16  # visits x (QK^T, PV: 4 FLOPs) x bq x heads x block slots x H
    flops_decode = 2 * 4 * 4 * 2 * 16 * 16
    q_out = 2 * 4 * 2 * 16 * 2  # one q block in and out: 4 tokens x 2 heads x 16 x 2 bytes
    assert tally == step_estimate.KernelTally(grid_steps=2 * (4 + 1 + 1), page_copies=2 * (8 + 4 + 4),
                                              useful_page_copies=2 * (5 + 3 + 3),
                                              pool_bytes=2 * (8 + 4 + 4) * 512.0,
                                              flops=2.0 * (flops_forward + 2 * flops_decode))
    attention = 2 * ((8 * 512 + 4 * q_out) + 2 * (4 * 512 + q_out)) / 1e9  # memory-bound at these sizes
    assert terms == {
        step_estimate.LAYERS: pytest.approx(3 * 1e6 / 1e9),  # three forwards, each reading the weights
        step_estimate.ATTENTION: pytest.approx(attention),
        step_estimate.KV_WRITE: pytest.approx((11 + 1 + 1) * 2 * 2 * 16 * 2 / 1e9),  # real tokens, sampling rows
        step_estimate.COPIES: pytest.approx(4 * 2 * cost.step.page_bytes / 1e9),  # S copies, each read and written
        step_estimate.SAMPLER: pytest.approx(3 * 41 * 2 * 640 * 4 / 1e9),  # 3 draws of 2 rows per chip
        step_estimate.ALL_REDUCE: pytest.approx((16 + 4 + 4) * cost.step.ici_bytes_per_token / 1e8)}
    time = step_estimate.faithful_time(schedule("continuous", [call, call]), cost, PEAKS_1)
    assert time.device == pytest.approx(2 * sum(terms.values()))
    assert time.kernel == tally + tally


def test_decode_iterations_in_two_batches_cost_a_chip_the_first_batchs_rows_and_half_the_layers_rows():
    """Three sequences of one decoding token each (8, 20 and 40 slots; sampling 2 samples each), 2 batches of 2 of
    the 4 slots: each decode iteration's chip runs batch 0, the sampling rows 0 and 2 (9 and 41 slots: 1 and 3 kv
    blocks), in a 2-token operand (one q block of 2); every chip writes the 3 rows' keys and values; the layers'
    rows (and their all-reduces) are halved, the ragged forward's attention whole on every chip."""
    one, two = faithful_tiny(), faithful_tiny(batches=2)
    call = rollout_schedule.Call(4, 3, 9, 1, 9, q_lens=(1, 1, 1), kv_lens=(8, 20, 40), samples=(2, 2, 2))
    terms, tally = two.call_terms(call, PEAKS_1)
    forward, first = one.forward_terms(4, 3, (1, 1, 1), (8, 20, 40), one.tiles.decode, PEAKS_1)
    decode = kernel_cost.kernel_call(two.kernel_at(two.tiles.decode), 2, (1, 1), (9, 41))
    assert decode.visits_s == (1, 3) and decode.grid_steps == 1
    assert tally == step_estimate.KernelTally.of(first, 2) + step_estimate.KernelTally.of(decode, 2)
    attention = 2 * max(decode.flops / 1e12, decode.hbm_bytes / 1e9)
    assert terms[step_estimate.ATTENTION] == pytest.approx(forward[step_estimate.ATTENTION] + attention)
    assert terms[step_estimate.KV_WRITE] == pytest.approx((3 + 3) * two.kv_write_bytes_per_token / 1e9)
    assert terms[step_estimate.ALL_REDUCE] == pytest.approx((4 + 4) / 2 * two.step.ici_bytes_per_token / 1e8)


def test_the_faithful_lines_name_each_terms_source_and_keep_the_ideal_share_beside():
    cost = faithful_tiny()
    time = step_estimate.FaithfulTime(dict(zip(step_estimate.TERM_SOURCES, (4.0, 3.0, 0.5, 0.25, 1.5, 0.75))),
                                      step_estimate.KernelTally(10, 100, 25, 2e9, 3e12))
    ideal = step_estimate.RolloutTime({128: 5.0}, 1.0, "")
    terms = {beside.HOST_TERM: beside.Beside(0.5, "measured", "host"),
             beside.RETRIEVAL_TERM: beside.Beside(1.25, "HLO + measured", "search"),
             beside.COLLECTIVES_TERM: beside.Beside(0.25, beside.COLLECTIVES_SOURCE, "hops")}
    lines = beside.format_faithful("expected", cost, time, ideal, 0.5, 13.5, terms).splitlines()
    assert lines[0] == ("  expected step, kernel-faithful (issue 67): each call as JAX's ragged paged attention runs "
                        "it, at the tile 2 kv pages x 4 queries (the slots' bucket and decode iterations: 2 x 4), "
                        "pages of 8 slots, each decode iteration over its sampling rows in one batch: term, source, "
                        "seconds")
    assert lines[1:10] == [
        "    layers (matrices, weights)     HLO              4.00 s",
        "    attention kernel               kernel grid      3.00 s  (10 grid steps, 2.0 GB of pages copied (25% of "
        "them pages the sequences hold), 3.0 TFLOP on the MXU)",
        "    KV write                       program          0.50 s",
        "    copy-on-write scan             program          0.25 s",
        "    sampler                        program          1.50 s  (41 passes per draw over the chip's rows of "
        "float32 logits)",
        "    tensor-parallel all-reduces    program          0.75 s",
        "    host time between calls        measured         0.50 s  (host)",
        "    retrieval                      HLO + measured     1.25 s  (search)",
        "    collectives' latency           HLO (count) x modelled latency     0.25 s  (hops)"]
    # Device 10 s + host 0.5 s + retrieval 1.25 s + latency 0.25 s + reshard 0.5 s = 12.5 s, + 13.5 s = 26 s;
    # ideal (5 + 1 + 0.5) / 20 = 32.5%.
    assert lines[10] == ("  expected step, kernel-faithful: rollout 12.5 s (device 10.0 s, host 0.5 s, retrieval 1.2 s, "
                         "collectives' latency 0.2 s, weight reshard 0.50 s) + updates 13.5 s = 26.0 s; rollout 48.1% "
                         "of the step (ideal: 32.5%; an estimate, not a measurement)")


# ----- beside the step programs: the host, retrieval in series, the collectives' latency ------------------------------

# Host ms per call at 32 / 64 / 128 / 256 sequences.
TABLE = measured.HostTable((32, 64, 128, 256), (0.68, 0.80, 1.17, 1.40), "bench", "abc", "here")


def calls(**per_call):
    """Calls of no tokens with the given per-call fields (lists of equal length)."""
    n = len(next(iter(per_call.values())))
    return [rollout_schedule.Call(8, 0, 0, **{k: v[i] for k, v in per_call.items()}) for i in range(n)]


def test_the_hosts_time_per_call_follows_the_measured_table_at_each_calls_sequences_in_flight():
    """Straight lines between the table's points, the end segments extended: 16 sequences 0.68 - 16 x 0.12 / 32 =
    0.62 ms, 48 halfway to 0.74, 128 the table's 1.17, 300 1.40 + 44 x 0.23 / 128. In series they add; overlapped,
    only what exceeds each call's device time (0.5, 2 and 1 ms for the last three)."""
    assert TABLE.seconds(16) == pytest.approx(0.62e-3)
    s = schedule("continuous", calls(iterations=[0, 0, 0, 0], iteration_pages_read=[0] * 4,
                                     in_flight=[16, 48, 128, 300]))
    at_300 = 1.40 + 44 * 0.23 / 128
    assert beside.host_seconds(s, TABLE) == pytest.approx((0.62 + 0.74 + 1.17 + at_300) / 1e3)
    overlapped = beside.host_seconds(s, TABLE, (1e-3, 0.5e-3, 2e-3, 1e-3), overlapped=True)
    assert overlapped == pytest.approx((0 + 0.24 + 0 + (at_300 - 1.0)) / 1e3)


SEARCH = beside.SearchPrograms({(8, 32): 1.0, (32, 32): 2.5, (64, 32): 4.0, (8, 128): 2.0, (32, 128): 3.5,
                                       (64, 128): 6.0, (8, 512): 9.0}, first=32, max_batch=64, second_pass=0.1)


def test_a_retriever_call_on_the_chips_costs_its_first_pass_and_a_second_at_the_measured_rate():
    """Calls of 3, 20 and 70 queries (70: device calls of 64 and 6) at a second-pass rate of 0.1: each device call
    its first pass at its bucket (8, 32, 64 and 8), and with probability 1 - 0.9^n a second pass at 128 candidates
    over the bucket of ceil(0.1 n) queries (8 each). Steps without searches send none."""
    assert SEARCH.second == 128
    def expect(n, bucket):
        return {8: 1.0, 32: 2.5, 64: 4.0}[bucket] + (1 - 0.9 ** n) * 2.0
    s = schedule("continuous", calls(iterations=[0] * 4, iteration_pages_read=[0] * 4, searches=[3, 0, 20, 70]))
    seconds, retriever_calls, queries = beside.retrieval_in_series(s, SEARCH)
    assert (retriever_calls, queries) == (3, 93)
    assert seconds == pytest.approx(expect(3, 8) + expect(20, 32) + expect(64, 64) + expect(6, 8))
    never = dataclasses.replace(SEARCH, second_pass=0.0)
    assert beside.retrieval_in_series(s, never)[0] == pytest.approx(1.0 + 2.5 + 4.0 + 1.0)


def test_search_programs_are_read_from_the_compiled_programs_names():
    """The first RETRIEVAL program is the first pass's; the others by their (queries, candidates); at round peaks
    a program of 1.2e9 HBM bytes costs 1.2 s."""
    def program(queries, m, hbm):
        return step_estimate.ProgramCost(f"retrieval search ({queries} queries, {m} candidates)", "",
                                         HloCost(hbm_bytes=hbm), 0, "", Role.RETRIEVAL)
    costs = [program(16, 32, 1.2e9), program(8, 32, 1e9), program(16, 128, 2e9),
             step_estimate.ProgramCost("rollout step (8 tokens)", "", HloCost(hbm_bytes=5.0), 0, "", Role.ROLLOUT_STEP)]
    retriever = typed_retriever()  # e5_device, device calls of 64 queries
    search = beside.search_programs(costs, retriever, PEAKS_1, 0.25)
    assert search == beside.SearchPrograms({(16, 32): 1.2, (8, 32): 1.0, (16, 128): 2.0}, 32, 64, 0.25)
    assert beside.search_programs(costs[3:], retriever, PEAKS_1, 0.25) is None


def test_the_collectives_latency_counts_the_hlos_runs_per_call_and_per_decode_iteration():
    """7 all-reduces over 4 chips (2 x 3 ring steps each) and an all-to-all (3) outside the decode loop, 8 and 3
    inside it: 45 hops per call and 57 per decode iteration; calls of 3 and 0 iterations: (2 x 45 + 3 x 57) us."""
    cost = HloCost(collective_runs={(False, 6): 7.0, (False, 3): 1.0, (True, 6): 8.0, (True, 3): 3.0})
    collectives = beside.Collectives.of(cost)
    assert collectives == beside.Collectives(8, 45, 11, 57)
    s = schedule("continuous", calls(iterations=[3, 0], iteration_pages_read=[0, 0]))
    assert collectives.seconds(s) == pytest.approx((2 * 45 + 3 * 57) * beside.ICI_HOP_LATENCY_S)


def test_every_term_beside_the_device_names_its_source_and_what_it_counted():
    """e5_device: retrieval in series from its programs' HLO at the measured rate; a host backend: the ideal's
    overlap model (measured per call for faiss Flat). The host's line names the bench's command and machine."""
    s = schedule("continuous", calls(iterations=[2, 0], iteration_pages_read=[0, 0], in_flight=[128, 64],
                                     searches=[3, 0]))
    time = step_estimate.FaithfulTime({}, step_estimate.KernelTally(), (1.0, 1.0))
    ideal = step_estimate.RolloutTime({8: 2.0}, 0.5, "faiss: 0.1 s per call (measured on 1 thread)")
    collectives = beside.Collectives(8, 45, 11, 57)
    on_chips = beside.beside_terms(s, time, ideal, typed_retriever(), TABLE, SEARCH, collectives)
    assert list(on_chips) == [beside.HOST_TERM, beside.RETRIEVAL_TERM, beside.COLLECTIVES_TERM]
    host, retrieval, latency = on_chips.values()
    assert (host.source, host.seconds) == ("measured", pytest.approx((1.17 + 0.80) / 1e3))
    assert "`bench`'s ms per call" in host.how and "here, at abc" in host.how and "in series" in host.how
    assert (retrieval.source, retrieval.seconds) == ("HLO + measured", pytest.approx(1.0 + (1 - 0.9 ** 3) * 2.0))
    assert "1 retriever calls of 3.0 queries" in retrieval.how and "every query: 3.0 s" in retrieval.how  # 1 + 2
    assert (latency.source, latency.seconds) == ("HLO (count) x modelled latency",
                                                 pytest.approx((2 * 45 + 2 * 57) * 1e-6))
    on_host = beside.beside_terms(s, time, ideal, typed_retriever("e5"), TABLE, None, collectives)
    assert (on_host[beside.RETRIEVAL_TERM].source, on_host[beside.RETRIEVAL_TERM].seconds) == (
        "measured", 0.5)
    assert "faiss on the host's CPUs beside the device" in on_host[beside.RETRIEVAL_TERM].how
