"""The text of a compiled XLA program (`compiled.as_text()`) parsed into modules, computations, instructions and
array shapes, for the roofline estimates of `llds_jax.aot.roofline`.

The HLO text this reads (TPU programs from libtpu 0.0.42, Dec 2026):
- Layouts carry a memory space, `bf16[256,512]{1,0:T(8,128)(2,1)S(3)}`: S(0) (no S) is HBM; the others are not
  (the on-chip memory XLA's memory-space assignment moves arrays into: S(1) on v5e, S(3) on v4; S(2) sync flags,
  S(6) scalars), so their bytes are no HBM traffic.
- Compiled while loops carry no `known_trip_count`: `llds_jax.aot.roofline` infers the count from the loop.
- Matrix products are mostly `convolution`s (`dim_labels=bf_io->bf`); a batched one is a base-dilated
  convolution over the batch (`window={size=4 stride=3 lhs_dilate=4}, dim_labels=0bf_0io->0bf`) or a padded one
  (`window={size=4 pad=3_3 rhs_reversal=1}`), where only the window taps that hit real input elements are
  multiply-adds.
- replica_groups come as explicit lists `{{0,2},{1,3}}`, iota lists `[2,2]<=[4]` or mesh axes
  `mesh['axis_0'=4,'axis_1'=1] {'axis_0'}`.
- A Pallas kernel's attributes (kernel_metadata) span several lines.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Iterable, Optional


# ----- shapes --------------------------------------------------------------------------------------------------------
# One array of a shape: element type, dims (bounded dynamic dims "<=8" read as their bound), optional layout.
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\](?:\{([^{}]*)\})?")
_MEMORY_SPACE = re.compile(r"S\((\d+)\)")


@dataclasses.dataclass(frozen=True)
class Array:
    """One array of an HLO shape: element type ("bf16"), dims, memory space (0: HBM)."""

    dtype: str
    dims: tuple[int, ...]
    memory_space: int = 0

    @property
    def elements(self) -> int:
        return math.prod(self.dims)

    @property
    def nbytes(self) -> float:
        """Logical bytes (elements x element size; no tiling padding): a type's bits are the first number in its
        name (bf16: 16, s4: 4, f8e4m3fn: 8, c64: 64), pred is 1 byte, token and opaque are none."""
        if self.dtype == "pred":
            return float(self.elements)
        bits = re.search(r"\d+", self.dtype)
        return self.elements * int(bits.group()) / 8 if bits else 0.0

    @property
    def hbm_bytes(self) -> float:
        """`nbytes` when the array lives in HBM (memory space 0), else 0."""
        return self.nbytes if self.memory_space == 0 else 0.0


def parse_shape(text: str) -> list[Array]:
    """The arrays of an HLO shape, tuples flattened in order: "(s32[], bf16[8,512]{1,0:T(8,128)(2,1)S(3)})" ->
    [Array("s32", ()), Array("bf16", (8, 512), 3)]."""
    arrays = []
    for dtype, dims, layout in _ARRAY.findall(text):
        space = _MEMORY_SPACE.search(layout or "")
        arrays.append(Array(dtype, tuple(int(d.lstrip("<=")) for d in dims.split(",") if d),
                            int(space.group(1)) if space else 0))
    return arrays


def array_bytes(arrays: Iterable[Array]) -> float:
    """Bytes of `arrays`, wherever they live."""
    return sum(a.nbytes for a in arrays)


def hbm_bytes(arrays: Iterable[Array]) -> float:
    """Bytes of those of `arrays` in HBM (memory space 0)."""
    return sum(a.hbm_bytes for a in arrays)

# ----- HLO text ------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One HLO instruction: `%name = SHAPE opcode(ARGS), ATTRS`. `operands`: names of the instructions in ARGS;
    `args`: ARGS verbatim (a parameter's number, a constant's value)."""

    name: str
    shape: tuple[Array, ...]
    opcode: str
    operands: tuple[str, ...]
    args: str
    attrs: str

    def attr(self, key: str) -> Optional[str]:
        """The value of `key=VALUE` among the attributes (a bracketed value whole), None when absent."""
        match = re.search(r"(?:^|[\s,])" + re.escape(key) + r"=", self.attrs)
        if match is None:
            return None
        return _balanced(self.attrs, match.end())[0]

    def called(self, key: str) -> Optional[str]:
        """The computation named by `key=%comp` (calls, body, condition, to_apply), None when absent."""
        value = self.attr(key)
        return value.lstrip("%") if value else None


@dataclasses.dataclass
class Computation:
    """The instructions of one computation in text order, by name; `root` names its ROOT."""

    name: str
    instructions: dict[str, Instruction]
    root: str = ""

    def users(self, name: str) -> list[tuple[Instruction, int]]:
        """(instruction, operand position) of every use of `name` in this computation."""
        return [(ins, i) for ins in self.instructions.values() for i, op in enumerate(ins.operands) if op == name]

    def parameter(self, number: int) -> Instruction:
        return next(ins for ins in self.instructions.values()
                    if ins.opcode == "parameter" and int(ins.args) == number)


@dataclasses.dataclass
class Module:
    """A parsed HLO module: its computations by name, the entry's name, and its devices (num_partitions x
    replica_count), the group of a collective without replica_groups."""

    computations: dict[str, Computation]
    entry: str
    devices: int


_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([^\s(]+)\s*\(.*\{\s*$")
# A computation's closing line: "}", or on TPU v6e's SparseCore "}, execution_thread="sparsecore"".
_END = re.compile(r'^\}(,\s*execution_thread="\w+")?\s*$')
_INSTRUCTION = re.compile(r"^\s+(ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$", re.S)
_OPENERS = {"(": ")", "{": "}", "[": "]"}
_QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"')


def _balanced(text: str, start: int) -> tuple[str, int]:
    """The token of `text` from `start` up to a space or comma outside brackets (or to the bracket closing one
    that opened at `start`): ("{{0,1},{2,3}}", end)."""
    depth, i = 0, start
    while i < len(text):
        c = text[i]
        if c in _OPENERS:
            depth += 1
        elif c in ")}]":
            if depth == 0:
                break
            depth -= 1
            if depth == 0 and text[start] in _OPENERS:
                return text[start:i + 1], i + 1
        elif c in " ," and depth == 0:
            break
        elif c == '"':  # a quoted string: skip to its end
            i = _QUOTED.match(text, i).end() - 1
        i += 1
    return text[start:i], i


def _depth(text: str) -> int:
    """Brackets opened and not closed in `text`, quoted strings skipped: an instruction whose attributes run over
    several lines (a Pallas kernel's kernel_metadata) is unbalanced until its last line."""
    unquoted = _QUOTED.sub("", text)
    return sum(unquoted.count(c) for c in _OPENERS) - sum(unquoted.count(c) for c in _OPENERS.values())


def _parse_instruction(name: str, rest: str) -> Instruction:
    shape, i = _balanced(rest, 0)
    opcode = re.match(r"\s*([\w\-]+)\(", rest[i:])
    args_start = i + opcode.end() - 1
    args, end = _balanced(rest, args_start)
    return Instruction(name=name, shape=tuple(parse_shape(shape)), opcode=opcode.group(1),
                       operands=tuple(re.findall(r"%([^\s,()]+)", args)), args=args[1:-1],
                       attrs=rest[end:].lstrip(", "))


def parse_module(hlo_text: str) -> Module:
    """Computations of HLO text (`compiled.as_text()`); lines outside computations (the header, stack frame
    tables) are skipped."""
    computations: dict[str, Computation] = {}
    entry, current, pending = "", None, ""
    for line in hlo_text.splitlines():
        if current is None:
            match = _COMPUTATION.match(line)
            if match:
                current = Computation(match.group(2), {})
                computations[current.name] = current
                entry = current.name if match.group(1) else entry
            continue
        if not pending and _END.match(line):
            current = None
            continue
        pending = f"{pending}\n{line}" if pending else line
        if _depth(pending) > 0:
            continue
        match = _INSTRUCTION.match(pending)
        if match:
            ins = _parse_instruction(match.group(2), match.group(3))
            current.instructions[ins.name] = ins
            current.root = ins.name if match.group(1) else current.root
        pending = ""
    header = hlo_text.split("\n", 1)[0]
    devices = math.prod(int(n) for n in re.findall(r"\b(?:num_partitions|replica_count)=(\d+)", header))
    return Module(computations, entry, devices)
