"""`--mode=compile`: every program of a run compiled ahead of time for a TPU pod topology, on this (CPU) machine.

    python -m llds_jax.launch --config=configs/qwen7b_v4.py --mode=compile [--topology=v4:2x2x4]

XLA's TPU compiler (the `libtpu` wheel of `jax[tpu]`) compiles for a deviceless topology
(`jax.experimental.topologies`) and reports each program's memory per chip, so a config is checked against its pod
before the pod is rented, the way MaxText's train_compile does. No weights are read: the model is abstract
(ShapeDtypeStructs carrying the run's real shardings); its architecture comes from `model.preset` or from
`config.json` in `model.path`.

The programs, at the config's largest shapes (the worst case a long run can reach):
- the rollout's copy of the params, when it has a layout of its own (`rollout.tensor_parallel`, or several hosts):
  the reshard program that builds it from the training params over the chips' links (every host's copy at once on
  several hosts; `rollout.layout.reshard_program`), once per step;
- rollout (each host's own chips with several hosts, as the trainer runs it): the engine's step program at every
  token bucket (`rollout.runner`: a ragged batch of prompt and observation chunks and decoding sequences over the
  page pool, `rollout.max_batch_size` sequence slots or the host's whole share of the rollout batch); the same for
  evaluation (greedy, `eval.batch_size` slots); the page pool, shared by both, resident beside every program; their
  params in `rollout.params_dtype`, as the trainer casts them (with bfloat16 on float32 master weights, half the
  bytes);
- the retriever's programs on each host's chips, at every shape its calls can reach (a call holds at most the
  searches of the sequences in flight, one each: the larger engine's slots, training's or evaluation's): with
  `retriever.backend = "e5_device"` the search (`search.device_search.reachable_shapes`: every batch bucket up to
  `retriever.search_batch` at every candidate count of its passes, for the rollout's top k and the start-up
  check's); with an e5 encoder on the chips (e5_device, faiss, elasticsearch with `encoder_path`) the query
  encoder on the host's first chip (`search.e5.reachable_shapes`: every batch bucket up to
  `retriever.encoder_batch_size` at every length bucket up to `retriever.max_length`);
- training (every chip): optimizer init, the reference copy, the frozen log-probs under the policy and the
  reference, the likelihood metrics, one optimizer update with all its micro-batches and the LLD metrics, at the
  longest training batch (`rollout.max_context_tokens` rounded up to `train.sequence_bucket`).

Memory per chip of a program = its arguments + outputs - aliased (donated) + temporaries + code, plus the arrays a
run keeps alive meanwhile that are not its arguments ("resident": train state, reference parameters). A program
over the chip's HBM (as XLA reports it usable: a little under the nominal size) is an error: the command prints
the table and exits with status 1, naming the program and the GiB over. So is a program that all-gathers a whole
[V, D] vocabulary table, or a rollout program whose collectives move a layer's weights (`weight_collectives`: an
all-gather, all-to-all, collective-permute or reduce-scatter with a weight-shaped operand or result, one layer's or
the stacked layers'; the rollout copy is not split over the chips, `rollout.tensor_parallel`).

When every program fits, the command also prints estimated step times (`llds_jax.aot.step_estimate`), the paged
engine's only: the training programs' roofline times read from their HLO (`llds_jax.aot.roofline`) times their calls
per step, and the rollout as the engine schedules it (`llds_jax.aot.rollout_schedule`: its step calls per token
bucket, each costed at its tokens) with retrieval where it blocks, at the worst case and at expected lengths
(`llds_jax.aot.step_lengths`: a run's logged ones with `--estimate_from=RUN_DIR`, whose logged step calls are printed
beside the predicted ones, else stated defaults).
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import math
import os
import re
import time
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

from llds_jax import checks, parallel, topologies
from llds_jax.aot import beside, measured, rollout_schedule, roofline, step_estimate, step_lengths
from llds_jax.aot.compiled import (ENCODER, INDEX, OPT_STATE, PAGE_POOL, PARAMS, REFERENCE, SESSION, UNITS, Program, Row,
                                  format_bytes)
from llds_jax.aot.retriever_programs import encoder_programs, retriever_lines, search_programs
from llds_jax.train import run_builder
from llds_jax.config.sections import RunConfig
from llds_jax.programs import Role
from llds_jax.rl.train_step import TrainShapes
from llds_jax.train.batching import round_up
from llds_jax.rollout.config import KernelTiles, PagingConfig, SamplingConfig
from llds_jax.rollout.layout import abstract_rollout_params, reshard_program
from llds_jax.rollout.runner import decode_batches

GIB = 1 << 30
PLACEHOLDER_STOP_IDS = (0, 1)  # the samplers' turn stops: the tokenizer's do not change a program's shapes
EXIT_DOES_NOT_FIT = 1


class CompilerUnavailableError(RuntimeError):
    """XLA's TPU compiler (the libtpu wheel) is not installed."""


def _host_shape(shape: str) -> tuple[int, int, int]:
    """The chips of one host of a slice `shape` ("2x2x4"), per dimension: hosts of 4 chips, one host up to 8."""
    dims = [int(n) for n in shape.split("x")] + [1] * (3 - len(shape.split("x")))
    return tuple(min(d, b) for d, b in zip(dims, (2, 4 if topologies.shape_chips(shape) <= 8 else 2, 1)))


def topology_devices(name: str) -> tuple[list[Any], float]:
    """The abstract devices (one per chip, hosts of 4 chips; a single host up to 8 chips) of a topology and the
    nominal HBM per chip in bytes. Compiling for them needs `libtpu` (`pip install -e '.[tpu]'`)."""
    gen, shape = topologies.resolve(name)
    g = topologies.GENERATIONS[gen]
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", f"{g.alias}{topologies.shape_chips(shape) * g.cores_per_chip}")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")  # both only silence libtpu's start-up warnings
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compiling only: other libtpu processes may run
    if importlib.util.find_spec("libtpu") is None:
        raise CompilerUnavailableError("--mode=compile needs XLA's TPU compiler, the libtpu wheel: "
                                       "pip install -e '.[tpu]'")
    from jax.experimental import topologies as jax_topologies

    topology = jax_topologies.get_topology_desc(topology_name=f"{gen}:{shape}", platform="tpu",
                                                chip_config_name=g.chip_config, chips_per_host_bounds=_host_shape(shape),
                                                num_slices=1)
    return list(topology.devices), g.hbm_gib * GIB


def host_topology(name: str) -> str:
    """The one-host topology of the generation of `name` with one host's chips of `name` ("v6e:4x4" -> "v6e:2x2");
    `name` itself for a one-host slice."""
    gen, shape = topologies.resolve(name)
    dims = _host_shape(shape)
    host = "x".join(map(str, dims if len(shape.split("x")) == 3 else dims[:2]))
    return f"{gen}:{host}"


def host_chips(name: str, devices: Sequence[Any]) -> list[Any]:
    """The chips the host-local programs (the rollout's, the retriever's) of a run on topology `name` compile for:
    the first host's of `devices` (its topology's), or where the generation asks (`Generation.host_programs_alone`)
    those of its one-host topology (`host_topology`): the same chips in the same shape, in a program of their own."""
    first = min(d.process_index for d in devices)
    host = [d for d in devices if d.process_index == first]
    if len(host) == len(devices) or not topologies.GENERATIONS[topologies.resolve(name)[0]].host_programs_alone:
        return host
    return topology_devices(host_topology(name))[0]


@contextlib.contextmanager
def no_persistent_cache_writes():
    """No program compiled in the block is written to JAX's persistent compilation cache: a TPU program compiled
    here for a deviceless topology is never run, and an entry of it would be read back by this machine's CPU backend
    (a warning per entry). Its minimum compile time is raised for the block (JAX decides once per process whether
    the cache is on at all, so the cache itself is left on)."""
    seconds = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float("inf"))
    try:
        yield
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", seconds)


def usable_hbm_bytes(device: Any) -> Optional[float]:
    """The HBM per chip XLA lets a program use (what it names when a program does not fit), measured by compiling
    a program that cannot fit; None when the compiler does not say."""
    too_big = jax.ShapeDtypeStruct((1 << 38,), jnp.float32, sharding=SingleDeviceSharding(device))
    try:
        with no_persistent_cache_writes():
            jax.jit(lambda x: x * 2).lower(too_big).compile()
    except Exception as e:  # noqa: BLE001 - the message is what we read
        return parse_available_hbm(str(e))
    return None


# An all-gather's outputs in HLO text: "%x = bf16[16,4096,3584]{...} all-gather(...)", a tuple of them for a
# combined all-gather; an asynchronous one's are those of its all-gather-done.
_ALL_GATHER = re.compile(r"=\s*(.*?)\s\ball-gather(?:-done)?\(")
# A collective that can move an array between chips, with its result shape(s) and its operands (an all-reduce sums
# partial results, which a weight never is in a rollout program).
_COLLECTIVE = re.compile(r"=\s*(.*?)\s\b(all-gather|all-to-all|collective-permute|reduce-scatter)(?:-start|-done)?"
                         r"\(([^)]*)\)")
_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")



def _bytes_after(label: str, message: str) -> Optional[float]:
    """Bytes of "<label> (30.75G)" in an XLA message (None when absent)."""
    match = re.search(re.escape(label) + r" \(([\d.]+)([KMGT])\)", message)
    return None if match is None else float(match.group(1)) * UNITS[match.group(2)]


def parse_available_hbm(message: str) -> Optional[float]:
    """Bytes of "exceeds available HBM (30.75G)" in an XLA RESOURCE_EXHAUSTED message (None when absent)."""
    return _bytes_after("available HBM", message)


def parse_required_bytes(message: str) -> Optional[float]:
    """Bytes of "required for HLO temporaries (155.96G)" in an XLA RESOURCE_EXHAUSTED message (None when
    absent)."""
    return _bytes_after("required for HLO temporaries", message)


# ----- what runs -----------------------------------------------------------------------------------------------------
# What stays in HBM beside each training program without being its argument (the update: the reference, REFERENCE
# by default); a rollout program keeps OPT_STATE and REFERENCE, and PARAMS too when the rollout has its own copy.
TRAINING_RESIDENT = {
    Role.OPTIMIZER_INIT: (), Role.REFERENCE_COPY: (OPT_STATE,), Role.REFERENCE_LOGP: (PARAMS, OPT_STATE),
    Role.POLICY_LOGP: (OPT_STATE, REFERENCE), Role.LIKELIHOOD_METRICS: (PARAMS, OPT_STATE, REFERENCE),
    Role.LLD_LOGP: (OPT_STATE, REFERENCE), Role.LLD_METRICS: (PARAMS, OPT_STATE, REFERENCE)}




def long_lived_bytes(rows: Sequence[Row], programs: Sequence[Program]) -> dict[str, float]:
    """Bytes per chip of PARAMS, OPT_STATE and REFERENCE from the compiled state programs (`rows[i]` the compiled
    `programs[i]`), of PAGE_POOL (the paged engine's pool, 0 without it), of INDEX when a retrieval search program
    is among them, of ENCODER when a query encoder program is, and then of SESSION (0 when no rollout program is).
    Without a reference (no KL term) the params are half the AdamW state (m and v are laid out like them)."""
    by_role = {}
    for row, program in zip(rows, programs):
        by_role.setdefault(program.role, row)  # a role's first program
    opt_state = by_role[Role.OPTIMIZER_INIT].outputs
    copy = by_role.get(Role.REFERENCE_COPY)
    params = copy.arguments if copy is not None else opt_state / 2
    sizes = {PARAMS: params, OPT_STATE: opt_state, REFERENCE: copy.outputs if copy is not None else 0.0}
    sizes[PAGE_POOL] = max(program.pool_bytes for program in programs)
    for name, role in ((INDEX, Role.RETRIEVAL), (ENCODER, Role.QUERY_ENCODER)):
        if role in by_role:
            sizes[name] = by_role[role].arguments
    if INDEX in sizes or ENCODER in sizes:
        sizes[SESSION] = max((row.arguments for row, program in zip(rows, programs) if program.rollout), default=0.0)
    return sizes


def sizing_programs(programs: Sequence[Program]) -> list[Program]:
    """The programs among `programs` whose compiled rows `long_lived_bytes` reads: the state programs and the first
    program of the retriever's search and of its query encoder (for a tool that compiles a few programs only)."""
    firsts = {Role.RETRIEVAL: None, Role.QUERY_ENCODER: None}
    for program in programs:
        if program.role in firsts and firsts[program.role] is None:
            firsts[program.role] = program
    return [p for p in programs if p.role in (Role.OPTIMIZER_INIT, Role.REFERENCE_COPY) or p in firsts.values()]


def all_gather_shapes(hlo_text: str) -> list[tuple[str, tuple[int, ...]]]:
    """(element type, dims) of the output of every all-gather in compiled HLO text, e.g. [("bf16", (16, 4096))]."""
    shapes = []
    for line in hlo_text.splitlines():
        match = _ALL_GATHER.search(line)
        if match:
            shapes += [(dtype, tuple(int(d) for d in dims.split(",") if d))
                       for dtype, dims in _SHAPE.findall(match.group(1))]
    return shapes


def collective_shapes(hlo_text: str) -> list[tuple[str, tuple[int, ...]]]:
    """(kind, dims) of every result and operand shape of every all-gather, all-to-all, collective-permute and
    reduce-scatter in compiled HLO text (their async -start / -done forms included), e.g.
    [("all-to-all", (28, 64, 96)), ...]."""
    shapes = []
    for line in hlo_text.splitlines():
        match = _COLLECTIVE.search(line)
        if match:
            result, kind, operands = match.groups()
            shapes += [(kind, tuple(int(d) for d in dims.split(",") if d))
                       for _, dims in _SHAPE.findall(result) + _SHAPE.findall(operands)]
    return shapes


def compile_row(program: Program) -> Row:
    """Compiles one program; its memory per chip from XLA's analysis (or the compiler's error)."""
    start = time.perf_counter()
    try:
        with no_persistent_cache_writes():
            compiled = program.lowered.compile()
    except Exception as e:  # noqa: BLE001 - XLA raises JaxRuntimeError / XlaRuntimeError; report any
        message = " ".join(str(e).split())
        return Row(program.name, program.shapes, compile_s=time.perf_counter() - start, error=message[:500])
    seconds = time.perf_counter() - start
    m = compiled.memory_analysis()
    own = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
           + m.generated_code_size_in_bytes)
    text = compiled.as_text()
    return Row(program.name, program.shapes, arguments=float(m.argument_size_in_bytes),
               outputs=float(m.output_size_in_bytes), temporaries=float(m.temp_size_in_bytes), total=float(own),
               compile_s=seconds, gathers=tuple(all_gather_shapes(text)), collectives=tuple(collective_shapes(text)),
               cost=roofline.hlo_costs(text))


def format_table(rows: Sequence[Row], hbm_bytes: float) -> str:
    """The per-program table: bytes per chip (binary units) and share of HBM; XLA's error for a program that
    did not compile."""
    width = max(len(r.name) for r in rows)
    shapes = max(len(r.shapes) for r in rows)
    header = (f"{'program':<{width}}  {'shapes':<{shapes}}  {'args':>7} {'temps':>7} {'resident':>8} {'total':>7} "
              f"{'of HBM':>7} {'compile':>8}  largest all-gather")
    lines = [header, "-" * len(header)]
    for r in rows:
        if r.error:
            required = parse_required_bytes(r.error)
            what = (f"temporaries alone {format_bytes(required)} (RESOURCE_EXHAUSTED)" if required is not None
                    else f"does not compile: {r.error[:200]}")
            lines.append(f"{r.name:<{width}}  {r.shapes:<{shapes}}  {what}")
            continue
        lines.append(f"{r.name:<{width}}  {r.shapes:<{shapes}}  {format_bytes(r.arguments):>7} "
                     f"{format_bytes(r.temporaries):>7} {format_bytes(r.resident):>8} {format_bytes(r.total):>7} "
                     f"{r.total / hbm_bytes:7.1%} {r.compile_s:7.1f}s  {r.gather or '-'}")
    return "\n".join(lines)


def overflows(rows: Sequence[Row], hbm_bytes: float) -> list[str]:
    """One line per program that does not fit: its name and the GiB over (XLA's error when it failed otherwise)."""
    out = []
    for r in rows:
        required = parse_required_bytes(r.error) if r.error else None
        if r.error and required is None:
            out.append(f"{r.name} ({r.shapes}) does not compile: {r.error[:300]}")
        elif required is not None:
            available = parse_available_hbm(r.error) or hbm_bytes
            out.append(f"{r.name} ({r.shapes}) does not fit: its temporaries alone need {required / GIB:.2f} GiB "
                       f"per chip, {(required - available) / GIB:.2f} GiB over the {available / GIB:.2f} GiB of HBM")
        elif r.total > hbm_bytes:
            out.append(f"{r.name} ({r.shapes}) does not fit: it needs {r.total / GIB:.2f} GiB per chip with what "
                       f"stays resident, {(r.total - hbm_bytes) / GIB:.2f} GiB over the {hbm_bytes / GIB:.2f} GiB "
                       "of HBM")
    return out


def whole_table_gathers(rows: Sequence[Row], vocab_size: int, hidden_size: int) -> list[str]:
    """One line per program that all-gathers the whole [V, D] embedding or output projection (an output whose last
    two dims are [V, D] or [D, V]): the vocabulary sharding (parallel.VOCAB) lost somewhere in it."""
    def whole_table(dims):
        return tuple(dims[-2:]) in ((vocab_size, hidden_size), (hidden_size, vocab_size))

    lines = []
    for r in rows:
        tables = [dims for _, dims in r.gathers if whole_table(dims)]
        if tables:
            lines.append(f"{r.name} ({r.shapes}) all-gathers the whole [{vocab_size}, {hidden_size}] vocabulary "
                         f"table ({', '.join(str(list(dims)) for dims in tables)}): the embedding or output "
                         "projection is no longer vocabulary-sharded there")
    return lines


def _strip_layer_axis(dims: tuple[int, ...], layers: int) -> tuple[int, ...]:
    """dims without leading 1s and a leading `layers` axis (one layer's slice of the stacked [L, ...] weights, or
    the stacked weights themselves)."""
    while dims and dims[0] == 1:
        dims = dims[1:]
    if dims and dims[0] == layers:
        dims = dims[1:]
    while dims and dims[0] == 1:
        dims = dims[1:]
    return dims


def weight_shapes(model_cfg, tensor: int) -> set[tuple[int, ...]]:
    """Every shape in which a rollout program could all-gather one layer's weight matrix of `model_cfg` (the
    rollout copy's architecture, on a mesh whose tensor axis is `tensor` chips): q [D, N, H], k / v [D, K, H],
    o [N, H, D] (also with heads merged) with N or K whole or cut into `tensor` slices; gate / up [D, F], down
    [F, D] with F whole or cut into `tensor`, `mlp_chunks` or both's slices (one chip's or one MLP slice's part)."""
    m = model_cfg
    d, h, f = m.hidden_size, m.head_dim, m.intermediate_size
    heads = {n // k for n in (m.num_heads, m.num_kv_heads) for k in {1, tensor} if n % k == 0}
    widths = {f // k for k in {1, tensor, m.mlp_chunks, tensor * m.mlp_chunks} if f % k == 0}
    return ({(d, n, h) for n in heads} | {(n, h, d) for n in heads} | {(d, n * h) for n in heads}
            | {(n * h, d) for n in heads} | {(d, w) for w in widths} | {(w, d) for w in widths})


def weight_collectives(rows: Sequence[Row], model_cfg, tensor: int) -> list[str]:
    """One line per program of `rows` (rollout programs) one of whose collectives (`collective_shapes`: all-gather,
    all-to-all, collective-permute, reduce-scatter) has a result or operand shaped as a layer's weight matrix
    (`weight_shapes`), one layer's slice or the stacked [L, ...] weights (`_strip_layer_axis`): the rollout copy is
    not laid out so that each chip multiplies by its own slice."""
    shapes = weight_shapes(model_cfg, tensor)
    lines = []
    for r in rows:
        found = sorted({(kind, dims) for kind, dims in r.collectives
                        if _strip_layer_axis(dims, model_cfg.num_layers) in shapes})
        if found:
            shapes_text = ", ".join(f"{kind} {list(dims)}" for kind, dims in found)
            lines.append(f"{r.name} ({r.shapes}) moves a layer's weights between chips ({shapes_text}): set "
                         "rollout.tensor_parallel so that each chip keeps its own slice (docs/tpu.md)")
    return lines


def _layout_label(layout, hosts: int) -> str:
    """How a rollout program's shapes say where it runs: " (host-local)" on several hosts, the tensor-parallel
    group when there is one."""
    where = ["host-local"] if hosts > 1 else []
    if layout.tensor > 1:
        where.append(f"tensor {layout.tensor}" + (f", key/value heads x{layout.kv_repeat}" if layout.kv_repeat > 1
                                                  else ""))
    return f" ({', '.join(where)})" if where else ""


def build_programs(run: RunConfig, devices: Sequence[Any], host: Optional[Sequence[Any]] = None) -> list[Program]:
    """Every program a run of `run` executes, on a mesh over `devices` (hosts by their process_index), the
    host-local ones (the rollout's, the retriever's) over `host` (default: the first host's of `devices`; `host_chips`
    where they compile alone), lowered at the run's largest shapes with abstract arrays (compiling is what takes time);
    in the order a run first runs them. The run is built as the trainer builds it (`llds_jax.train.run_builder`), on an
    abstract model; the samplers and the train step name their programs at abstract arguments (`abstract_programs`,
    `llds_jax.programs.CompilablePrograms`); what stays resident and the calls per step are added here."""
    hosts = sorted({d.process_index for d in devices})
    host = [d for d in devices if d.process_index == hosts[0]] if host is None else list(host)
    layout = run_builder.run_layout(run, devices, host)
    parts = run_builder.build(run, layout, run_builder.abstract_model(layout), PLACEHOLDER_STOP_IDS)
    rollout_params = abstract_rollout_params(layout.rollout, parts.step.abstract_state().params,
                                             run.rollout.params_dtype)
    # The rollout's params are a copy of their own (the training params stay resident) on another mesh or in
    # another dtype; else they are the training params themselves.
    own_copy = (layout.rollout.resharded or layout.rollout.kv_repeat > 1
                or run.rollout.params_dtype != run.model.param_dtype)
    everything = (PARAMS, OPT_STATE, REFERENCE)
    beside_rollout = everything if own_copy else (OPT_STATE, REFERENCE)
    rollout = []
    reshard = reshard_program(layout.rollout, parts.step.abstract_state().params, run.rollout.params_dtype)
    if reshard is not None:  # its argument is the cast copy, or the training params themselves
        cast = run.rollout.params_dtype != run.model.param_dtype or layout.rollout.kv_repeat > 1
        rollout.append(Program(reshard.name, reshard.shapes, reshard.lower(),
                               everything if cast else (OPT_STATE, REFERENCE), role=Role.RESHARD, calls=1.0))
    session_rows = parts.sampler.engine_config.max_seqs
    # A retriever call holds at most one search per sequence in flight, training's or evaluation's.
    max_queries = max(session_rows, parts.eval_sampler.engine_config.max_seqs)
    batch = run.rollout_batch_size
    for label, sampler in (("", parts.sampler), ("eval ", parts.eval_sampler)):
        for program in sampler.abstract_programs(rollout_params):  # one step program per token bucket
            rollout.append(Program(f"{label}{program.name}",
                                   program.shapes + _layout_label(layout.rollout, len(hosts)), program.lower(),
                                   beside_rollout, role=program.role, rollout=True,
                                   pool_bytes=sampler.runner.pool.bytes_per_device()))
    length = round_up(run.rollout.max_context_tokens, run.train.sequence_bucket)
    calls = step_estimate.update_calls(run, run.updates_per_step)
    training = [Program(p.name, p.shapes, p.lower(), TRAINING_RESIDENT.get(p.role, (REFERENCE,)), role=p.role,
                        calls=calls.get(p.role, 0.0))
                for p in parts.step.abstract_programs(TrainShapes(batch, length,
                                                                  measure_lld=bool(run.train.lld_every)))]
    setup = [p for p in training if p.role in (Role.OPTIMIZER_INIT, Role.REFERENCE_COPY)]
    programs = setup + rollout + training[len(setup):]
    programs = [p if p.rollout else dataclasses.replace(p, resident=p.resident + (PAGE_POOL,)) for p in programs]
    search = search_programs(run, host, session_rows, max_queries, beside_rollout)  # each host its own copy
    index = (INDEX,) if search else ()
    encoder = encoder_programs(run.retriever, host[0], max_queries, beside_rollout + index)
    encoded = (ENCODER,) if encoder else ()
    programs = [dataclasses.replace(p, resident=p.resident + index + encoded) for p in programs]
    search = [dataclasses.replace(p, resident=p.resident + encoded) for p in search]
    return programs[:len(setup) + len(rollout)] + search + encoder + programs[len(setup) + len(rollout):]


def estimate(run: RunConfig, rows: Sequence[Row], programs: Sequence[Program], generation: str, hosts: int, layout,
             estimate_from: str = "") -> str:
    """The step-time estimate (`llds_jax.aot.step_estimate`) of the compiled `rows` of a run of `run` at `generation`'s
    peaks: the training programs' table, the worst-case step and the expected step (at the lengths of the run folder
    `estimate_from`, else `step_lengths`' defaults), the rollout as the paged engine schedules it
    (`llds_jax.aot.rollout_schedule`), each step ideal (`format_step`) then kernel-faithful (`format_faithful`: each
    call as the attention kernel runs it, each term with its source); what partial rollouts make of the expected step's
    rollout (`rollout_schedule.partial_for_run` at the config's rollout.over_sampling when rollout.partial is on, else
    at `step_estimate.PARTIAL_OVER_SAMPLING`; ideal); with `estimate_from`, its predicted step calls and batch tokens
    per token bucket beside the run's logged ones."""
    # The query encoder runs inside the retriever's calls: no part of the step of its own.
    costs = [step_estimate.ProgramCost(r.name, r.shapes, r.cost, p.calls,
                                       "" if p.role is Role.QUERY_ENCODER else step_estimate.part(p.role, p.rollout),
                                       p.role)
             for r, p in zip(rows, programs)]
    peaks = roofline.PEAKS[generation]
    sequences = run.rollout_batch_size // hosts
    step_row, step_program = next((r, p) for r, p in zip(rows, programs) if p.role is Role.ROLLOUT_STEP)
    rollout_cfg = run.rollout
    paging = PagingConfig.of(rollout_cfg)
    slots = run.engine_slots(sequences)
    cost = step_estimate.step_cost(layout.rollout.model_cfg, layout.rollout.tensor,
                                   step_row.arguments - step_program.pool_bytes, paging.page_size, slots)
    faithful = step_estimate.faithful_cost(cost, layout.rollout.model_cfg, layout.rollout.tensor, paging.page_size,
                                           -(-rollout_cfg.max_context_tokens // paging.page_size),
                                           parallel.axis_size(layout.rollout.mesh, "sampled_rows"),
                                           SamplingConfig.of(rollout_cfg, PLACEHOLDER_STOP_IDS),
                                           KernelTiles.of(rollout_cfg), decode_batches(layout.rollout.mesh, slots))
    device_search = next((c for c in costs if c.role is Role.RETRIEVAL), None)
    search = beside.search_programs(costs, run.retriever, peaks, measured.SECOND_PASS.rate)
    collectives = beside.Collectives.of(step_row.cost)
    worst_updates = step_estimate.part_seconds(costs, peaks)
    lines = [step_estimate.format_programs(costs, peaks, generation)]
    records = step_lengths.read_records(estimate_from) if estimate_from else None
    expected = (step_lengths.from_metrics(records, f"the run {estimate_from}") if records is not None
                else step_lengths.defaults(run))
    for label, lengths in (("worst-case", step_lengths.worst_case(run)), ("expected", expected)):
        schedule = rollout_schedule.for_run(run, lengths, sequences)
        time_ = step_estimate.rollout_time(schedule, cost, peaks, run.retriever, generation, lengths.searches,
                                           device_search)
        share = step_lengths.update_share(run, lengths)
        updates = step_estimate.part_seconds(costs, peaks, dict.fromkeys(step_estimate.FORWARDS, share))
        lines.append(step_estimate.format_step(label, schedule, time_, worst_updates[step_estimate.RESHARD],
                                               updates[step_estimate.UPDATES], lengths))
        faithful_time = step_estimate.faithful_time(schedule, faithful, peaks)
        terms = beside.beside_terms(schedule, faithful_time, time_, run.retriever, measured.HOST, search, collectives,
                                    overlapped=True)
        lines.append(beside.format_faithful(label, faithful, faithful_time, time_,
                                            worst_updates[step_estimate.RESHARD], updates[step_estimate.UPDATES],
                                            terms))
    # What partial rollouts make of the expected step (issue 59): the rollout cut at the batch's completion, at the
    # config's rollout.over_sampling when rollout.partial is on, else at the what-if's factors.
    prompts = sequences // run.data.samples_per_prompt
    partials = []
    for over_sampling in step_estimate.partial_factors(run.rollout):
        started = math.ceil(over_sampling * prompts) * run.data.samples_per_prompt
        steps = rollout_schedule.partial_for_run(run, expected, sequences, over_sampling, run.rollout.max_staleness)
        partials.append(step_estimate.partial_time(
            steps, over_sampling, dataclasses.replace(cost, slots=run.engine_slots(started)),
            peaks, run.retriever, generation, expected.searches, device_search))
    lines.append(step_estimate.format_partial(time_, partials, worst_updates[step_estimate.RESHARD],
                                              updates[step_estimate.UPDATES], prompts, run.rollout.max_staleness,
                                              what_if=not run.rollout.partial))
    if records is not None:
        lines.append(step_estimate.format_counts(schedule, step_lengths.logged_step_counts(records, estimate_from),
                                                 estimate_from))
    return "\n".join(lines)


def run(run: RunConfig, topology: str, estimate_from: str = "") -> int:
    """Compiles every program of the run config `run` (checked: `checks.check_components`) for `topology` (its own
    or another: `run.mesh.topology` is not read) and prints the table; returns the exit status (0: every
    program fits, `EXIT_DOES_NOT_FIT`: one does not). The expected step takes its lengths from the run folder
    `estimate_from` (its metrics.jsonl), else from `llds_jax.aot.step_lengths`' defaults."""
    jax.config.update("jax_platforms", "cpu")  # the host's own backend; TPU programs are compiled, never run
    devices, nominal = topology_devices(topology)
    checks.check_mesh(run, len(devices))
    hbm = usable_hbm_bytes(devices[0]) or nominal
    hosts = len({d.process_index for d in devices})
    host = host_chips(topology, devices)
    alone = "" if host[0] in devices else f"; host-local programs compiled for {host_topology(topology)}"
    print(f"compiling for {topology}: {len(devices)} chips, {hosts} host(s), {devices[0].device_kind}, "
          f"{nominal / GIB:.0f} GiB HBM per chip ({hbm / GIB:.2f} GiB usable){alone}", flush=True)
    programs = build_programs(run, devices, host)
    rows = []
    for i, program in enumerate(programs):
        print(f"[{i + 1}/{len(programs)}] {program.name}: {program.shapes}", flush=True)
        rows.append(compile_row(program))
    sizes = long_lived_bytes(rows, programs)
    rows = [row.with_resident(sum(sizes[name] for name in program.resident))
            for row, program in zip(rows, programs)]
    print(format_table(rows, hbm))
    for line in retriever_lines(run.retriever, programs, sizes, len(devices) // hosts):
        print(line)
    layout = run_builder.run_layout(run, devices, host)
    model, rollout = layout.model_cfg, layout.rollout
    problems = (overflows(rows, hbm) + whole_table_gathers(rows, model.vocab_size, model.hidden_size)
                + weight_collectives([r for r, p in zip(rows, programs) if p.rollout], rollout.model_cfg,
                                     rollout.tensor))
    for line in problems:
        print(f"llds_jax: error: {line}")
    if problems:
        return EXIT_DOES_NOT_FIT
    print(f"rollout programs: {sum(p.rollout for p in programs)} (paged engine, training and evaluation)")
    if run.rollout.trees:  # the schedule drives chains alone (rollout_schedule.for_run)
        print("step estimate: not modelled for tree rollouts (rollout.trees); the programs above are every one a run "
              "compiles")
    else:
        print(estimate(run, rows, programs, topologies.resolve(topology)[0], hosts, layout, estimate_from))
    worst = max(rows, key=lambda r: r.total)
    print(f"every program fits; the largest, {worst.name}, takes {worst.total / GIB:.2f} GiB per chip "
          f"({worst.total / hbm:.1%} of {hbm / GIB:.2f} GiB: {1 - worst.total / hbm:.1%} headroom); none "
          f"all-gathers a whole [{model.vocab_size}, {model.hidden_size}] vocabulary table, no rollout program moves a "
          "layer's weights")
    return 0
