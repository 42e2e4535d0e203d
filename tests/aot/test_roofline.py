"""Roofline estimates from compiled HLO: exact counts on hand-written HLO, and on programs XLA's TPU compiler
(libtpu) compiles here, where `compiled.cost_analysis()` counts a scanned layer once and `hlo_costs` counts
every layer."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llds_jax.aot import hlo_text, roofline
from llds_jax.aot.hlo_text import Array
from llds_jax.aot.roofline import HloCost

# ----- hand-written HLO ----------------------------------------------------------------------------------------------
# A [8, 32] x [32, 32] float32 product in a fusion: 2 * 8 * 32 * 32 FLOPs; it reads 1 KiB + 4 KiB, writes 1 KiB.
DOT_FLOPS, DOT_BYTES = 2 * 8 * 32 * 32, 1024 + 4096 + 1024
FUSED_DOT = """
%fused_dot (p0: f32[8,32], p1: f32[32,32]) -> f32[8,32] {
  %p0 = f32[8,32]{1,0} parameter(0)
  %p1 = f32[32,32]{1,0} parameter(1)
  ROOT %dot.1 = f32[8,32]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, \
metadata={op_name="jit(f)/dot_general" source_file="x.py"}
}
"""
STATE = "(s32[]{:T(128)}, f32[8,32]{1,0:T(8,128)}, f32[32,32]{1,0:T(8,128)}, s32[])"


def loop(name: str, body_ops: str, bound: str) -> str:
    """A while loop `name` over STATE (counter, h, w, bound): its body runs `body_ops` (which define %h2 from %h and
    %w) and adds 1 to the counter from 0 while it is below `bound` (an instruction of the condition)."""
    return f"""
%{name}_body (t: {STATE}) -> {STATE} {{
  %t = {STATE} parameter(0)
  %i = s32[]{{:T(128)}} get-tuple-element(%t), index=0
  %h = f32[8,32]{{1,0:T(8,128)}} get-tuple-element(%t), index=1
  %w = f32[32,32]{{1,0:T(8,128)}} get-tuple-element(%t), index=2
  %n = s32[] get-tuple-element(%t), index=3
  %one = s32[] constant(1)
  %i2 = s32[]{{:T(128)S(6)}} add(%i, %one)
{body_ops}
  ROOT %out = {STATE} tuple(%i2, %h2, %w, %n)
}}

%{name}_cond (t: {STATE}) -> pred[] {{
  %t = {STATE} parameter(0)
  %i = s32[]{{:T(128)}} get-tuple-element(%t), index=0
  %n = s32[] get-tuple-element(%t), index=3
  %bound = {bound}
  ROOT %lt = pred[]{{:T(512)S(6)}} compare(%i, %bound), direction=LT
}}
"""


def run_loop(name: str, h: str, w: str, n: str, result: str, trip_attr: str = "") -> str:
    """Instructions running loop `name` on %h and %w from counter 0 with %n as element 3; %{result} is its h."""
    return f"""  %zero.{name} = s32[] constant(0)
  %init.{name} = {STATE} tuple(%zero.{name}, %{h}, %{w}, %{n})
  %while.{name} = {STATE} while(%init.{name}), condition=%{name}_cond, body=%{name}_body{trip_attr}
  %{result} = f32[8,32]{{1,0:T(8,128)}} get-tuple-element(%while.{name}), index=1"""


FUSION = "  %h2 = f32[8,32]{1,0:T(8,128)} fusion(%h, %w), kind=kOutput, calls=%fused_dot"
ENTRY = """
ENTRY %main (x: f32[8,32], w: f32[32,32], n: s32[]) -> f32[8,32] {
  %x = f32[8,32]{1,0:T(8,128)} parameter(0)
  %w = f32[32,32]{1,0:T(8,128)} parameter(1)
  %n = s32[] parameter(2)
%s
  ROOT %y = f32[8,32]{1,0:T(8,128)} copy(%r)
}
"""
# Per run of a loop body around FUSION: the fusion's bytes and the counter's add (reads 4 + 4, writes to S(6), not
# HBM); per run of its condition: the compare (reads 4 + 4, writes to S(6)). The entry's copy of the result: 2 KiB.
ADD, COMPARE, COPY = 8, 8, 2048


def module(*parts: str, entry: str) -> str:
    return "HloModule test, entry_computation_layout={(f32[8,32]{1,0})->f32[8,32]{1,0}}\n" + "".join(parts) + (
        ENTRY.replace("%s", entry))


def test_a_dot_counts_its_multiply_adds_and_its_bytes():
    text = module(entry="  %r = f32[8,32]{1,0:T(8,128)} dot(%x, %w), lhs_contracting_dims={1}, "
                        "rhs_contracting_dims={0}")
    cost = roofline.hlo_costs(text)
    assert cost == HloCost(flops=DOT_FLOPS, hbm_bytes=DOT_BYTES + COPY)


def test_a_loop_with_a_known_trip_count_multiplies_the_dot_in_its_body():
    """backend_config's known_trip_count (28) wins over what the condition implies (a bound of 7)."""
    known = ', backend_config={"known_trip_count":{"n":"28"},"flag_configs":[]}'
    text = module(FUSED_DOT, loop("l", FUSION, "s32[] constant(7)"), entry=run_loop("l", "x", "w", "n", "r", known))
    cost = roofline.hlo_costs(text)
    assert cost.flops == 28 * DOT_FLOPS
    assert cost.hbm_bytes == 28 * (DOT_BYTES + ADD) + 29 * COMPARE + COPY
    assert cost.dynamic_loops == 0


def test_a_trip_count_is_inferred_from_the_loop_and_nested_loops_multiply():
    """TPU HLO writes no known_trip_count: the count is read off the condition (counter < 3 or < the loop-invariant
    element 3, initialised to 5), the start (0) and the step (1). An outer loop of 5 around an inner one of 3 runs
    the dot 15 times."""
    inner = loop("inner", FUSION, "s32[] constant(3)")
    outer_body = run_loop("inner", "h", "w", "n", "h2")
    outer = loop("outer", outer_body, "s32[] copy(%n)")
    entry = "  %five = s32[] constant(5)\n" + run_loop("outer", "x", "w", "five", "r")
    cost = roofline.hlo_costs(module(FUSED_DOT, inner, outer, entry=entry))
    assert cost.flops == 15 * DOT_FLOPS
    inner_bytes = 3 * (DOT_BYTES + ADD) + 4 * COMPARE
    # The outer condition copies its bound (a kernel: reads 4, writes 4) before comparing.
    assert cost.hbm_bytes == 5 * (inner_bytes + ADD) + 6 * (8 + COMPARE) + COPY
    assert cost.dynamic_loops == 0


def test_a_loop_bound_known_only_at_run_time_runs_dynamic_trip_count_times():
    text = module(FUSED_DOT, loop("l", FUSION, "s32[] copy(%n)"), entry=run_loop("l", "x", "w", "n", "r"))
    assert roofline.hlo_costs(text).flops == DOT_FLOPS
    cost = roofline.hlo_costs(text, dynamic_trip_count=16)
    assert (cost.flops, cost.dynamic_loops) == (16 * DOT_FLOPS, 1)


def test_a_conditional_counts_its_costliest_branch():
    branches = """
%cheap (p: f32[8,32]) -> f32[8,32] {
  ROOT %p = f32[8,32]{1,0} parameter(0)
}

%costly (p: f32[8,32]) -> f32[8,32] {
  %p = f32[8,32]{1,0} parameter(0)
  %c = f32[32,32]{1,0} constant({...})
  ROOT %f = f32[8,32]{1,0} fusion(%p, %c), kind=kOutput, calls=%fused_dot
}
"""
    entry = """  %b = s32[] constant(1)
  %r = f32[8,32]{1,0} conditional(%b, %x, %x), branch_computations={%cheap, %costly}"""
    cost = roofline.hlo_costs(module(FUSED_DOT, branches, entry=entry))
    assert (cost.flops, cost.hbm_bytes) == (DOT_FLOPS, DOT_BYTES + COPY)


def test_a_batched_product_as_a_base_dilated_convolution_counts_its_batch_once():
    """XLA's TPU form of einsum("bmk,bkn->bmn") over b = 4: the batch is a spatial dim dilated by 4 under a window
    of 4, so each output takes one real tap per position."""
    entry = """  %a = bf16[4,128,256]{2,1,0} parameter(3)
  %b = bf16[4,256,384]{2,1,0} parameter(4)
  %c = bf16[4,128,384]{2,1,0} convolution(%a, %b), window={size=4 stride=3 lhs_dilate=4}, dim_labels=0bf_0io->0bf
  %r = f32[8,32]{1,0} copy(%x)"""
    cost = roofline.hlo_costs(module(entry=entry))
    assert cost.flops == 2 * 4 * 128 * 256 * 384
    conv_3x3 = """  %img = f32[2,16,16,8]{3,2,1,0} parameter(3)
  %k = f32[3,3,8,4]{3,2,1,0} parameter(4)
  %c = f32[2,16,16,4]{3,2,1,0} convolution(%img, %k), window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_01io->b01f
  %r = f32[8,32]{1,0} copy(%x)"""
    # Padding: each of 16 positions per dim has 3 taps but the two border positions 2: 16 * 3 - 2 = 46 per dim.
    assert roofline.hlo_costs(module(entry=conv_3x3)).flops == 2 * 2 * 4 * 8 * 46 * 46


def test_slices_of_a_stacked_weight_and_an_in_place_cache_update_count_only_what_they_touch():
    """A layer's weights sliced out of the [L, K, N] stack inside a fusion read one layer; a KV-cache update
    (dynamic-update-slice in place) reads and writes the new rows only."""
    parts = """
%layer (stack: bf16[8,512,512], i: s32[]) -> bf16[512,512] {
  %stack = bf16[8,512,512]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %z = s32[] constant(0)
  %ds = bf16[1,512,512]{2,1,0} dynamic-slice(%stack, %i, %z, %z), dynamic_slice_sizes={1,512,512}
  ROOT %w = bf16[512,512]{1,0} bitcast(%ds)
}

%outer (stack: bf16[8,512,512], i: s32[]) -> bf16[512,512] {
  %stack = bf16[8,512,512]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  ROOT %f = bf16[512,512]{1,0} fusion(%stack, %i), kind=kLoop, calls=%layer
}

%update (cache: bf16[4,1024,128], new: bf16[4,1,128], pos: s32[]) -> bf16[4,1024,128] {
  %cache = bf16[4,1024,128]{2,1,0} parameter(0)
  %new = bf16[4,1,128]{2,1,0} parameter(1)
  %pos = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %dus = bf16[4,1024,128]{2,1,0} dynamic-update-slice(%cache, %new, %z, %pos, %z)
}
"""
    entry = """  %stack = bf16[8,512,512]{2,1,0} parameter(3)
  %cache = bf16[4,1024,128]{2,1,0} parameter(4)
  %new = bf16[4,1,128]{2,1,0} parameter(5)
  %w1 = bf16[512,512]{1,0:T(8,128)(2,1)S(1)} fusion(%stack, %n), kind=kLoop, calls=%outer
  %cache2 = bf16[4,1024,128]{2,1,0} fusion(%cache, %new, %n), kind=kLoop, calls=%update
  %r = f32[8,32]{1,0} copy(%x)"""
    # The weights land in VMEM (S(1)): only the read of one layer from HBM counts; the update reads the new rows
    # and the position and writes the rows.
    assert roofline.hlo_costs(module(parts, entry=entry)).hbm_bytes == (512 * 512 * 2 + 4) + (
        2 * 4 * 128 * 2 + 4) + 2 * COPY  # and the copies x -> r -> y


def test_a_relayout_fused_before_a_slice_reads_only_the_slice():
    """The e5_device search's loop (XLA's TPU compiler, an int8 index of 81 blocks): the loop state in int8's
    (32, 128) tiles is copied into the (8, 128) tiles the dot takes inside the fusion that slices one block out;
    the fusion reads that block, not the index (a fused copy maps elements; it is no kernel of its own)."""
    parts = """
%relayout (stack: s8[81,64,128]) -> s8[81,64,128] {
  %stack = s8[81,64,128]{2,1,0:T(32,128)(4,1)} parameter(0)
  ROOT %c = s8[81,64,128]{2,1,0:T(8,128)(4,1)} copy(%stack)
}

%block (stack: s8[81,64,128], i: s32[]) -> s8[64,128] {
  %stack = s8[81,64,128]{2,1,0:T(32,128)(4,1)} parameter(0)
  %i = s32[] parameter(1)
  %z = s32[] constant(0)
  %r = s8[81,64,128]{2,1,0:T(8,128)(4,1)} fusion(%stack), kind=kLoop, calls=%relayout
  %ds = s8[1,64,128]{2,1,0:T(8,128)(4,1)} dynamic-slice(%r, %i, %z, %z), dynamic_slice_sizes={1,64,128}
  ROOT %b = s8[64,128]{1,0:T(8,128)(4,1)} bitcast(%ds)
}
"""
    entry = """  %stack = s8[81,64,128]{2,1,0:T(32,128)(4,1)} parameter(3)
  %b = s8[64,128]{1,0:T(8,128)(4,1)} fusion(%stack, %n), kind=kLoop, calls=%block
  %r = f32[8,32]{1,0} copy(%x)"""
    # One block read, the block written; the index's 81 blocks are not (then 81 x 64 x 128 bytes).
    assert roofline.hlo_costs(module(parts, entry=entry)).hbm_bytes == 2 * 64 * 128 + 4 + 2 * COPY


def test_a_scatter_into_the_stacked_cache_moves_only_its_updates():
    """A KV cache written in place (as llds_jax.model.paged_kv.write_kv writes the pool): a fused scatter of each
    row's new entries into one layer of a stacked [L, B, S, H] cache reads the indices and updates and writes the
    updates, not the 2 MiB cache."""
    parts = """
%add (a: bf16[], b: bf16[]) -> bf16[] {
  %a = bf16[] parameter(0)
  ROOT %b = bf16[] parameter(1)
}

%write (cache: bf16[2,4,1024,128], idx: s32[4,1,3], new: bf16[4,1,128]) -> bf16[2,4,1024,128] {
  %cache = bf16[2,4,1024,128]{3,2,1,0} parameter(0)
  %idx = s32[4,1,3]{2,1,0} parameter(1)
  %new = bf16[4,1,128]{2,1,0} parameter(2)
  ROOT %sc = bf16[2,4,1024,128]{3,2,1,0} scatter(%cache, %idx, %new), update_window_dims={2}, \
inserted_window_dims={0,1,2}, scatter_dims_to_operand_dims={0,1,2}, index_vector_dim=2, to_apply=%add
}
"""
    entry = """  %cache = bf16[2,4,1024,128]{3,2,1,0} parameter(3)
  %idx = s32[4,1,3]{2,1,0} parameter(4)
  %new = bf16[4,1,128]{2,1,0} parameter(5)
  %cache2 = bf16[2,4,1024,128]{3,2,1,0} fusion(%cache, %idx, %new), kind=kLoop, calls=%write
  %r = f32[8,32]{1,0} copy(%x)"""
    assert roofline.hlo_costs(module(parts, entry=entry)).hbm_bytes == (4 * 3 * 4 + 4 * 128 * 2) + 4 * 128 * 2 + (
        2 * COPY)


def test_a_pallas_kernel_over_several_lines_counts_its_bytes_and_its_runs_not_its_flops():
    """A Pallas kernel (splash attention) is a tpu_custom_call whose kernel_metadata spans lines, one of them a
    lone "}" that does not end the computation; its FLOPs are not in the HLO."""
    entry = """  %q = bf16[4,256,16]{2,1,0} parameter(3)
  %attn = (f32[256,128]{1,0}, bf16[4,256,16]{2,1,0}) custom-call(%q, /*index=1*/%q), \
custom_call_target="tpu_custom_call", frontend_attributes={kernel_metadata={
"xprof_metadata":"{\\"block_q\\": 256, \\"note\\": \\"}\\"}"
}
}, backend_config={"custom_call_config":{"body":"TUzvUgFNTElSMjEuMC4w"}}
  %r = f32[8,32]{1,0} copy(%x)"""
    cost = roofline.hlo_costs(module(entry=entry))
    assert (cost.flops, cost.kernel_calls) == (0, 1)
    assert cost.hbm_bytes == 2 * 4 * 256 * 16 * 2 + 256 * 128 * 4 + 4 * 256 * 16 * 2 + 2 * COPY


def test_a_computation_on_another_execution_thread_ends_where_its_brace_closes():
    """TPU v6e's compiler puts some copies on its SparseCore: their computation closes with
    `}, execution_thread="sparsecore"` (seen in qwen7b_v6e's update); the module's computations after it, the entry
    among them, still parse."""
    sparse = """
%called_computation.9 (p: f32[4097]) -> f32[4097] {
  %p = f32[4097]{0:T(1024)} parameter(0)
  ROOT %c = f32[4097]{0:T(1024)} copy(%p), backend_config={"window_config":{"output_window_bounds":["320"]}}
}, execution_thread="sparsecore"
"""
    text = module(sparse, entry="  %r = f32[8,32]{1,0:T(8,128)} dot(%x, %w), lhs_contracting_dims={1}, "
                                "rhs_contracting_dims={0}")
    parsed = hlo_text.parse_module(text)
    assert (parsed.entry, sorted(parsed.computations)) == ("main", ["called_computation.9", "main"])
    assert roofline.hlo_costs(text) == HloCost(flops=DOT_FLOPS, hbm_bytes=DOT_BYTES + COPY)


@pytest.mark.parametrize("groups, n", [
    ("{{0,1,2,3},{4,5,6,7}}", 4), ("[4,2]<=[8]", 2), ("[2,4]<=[4,2]T(1,0)", 4), ("{}", 8), (None, 8),
    ("mesh['axis_0'=4,'axis_1'=2] {'axis_0'}", 4), ("mesh['x'=4,'y'=2] {'x','y'}", 8),
    ("mesh['x'=8,'y'=2] {'x':(2)4}", 4), ("mesh['x'=2,'y'=4], device_ids=([[0,2,4,6],[1,3,5,7]]) {'y'}", 4)])
def test_group_sizes_of_every_replica_groups_form(groups, n):
    assert roofline.group_size(groups, devices=8) == n


def test_collectives_count_the_bytes_each_chip_sends():
    """all-gather: output x (n-1)/n; all-reduce: 2 x bytes x (n-1)/n; reduce-scatter: output x (n-1); all-to-all:
    bytes x (n-1)/n; collective-permute: its bytes. An asynchronous pair counts once, with the groups of its
    start; a combined all-gather (tuple output) counts every output."""
    entry = """  %a = bf16[128,64]{1,0} parameter(3)
  %ag = bf16[512,64]{1,0:T(8,128)(2,1)S(3)} all-gather(%a), channel_id=1, \
replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}, dimensions={0}, use_global_device_ids=true
  %ags = ((bf16[128,64]{1,0}, f32[16]{0}), (bf16[256,64]{1,0}, f32[32]{0})) all-gather-start(%a, %v), \
channel_id=2, replica_groups={{0,1},{2,3},{4,5},{6,7}}, dimensions={0}
  %agd = (bf16[256,64]{1,0}, f32[32]{0}) all-gather-done(%ags)
  %v = f32[16]{0} parameter(4)
  %ar = f32[16]{0} all-reduce(%v), channel_id=3, replica_groups=[1,8]<=[8], to_apply=%sum
  %rs = f32[2]{0} reduce-scatter(%v), channel_id=4, replica_groups={}, dimensions={0}, to_apply=%sum
  %a2a = f32[16]{0} all-to-all(%v), channel_id=5, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}
  %cps = (f32[16]{0}, f32[16]{0}, u32[]{:S(2)}, u32[]{:S(2)}) collective-permute-start(%v), channel_id=6, \
source_target_pairs={{0,1},{1,0}}
  %cpd = f32[16]{0} collective-permute-done(%cps)
  %r = f32[8,32]{1,0} copy(%x)"""
    reducer = """
%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}
"""
    text = module(reducer, entry=entry).replace("HloModule test,", "HloModule test, num_partitions=8,")
    cost = roofline.hlo_costs(text)
    assert cost.collective_bytes == {
        "all-gather": 512 * 64 * 2 * 3 / 4 + (256 * 64 * 2 + 32 * 4) / 2, "all-reduce": 2 * 64 * 7 / 8,
        "reduce-scatter": 8 * 7, "all-to-all": 64 * 3 / 4, "collective-permute": 64}
    assert cost.ici_bytes == sum(cost.collective_bytes.values())
    assert cost.flops == 0
    # Their runs by ring steps in series (none in a loop of run-time length): the all-gather and the all-to-all over
    # 4 chips 3 each, the pair's all-gather over 2 and the permute 1 each, the all-reduce over 8 2 x 7, the
    # reduce-scatter over 8 7.
    assert cost.collective_runs == {(False, 3): 2, (False, 1): 2, (False, 14): 1, (False, 7): 1}


def test_mesh_groups_with_iota_device_ids_are_read_whole():
    """A rollout mesh of one host's chips (data 2 x tensor 2) numbers its devices by an iota with a transpose,
    whose parentheses nest inside device_ids (seen in the prefill of qwen3b_v4 at rollout.tensor_parallel=2)."""
    entry = """  %v = f32[16]{0} parameter(0)
  %a2a = f32[16]{0} all-to-all(%v), channel_id=40, replica_groups=mesh['axis_0'=2,'axis_1'=1,'axis_2'=1,\
'axis_3'=2], device_ids=([2,2]T(1,0)) {'axis_0'}, dimensions={0}
  %r = f32[8,32]{1,0} copy(%x)"""
    text = module(entry=entry).replace("HloModule test,", "HloModule test, num_partitions=4,")
    assert roofline.hlo_costs(text).collective_bytes == {"all-to-all": 64 / 2}


def test_shapes_of_every_element_type_tuples_and_memory_spaces_parse():
    text = ("((pred[3]{0}, s8[2,2]{1,0}, u8[4]), s32[]{:T(128)}, u32[2], f32[16,4096,3584]{2,1,0:T(8,128)}, "
            "bf16[16,4096,3584]{2,1,0:T(8,128)(2,1)S(3)}, f16[2], s64[2], f64[2], s4[6], f8e4m3fn[4], c64[1], "
            "token[], s32[<=8])")
    arrays = hlo_text.parse_shape(text)
    assert [a.dtype for a in arrays] == ["pred", "s8", "u8", "s32", "u32", "f32", "bf16", "f16", "s64", "f64", "s4",
                                         "f8e4m3fn", "c64", "token", "s32"]
    assert [a.nbytes for a in arrays] == [3, 4, 4, 4, 8, 16 * 4096 * 3584 * 4, 16 * 4096 * 3584 * 2, 4, 16, 16, 3,
                                          4, 8, 0, 32]
    assert arrays[6] == Array("bf16", (16, 4096, 3584), 3) and arrays[6].hbm_bytes == 0
    assert arrays[5].hbm_bytes == arrays[5].nbytes


def test_roofline_is_the_larger_of_compute_and_memory_plus_the_collectives():
    peaks = roofline.ChipPeaks(flops=100.0, hbm_bandwidth=10.0, ici_bandwidth=1.0, source="test")
    compute = roofline.roofline_seconds(HloCost(flops=500.0, hbm_bytes=20.0, collective_bytes={"all-gather": 1.0}),
                                        peaks)
    assert compute == roofline.Estimate(compute_s=5.0, memory_s=2.0, collective_s=1.0, seconds=6.0, bound="compute")
    memory = roofline.roofline_seconds(HloCost(flops=100.0, hbm_bytes=30.0), peaks)
    assert (memory.seconds, memory.bound) == (3.0, "memory")
    ici = roofline.roofline_seconds(HloCost(collective_bytes={"all-reduce": 3.0, "all-gather": 1.0}), peaks)
    assert (ici.seconds, ici.bound) == (4.0, "collective")


def test_peaks_of_every_generation_with_their_sources():
    assert set(roofline.PEAKS) == {"v4", "v5e", "v5p", "v6e"}
    assert {g: p.flops for g, p in roofline.PEAKS.items()} == {"v4": 275e12, "v5e": 197e12, "v5p": 459e12,
                                                                "v6e": 918e12}
    for gen, peaks in roofline.PEAKS.items():
        assert f"cloud.google.com/tpu/docs/{gen}" in peaks.source
        assert 500e9 < peaks.hbm_bandwidth < 3e12 and 100e9 < peaks.ici_bandwidth < peaks.hbm_bandwidth

# ----- programs compiled by XLA's TPU compiler -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def chips():
    """The 4 abstract chips of a v4:2x2x1 slice (XLA's TPU compiler runs here; nothing runs on a TPU), with the
    persistent compilation cache off while the module's TPU programs compile (this machine never runs them)."""
    pytest.importorskip("libtpu")
    from llds_jax.aot.compile_check import no_persistent_cache_writes, topology_devices

    jax.config.update("jax_platforms", "cpu")
    with no_persistent_cache_writes():
        yield topology_devices("v4:2x2x1")[0]


M, K = 256, 512


def compile_layers(device, layers: int):
    """x [M, K] through `layers` scanned layers h = tanh(h @ w_l), w [L, K, K] (bfloat16), for one TPU chip."""
    one = jax.sharding.SingleDeviceSharding(device)

    def f(x_mk, w_lkk):
        return jax.lax.scan(lambda h_mk, w_kk: (jnp.tanh(h_mk @ w_kk), None), x_mk, w_lkk)[0]

    return jax.jit(f).lower(jax.ShapeDtypeStruct((M, K), jnp.bfloat16, sharding=one),
                            jax.ShapeDtypeStruct((layers, K, K), jnp.bfloat16, sharding=one)).compile()


def test_a_scan_over_layers_counts_every_layer_where_cost_analysis_counts_one(chips):
    per_layer = 2 * M * K * K
    xla, ours = {}, {}
    for layers in (2, 8):
        compiled = compile_layers(chips[0], layers)
        xla[layers] = compiled.cost_analysis()["flops"]
        cost = roofline.hlo_costs(compiled.as_text())
        ours[layers] = cost.flops
        assert cost.flops == pytest.approx(per_layer * layers, rel=0.01)
        assert cost.dynamic_loops == 0
        # Every layer reads its [K, K] weights from HBM once: the stack's bytes, not L times them.
        assert layers * K * K * 2 <= cost.hbm_bytes < layers * K * K * 2 + 4 * M * K * 2
    assert xla[8] == pytest.approx(xla[2], rel=0.1)  # XLA's own analysis: one layer, whatever L
    assert ours[8] == pytest.approx(4 * ours[2])


def test_a_fori_loop_with_a_traced_bound_uses_the_dynamic_trip_count(chips):
    one = jax.sharding.SingleDeviceSharding(chips[0])

    def f(x_mk, w_kk, steps):
        return jax.lax.fori_loop(0, steps, lambda i, h_mk: jnp.tanh(h_mk @ w_kk), x_mk)

    compiled = jax.jit(f).lower(jax.ShapeDtypeStruct((M, K), jnp.bfloat16, sharding=one),
                                jax.ShapeDtypeStruct((K, K), jnp.bfloat16, sharding=one),
                                jax.ShapeDtypeStruct((), jnp.int32, sharding=one)).compile()
    for steps in (1, 32):
        cost = roofline.hlo_costs(compiled.as_text(), dynamic_trip_count=steps)
        assert cost.flops == pytest.approx(2 * M * K * K * steps, rel=0.01)
        assert cost.dynamic_loops == 1


def test_an_all_gather_of_a_sharded_table_sends_three_quarters_of_it(chips):
    """A [512, 64] bfloat16 table sharded over 4 chips, gathered whole: each chip receives the 3/4 it lacks."""
    mesh = jax.sharding.Mesh(np.array(chips), ("x",))
    sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x", None))
    compiled = jax.jit(lambda w: w * 2, out_shardings=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
                       ).lower(jax.ShapeDtypeStruct((512, 64), jnp.bfloat16, sharding=sharded)).compile()
    cost = roofline.hlo_costs(compiled.as_text())
    assert cost.collective_bytes == {"all-gather": 512 * 64 * 2 * 3 / 4}
    estimate = roofline.roofline_seconds(cost, roofline.PEAKS["v4"])
    assert estimate.bound == "collective"
    assert math.isclose(estimate.collective_s, 512 * 64 * 2 * 3 / 4 / 300e9)



def test_a_batched_product_reads_its_operands_and_writes_its_result_once(chips):
    """einsum("bmk,bkn->bmn"): XLA's TPU form is a base-dilated convolution over b (one tap per batch element)
    whose operands come through nested bitcast fusions; its HBM traffic is both operands and the result."""
    one = jax.sharding.SingleDeviceSharding(chips[0])
    b, m, k, n = 4, 128, 256, 384
    compiled = jax.jit(lambda a_bmk, w_bkn: jnp.einsum("bmk,bkn->bmn", a_bmk, w_bkn)).lower(
        jax.ShapeDtypeStruct((b, m, k), jnp.bfloat16, sharding=one),
        jax.ShapeDtypeStruct((b, k, n), jnp.bfloat16, sharding=one)).compile()
    cost = roofline.hlo_costs(compiled.as_text())
    assert cost.flops == 2 * b * m * k * n
    assert cost.hbm_bytes == 2 * (b * m * k + b * k * n + b * m * n)
