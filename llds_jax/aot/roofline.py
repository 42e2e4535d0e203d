"""Roofline step-time ESTIMATES for `--mode=compile`, read from a compiled TPU program's HLO text.

XLA's `compiled.cost_analysis()` counts a while loop's body once, so a `jax.lax.scan` over 28 layers reports the
FLOPs of one layer. `hlo_costs` reads `compiled.as_text()` instead and multiplies every computation by how many
times it runs: a loop's trip count (the `known_trip_count` XLA may write in the while's backend_config, else the
one its condition, initial value and increment imply; else `dynamic_trip_count`), nested loops multiplied. From
the FLOPs, HBM bytes and inter-chip (ICI) bytes of one chip, `roofline_seconds` estimates a run's time on one TPU
generation (`PEAKS`) and names what bounds it.

These are ESTIMATES, not measurements, nor predictions of wall time: peak rates are never reached, bytes are
logical sizes (no tiling padding), only matrix products (dot, convolution) count as FLOPs (not those inside
Pallas kernels such as splash attention: `HloCost.kernel_calls` counts those kernels), and a collective's time
assumes all of a chip's ICI bandwidth serves it. They compare programs and configs, and say which resource bounds
each.

The HLO text is parsed by `llds_jax.aot.hlo_text`, which says what it reads.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Optional, Sequence, Union

from llds_jax.aot.hlo_text import Computation, Instruction, Module, array_bytes, hbm_bytes, parse_module

# ----- chips ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ChipPeaks:
    """Peak rates of one TPU chip (all its TensorCores).

    Attributes:
      flops: dense bf16 matrix FLOP/s.
      hbm_bandwidth: HBM bytes/s.
      ici_bandwidth: inter-chip interconnect bytes/s a chip sends and receives, all links together (the
        bidirectional per-chip figure): a collective over one torus axis uses only some links, so times from it
        are optimistic.
      source: where the figures come from.
    """

    flops: float
    hbm_bandwidth: float
    ici_bandwidth: float
    source: str


_DOCS = "https://cloud.google.com/tpu/docs/"
PEAKS: dict[str, ChipPeaks] = {
    "v4": ChipPeaks(275e12, 1200e9, 300e9, f"{_DOCS}v4 (275 TFLOP/s bf16, HBM2 1200 GBps); ICI: the page gives no "
                    "per-chip figure, assumed 6 links x 50 GB/s (TPU v4 paper, Jouppi et al., ISCA 2023)"),
    "v5e": ChipPeaks(197e12, 819e9, 400e9, f"{_DOCS}v5e (197 TFLOP/s bf16, HBM2 819 GBps, bidirectional ICI "
                     "400 GBps per chip)"),
    "v5p": ChipPeaks(459e12, 2765e9, 1200e9, f"{_DOCS}v5p (459 TFLOP/s bf16, HBM2e 2765 GBps, bidirectional ICI "
                     "1200 GBps per chip)"),
    "v6e": ChipPeaks(918e12, 1638e9, 800e9, f"{_DOCS}v6e (918 TFLOP/s bf16, HBM 1638 GBps, bidirectional ICI "
                     "800 GBps per chip)"),
}

# ----- FLOPs ---------------------------------------------------------------------------------------------------------


def _dims_attr(ins: Instruction, key: str) -> list[int]:
    value = ins.attr(key)
    return [int(d) for d in value.strip("{}").split(",") if d] if value else []


def dot_flops(ins: Instruction, comp: Computation) -> float:
    """2 x output elements x contracted elements (the product of the lhs contracting dims) of a `dot`."""
    lhs = comp.instructions[ins.operands[0]].shape[0]
    contracted = math.prod(lhs.dims[d] for d in _dims_attr(ins, "lhs_contracting_dims"))
    return 2.0 * ins.shape[0].elements * contracted


def _window(ins: Instruction, spatial: int) -> list[dict[str, int]]:
    """Per spatial dim of a convolution: size, stride, pad (its low side), lhs_dilate, rhs_dilate (XLA's defaults
    when absent) from `window={size=3x3 stride=2x2 pad=1_1x1_1 lhs_dilate=...}`."""
    fields = {key: value.split("x") for key, value in
              (item.split("=", 1) for item in (ins.attr("window") or "{}").strip("{}").split())}

    def get(key: str, d: int, default: int) -> int:
        return int(fields[key][d].split("_")[0]) if key in fields else default

    return [{"size": get("size", d, 1), "stride": get("stride", d, 1), "pad": get("pad", d, 0),
             "lhs_dilate": get("lhs_dilate", d, 1), "rhs_dilate": get("rhs_dilate", d, 1)} for d in range(spatial)]


def _window_taps(size_in: int, size_out: int, w: dict[str, int]) -> int:
    """Pairs (output position, window tap) of one spatial dim whose input position is a real element of the
    (lhs-dilated, padded) input: the multiply-adds along that dim."""
    dilate, stride = w["lhs_dilate"], w["stride"]
    last = (size_in - 1) * dilate
    period = dilate // math.gcd(stride, dilate)
    taps = 0
    for k in range(w["size"]):
        offset = k * w["rhs_dilate"] - w["pad"]  # input position of output x: x * stride + offset
        lo = max(0, -(offset // stride))         # smallest x with position >= 0
        hi = min(size_out - 1, (last - offset) // stride) if last >= offset else -1
        for x0 in range(lo, min(lo + period, hi + 1)):
            if (x0 * stride + offset) % dilate == 0:
                taps += (hi - x0) // period + 1
    return taps


def convolution_flops(ins: Instruction, comp: Computation) -> float:
    """2 x multiply-adds of a `convolution`: output batch x output features x kernel input features x, per
    spatial dim, the window taps that hit real input elements (`_window_taps`; a batched matrix product written
    as a base-dilated convolution counts its batch once, not window-size times)."""
    lhs = comp.instructions[ins.operands[0]].shape[0]
    rhs = comp.instructions[ins.operands[1]].shape[0]
    out = ins.shape[0]
    lhs_labels, rest = ins.attr("dim_labels").split("_", 1)
    rhs_labels, out_labels = rest.split("->")
    spatial = sum(c.isdigit() for c in lhs_labels)
    taps = math.prod(_window_taps(lhs.dims[lhs_labels.index(str(d))], out.dims[out_labels.index(str(d))], w)
                     for d, w in enumerate(_window(ins, spatial)))
    return (2.0 * out.dims[out_labels.index("b")] * out.dims[out_labels.index("f")]
            * rhs.dims[rhs_labels.index("i")] * taps)

# ----- collectives ---------------------------------------------------------------------------------------------------


COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
# Bytes a chip sends (and receives) over ICI per byte of the collective's result, in a group of n chips (ring
# algorithms): an all-gather moves the (n-1)/n of its output it lacks; a reduce-scatter the (n-1) shards of its
# input that are not its output; an all-reduce is a reduce-scatter then an all-gather (2 (n-1)/n); an all-to-all
# keeps 1/n; a collective-permute sends its whole operand once.
_ICI_PER_RESULT_BYTE = {
    "all-gather": lambda n: (n - 1) / n, "reduce-scatter": lambda n: n - 1.0, "all-reduce": lambda n: 2 * (n - 1) / n,
    "all-to-all": lambda n: (n - 1) / n, "collective-permute": lambda n: 1.0,
}


def group_size(replica_groups: Optional[str], devices: int) -> int:
    """Chips in one group of a collective's `replica_groups`: explicit lists "{{0,2},{1,3}}" (the first group's
    length), iota lists "[2,4]<=[8]" (the last dim), mesh axes "mesh['x'=4,'y'=2] {'x'}" (the product of the
    named axes' sizes; a sub-axis "'x':(1)2" its own size); none or "{}": all `devices`."""
    if not replica_groups or replica_groups in ("{}", "{{}}"):
        return devices
    if replica_groups.startswith("{"):
        return len(re.match(r"\{\{([^}]*)\}", replica_groups).group(1).split(","))
    if replica_groups.startswith("["):
        return int(re.match(r"\[([\d,]+)\]", replica_groups).group(1).split(",")[-1])
    mesh = re.match(r"mesh\[([^\]]*)\].*?\{([^}]*)\}\s*$", replica_groups)
    sizes = {name.strip("'"): int(size) for name, size in (a.rsplit("=", 1) for a in mesh.group(1).split(","))}
    n = 1
    for axis in filter(None, (a.strip() for a in mesh.group(2).split(","))):
        sub = re.match(r"(.+?):\(\d+\)(\d+)$", axis)
        n *= int(sub.group(2)) if sub else sizes[axis.strip("'")]
    return n


def _replica_groups(ins: Instruction) -> Optional[str]:
    """replica_groups of a collective; a mesh-axes value runs to its axis list ("mesh[...] {...}")."""
    # device_ids: a list "([[0,2],[1,3]])" or an iota "([2,2]T(1,0))" (parentheses one level deep)
    match = re.search(r"replica_groups=(mesh\[[^\]]*\](?:, device_ids=\((?:[^()]|\([^()]*\))*\))? \{[^}]*\})",
                      ins.attrs)
    return match.group(1) if match else ins.attr("replica_groups")


def collective_group(ins: Instruction, comp: Computation, devices: int) -> tuple[str, int]:
    """(kind, chips in its group) of a collective, counted at its result: a synchronous one, or the `-done` of an
    asynchronous pair (its `-start`, which holds the replica groups, counts nothing); ("", 0) for anything else."""
    kind = ins.opcode[:-len("-done")] if ins.opcode.endswith("-done") else ins.opcode
    if kind not in COLLECTIVES:
        return "", 0
    start = comp.instructions[ins.operands[0]] if ins.opcode.endswith("-done") else ins
    return kind, group_size(_replica_groups(start), devices)


def collective_bytes(ins: Instruction, comp: Computation, devices: int) -> tuple[str, float]:
    """(kind, bytes one chip sends over ICI) of a collective (`collective_group`); ("", 0) for anything else."""
    kind, n = collective_group(ins, comp, devices)
    return (kind, array_bytes(ins.shape) * _ICI_PER_RESULT_BYTE[kind](n)) if kind else ("", 0.0)


# Steps of a ring algorithm over n chips, each one ICI hop after the last (what a collective's latency is counted
# in, `HloCost.collective_runs`): an all-reduce is a reduce-scatter then an all-gather, n - 1 steps each; an
# all-gather, reduce-scatter or all-to-all n - 1; a collective-permute one.
_RING_STEPS = {"all-gather": lambda n: n - 1, "reduce-scatter": lambda n: n - 1, "all-reduce": lambda n: 2 * (n - 1),
               "all-to-all": lambda n: n - 1, "collective-permute": lambda n: 1}


def ring_steps(kind: str, n: int) -> int:
    """Hops in series of one collective of `kind` over `n` chips (`_RING_STEPS`; none within one chip)."""
    return _RING_STEPS[kind](n) if n > 1 else 0

# ----- HBM traffic ---------------------------------------------------------------------------------------------------


# No kernel of their own: no HBM traffic (a while, call or conditional's traffic is its computations').
_NO_TRAFFIC = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "while", "call", "conditional",
               "after-all", "add-dependency", "partition-id", "replica-id", "opt-barrier", "domain"}
_SLICES = {"slice", "dynamic-slice"}


def _through_bitcasts(comp: Computation, name: str) -> Instruction:
    ins = comp.instructions[name]
    while ins.opcode == "bitcast":
        ins = comp.instructions[ins.operands[0]]
    return ins


# Inside a fusion, ops that only map each output element to one input element of the same type: a slice of their
# result reads that slice of their operand (a bitcast; a copy, which inside a fusion changes the layout, e.g. the
# TPU compiler's relayout of an int8 loop state from its (32, 128) tiles to the (8, 128) ones a dot takes).
_INDEX_MAPS = {"bitcast", "copy"}


def _fused_read(module: Module, comp: Computation, name: str, full: float, escape) -> float:
    """Bytes a fusion reads of the value `name` (a fusion parameter, `full` bytes): only what its slices take
    when slices are all that use it (through bitcasts, copies and nested fusions), nothing where it is the buffer a
    dynamic-update-slice writes in place, else all of it. `escape()`: the bytes read when the value is the
    computation's result (all of it for the fusion itself; for a nested fusion, what its caller reads of it)."""
    read = escape() if name == comp.root else 0.0
    for user, position in comp.users(name):
        if user.opcode in _SLICES and position == 0:
            read += array_bytes(user.shape)
        elif user.opcode in _IN_PLACE and position == 0:
            continue
        elif user.opcode in _INDEX_MAPS:
            read += _fused_read(module, comp, user.name, full, escape)
        elif user.opcode == "fusion":
            inner = module.computations[user.called("calls")]
            read += _fused_read(module, inner, inner.parameter(position).name, full,
                                lambda: _fused_read(module, comp, user.name, full, escape))
        else:
            return full
    return min(read, full)


# Ops that update their operand 0 in place: they neither read it whole nor write more than their update.
_IN_PLACE = ("dynamic-update-slice", "scatter")


def _written(module: Module, ins: Instruction, comp: Computation) -> float:
    """HBM bytes an instruction writes: its outputs in HBM, a dynamic-update-slice or scatter (alone or the root of
    a fusion, one per tuple element) only its update."""
    roots, root_comp = [ins], comp
    if ins.opcode == "fusion":
        root_comp = module.computations[ins.called("calls")]
        root = root_comp.instructions[root_comp.root]
        roots = [root_comp.instructions[r] for r in root.operands] if root.opcode == "tuple" else [root]
    if len(roots) != len(ins.shape):
        return hbm_bytes(ins.shape)
    written = 0.0
    for array, root in zip(ins.shape, roots):
        root = _through_bitcasts(root_comp, root.name)
        if root.opcode in _IN_PLACE and array.memory_space == 0:  # the update: a DUS's operand 1, a scatter's last
            update = root.operands[1] if root.opcode == "dynamic-update-slice" else root.operands[-1]
            written += array_bytes(root_comp.instructions[update].shape)
        else:
            written += array.hbm_bytes
    return written


def kernel_hbm_bytes(module: Module, ins: Instruction, comp: Computation) -> float:
    """HBM bytes one run of an instruction that is a kernel of its own moves: the HBM-resident operands it reads
    plus the HBM outputs it writes. Slices read what they take (a fusion too, `_fused_read`), a
    dynamic-update-slice or scatter does not read the buffer it updates and writes only the update; an asynchronous pair
    counts its operands at the `-start` and its results at the `-done`."""
    if ins.opcode in _NO_TRAFFIC:
        return 0.0
    written = 0.0 if ins.opcode.endswith("-start") else _written(module, ins, comp)
    if ins.opcode.endswith("-done"):
        return written
    read = 0.0
    for position, name in enumerate(ins.operands):
        operand = comp.instructions[name].shape
        if ins.opcode in _SLICES | {"slice-start"} and position == 0:
            taken = ins.shape[1:2] if ins.opcode == "slice-start" else ins.shape
            read += array_bytes(taken) if hbm_bytes(operand) else 0.0
        elif ins.opcode in _IN_PLACE and position == 0:
            continue
        elif ins.opcode == "fusion":
            inner = module.computations[ins.called("calls")]
            full = hbm_bytes(operand)
            read += _fused_read(module, inner, inner.parameter(position).name, full, lambda: full) if full else 0.0
        else:
            read += hbm_bytes(operand)
    return read + written

# ----- loops ---------------------------------------------------------------------------------------------------------


def _scalar(comp: Computation, name: str, tuple_value=None) -> Optional[int]:
    """The integer `name` holds when it is a constant (through copies, bitcasts, converts) or, with
    `tuple_value(index)`, an element of the computation's tuple parameter; None otherwise."""
    ins = comp.instructions[name]
    if ins.opcode == "constant":
        return int(ins.args) if re.fullmatch(r"-?\d+", ins.args) else None
    if ins.opcode in ("copy", "bitcast", "convert", "reshape"):
        return _scalar(comp, ins.operands[0], tuple_value)
    if ins.opcode == "get-tuple-element" and tuple_value is not None:
        return tuple_value(int(ins.attr("index")))
    return None


def _tuple_index(comp: Computation, name: str) -> Optional[int]:
    """k when `name` is element k of the computation's parameter (through copies and bitcasts)."""
    ins = comp.instructions[name]
    while ins.opcode in ("copy", "bitcast"):
        ins = comp.instructions[ins.operands[0]]
    if ins.opcode == "get-tuple-element" and comp.instructions[ins.operands[0]].opcode == "parameter":
        return int(ins.attr("index"))
    return None


_FLIP = {"LT": "GT", "LE": "GE", "GT": "LT", "GE": "LE", "NE": "NE"}


def _trip_count(module: Module, loop: Instruction, caller: Computation) -> Optional[int]:
    """Iterations of a while loop: its backend_config's known_trip_count, else the count its shape implies
    (the condition compares element k of the loop tuple with an integer, the body adds an integer to element
    k, its initial value is an integer); None when neither is there (a bound computed at run time)."""
    known = re.search(r'"known_trip_count":\{"n":"(\d+)"', loop.attrs)
    if known:
        return int(known.group(1))
    body = module.computations[loop.called("body")]
    cond = module.computations[loop.called("condition")]
    init = caller.instructions[loop.operands[0]]
    body_root = body.instructions[body.root]
    if init.opcode != "tuple" or body_root.opcode != "tuple":
        return None

    def invariant(index):  # an element the body passes through unchanged: its initial value
        if _tuple_index(body, body_root.operands[index]) != index:
            return None
        return _scalar(caller, init.operands[index])

    compare = cond.instructions[cond.root]
    if compare.opcode != "compare" or len(compare.operands) != 2:
        return None
    direction = compare.attr("direction")
    (a, b), index = compare.operands, _tuple_index(cond, compare.operands[0])
    if index is None:
        a, b, direction, index = b, a, _FLIP.get(direction), _tuple_index(cond, b)
    bound = _scalar(cond, b, invariant)
    if index is None or bound is None or direction is None:
        return None
    start = _scalar(caller, init.operands[index])
    step = _step(body, body_root.operands[index], index, invariant)
    if start is None or not step:
        return None
    span = {"LT": bound - start, "LE": bound - start + 1, "GT": start - bound, "GE": start - bound + 1,
            "NE": bound - start}[direction]
    step = step if direction in ("LT", "LE", "NE") else -step
    if direction == "NE" and span % step:
        return None
    return max(0, -(-span // step))


def _step(body: Computation, update: str, index: int, invariant) -> Optional[int]:
    """The integer the body adds to loop element `index` (`update` is what it writes back), None when it does
    something else."""
    ins = body.instructions[update]
    while ins.opcode in ("copy", "bitcast"):
        ins = body.instructions[ins.operands[0]]
    if ins.opcode not in ("add", "subtract"):
        return None
    a, b = ins.operands
    if _tuple_index(body, a) == index:
        step = _scalar(body, b, invariant)
    elif ins.opcode == "add" and _tuple_index(body, b) == index:
        step = _scalar(body, a, invariant)
    else:
        return None
    return None if step is None else (step if ins.opcode == "add" else -step)

# ----- costs ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class HloCost:
    """What one run of a program does on one chip (ESTIMATES, see the module docstring).

    Attributes:
      flops: matrix FLOPs (2 per multiply-add of every dot and convolution), loops counted as often as they run.
      hbm_bytes: bytes every kernel reads from and writes to HBM.
      collective_bytes: bytes the chip sends over ICI, by collective kind ("all-gather", "all-reduce",
        "reduce-scatter", "all-to-all", "collective-permute").
      dynamic_loops: while loops (each once, however often it runs) whose trip count the HLO does not fix: each
        was counted as running `dynamic_trip_count` times.
      kernel_calls: runs of Pallas (Mosaic) kernels, `tpu_custom_call`s such as splash attention: their HBM bytes
        count (operands and outputs), their FLOPs are not in the HLO and do not.
      collective_runs: runs of collectives by (whether inside a loop of run-time length, hops in series of one run:
        `ring_steps`), loops counted as often as they run (a loop of run-time length `dynamic_trip_count` times, its
        condition once more).
    """

    flops: float = 0.0
    hbm_bytes: float = 0.0
    collective_bytes: dict[str, float] = dataclasses.field(default_factory=dict)
    dynamic_loops: int = 0
    kernel_calls: float = 0.0
    collective_runs: dict[tuple[bool, int], float] = dataclasses.field(default_factory=dict)

    def __add__(self, other: "HloCost") -> "HloCost":
        return HloCost(self.flops + other.flops, self.hbm_bytes + other.hbm_bytes,
                       _merge(self.collective_bytes, other.collective_bytes, lambda a, b: a + b),
                       self.dynamic_loops + other.dynamic_loops, self.kernel_calls + other.kernel_calls,
                       _merge(self.collective_runs, other.collective_runs, lambda a, b: a + b))

    def times(self, runs: float) -> "HloCost":
        """The cost of `runs` runs (dynamic_loops unchanged: it counts loops, not runs)."""
        return HloCost(self.flops * runs, self.hbm_bytes * runs,
                       {k: v * runs for k, v in self.collective_bytes.items()}, self.dynamic_loops,
                       self.kernel_calls * runs, {k: v * runs for k, v in self.collective_runs.items()})

    def most(self, other: "HloCost") -> "HloCost":
        """Field by field the larger of two costs (an upper bound of either)."""
        return HloCost(max(self.flops, other.flops), max(self.hbm_bytes, other.hbm_bytes),
                       _merge(self.collective_bytes, other.collective_bytes, max),
                       max(self.dynamic_loops, other.dynamic_loops), max(self.kernel_calls, other.kernel_calls),
                       _merge(self.collective_runs, other.collective_runs, max))

    @property
    def ici_bytes(self) -> float:
        """All collectives' bytes together."""
        return sum(self.collective_bytes.values())


def _merge(a: dict, b: dict, how) -> dict:
    """`how(a[k], b[k])` for every key of either (0 where one lacks it)."""
    return {k: how(a.get(k, 0.0), b.get(k, 0.0)) for k in {**a, **b}}


class _Walker:
    """Costs of the computations of a module, memoized by (computation, whether its instructions are kernels, how
    many loops of run-time length it runs inside)."""

    def __init__(self, module: Module, dynamic_trip_counts: Sequence[float]):
        self.module = module
        self.dynamic_trip_counts = dynamic_trip_counts
        self.memo: dict[tuple[str, bool, int], HloCost] = {}

    def computation(self, name: str, kernels: bool, depth: int = 0) -> HloCost:
        """One run of a computation: the sum of its instructions; HBM bytes only when its instructions are
        kernels (not in a fusion body). `depth`: the dynamic loops it runs inside."""
        if (name, kernels, depth) not in self.memo:
            comp = self.module.computations[name]
            total = HloCost()
            for ins in comp.instructions.values():
                total = total + self.instruction(ins, comp, kernels, depth)
            self.memo[name, kernels, depth] = total
        return self.memo[name, kernels, depth]

    def instruction(self, ins: Instruction, comp: Computation, kernels: bool, depth: int = 0) -> HloCost:
        """One run of an instruction with what it calls: a while's body `trips` times and its condition
        `trips + 1` times, a conditional's costliest branch (field by field), a call's computation once, a fusion's
        or async wrapper's computation once for FLOPs and collectives (its HBM traffic is the instruction's)."""
        flops = {"dot": dot_flops, "convolution": convolution_flops}.get(ins.opcode)
        kind, ici = collective_bytes(ins, comp, self.module.devices)
        runs = {(depth > 0, ring_steps(kind, collective_group(ins, comp, self.module.devices)[1])): 1.0} if kind else {}
        cost = HloCost(flops=flops(ins, comp) if flops else 0.0,
                       hbm_bytes=kernel_hbm_bytes(self.module, ins, comp) if kernels else 0.0,
                       collective_bytes={kind: ici} if kind else {},
                       kernel_calls=float(ins.opcode == "custom-call" and '"tpu_custom_call"' in ins.attrs),
                       collective_runs=runs)
        if ins.opcode == "while":
            trips = _trip_count(self.module, ins, comp)
            inner = depth + (trips is None)
            runs = self.dynamic_trip_counts[min(depth, len(self.dynamic_trip_counts) - 1)] if trips is None else trips
            cost = cost + self.computation(ins.called("body"), kernels, inner).times(runs)
            cost = cost + self.computation(ins.called("condition"), kernels, inner).times(runs + 1)
            cost = cost + HloCost(dynamic_loops=int(trips is None))
        elif ins.opcode == "conditional":
            branches = ins.attr("branch_computations")
            names = (re.findall(r"%?([^\s,{}]+)", branches) if branches
                     else [ins.called("true_computation"), ins.called("false_computation")])
            worst = HloCost()
            for name in names:
                worst = worst.most(self.computation(name, kernels, depth))
            cost = cost + worst
        elif ins.opcode == "call":
            cost = cost + self.computation(ins.called("to_apply"), kernels, depth)
        elif ins.opcode == "fusion" or (ins.opcode.endswith("-start") and ins.called("calls")):
            cost = cost + self.computation(ins.called("calls"), False, depth)
        return cost


def hlo_costs(hlo_text: str, dynamic_trip_count: Union[float, Sequence[float]] = 1) -> HloCost:
    """FLOPs, HBM bytes and ICI bytes per chip of one run of a compiled program, from its HLO text
    (`compiled.as_text()`), every computation counted as often as it runs.

    Args:
      hlo_text: the optimized HLO of one program (per chip: SPMD-partitioned).
      dynamic_trip_count: iterations assumed for a while loop whose trip count the HLO does not fix (a decode
        chunk's steps, a `fori_loop` with a traced bound); a sequence gives them by nesting: its first entry for
        such loops inside no other, the second for those inside one (a loop over key blocks bounded at run time
        inside a decode loop), and so on, the last for any deeper. A loop's cost is linear in its count, so a
        mean count gives the mean cost.
    """
    module = parse_module(hlo_text)
    counts = [dynamic_trip_count] if isinstance(dynamic_trip_count, (int, float)) else list(dynamic_trip_count)
    return _Walker(module, counts).computation(module.entry, kernels=True)

# ----- time ----------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Estimate:
    """A roofline ESTIMATE of one run's seconds on one chip: every resource at its peak rate, compute overlapping
    HBM traffic, collectives overlapping neither.

    Attributes:
      compute_s: FLOPs / peak FLOP/s.
      memory_s: HBM bytes / HBM bytes/s.
      collective_s: ICI bytes / ICI bytes/s.
      seconds: max(compute_s, memory_s) + collective_s (XLA overlaps some asynchronous collectives with
        compute; there this is pessimistic).
      bound: which term is largest: "compute", "memory" or "collective".
    """

    compute_s: float
    memory_s: float
    collective_s: float
    seconds: float
    bound: str


def roofline_seconds(cost: HloCost, peaks: ChipPeaks) -> Estimate:
    """The roofline estimate of a program's time per run (seconds) from its `hlo_costs` on one chip."""
    compute = cost.flops / peaks.flops
    memory = cost.hbm_bytes / peaks.hbm_bandwidth
    collective = cost.ici_bytes / peaks.ici_bandwidth
    terms = {"compute": compute, "memory": memory, "collective": collective}
    return Estimate(compute, memory, collective, max(compute, memory) + collective, max(terms, key=terms.get))
