"""The retriever's programs on the chips for `--mode=compile` (llds_jax/aot/compile_check.py): the e5_device search
at every (queries, candidates) shape its calls reach and the e5 query encoder at every (batch, length) bucket, each
sized from the index and the encoder folder when they are on this machine (else wiki-18's and e5-base-v2's), and the
lines that say what they keep on the chips.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Sequence

from llds_jax.aot import step_estimate
from llds_jax.aot.compiled import ENCODER, INDEX, SESSION, Program, format_bytes
from llds_jax.config.sections import RetrieverConfig, RunConfig
from llds_jax.model.bert import BertConfig
from llds_jax.programs import Role
from llds_jax.search import dense_index, device_index, device_search, e5, local
from llds_jax.search.dense import read_faiss_index
from llds_jax.search.dense_options import DeviceFlatOptions, EncoderOptions
from llds_jax.search.factory import resolve_config


def search_programs(run: RunConfig, devices: Sequence[Any], rows: int, max_queries: int, resident: tuple[str, ...]
                    ) -> list[Program]:
    """The e5_device retriever's search programs (`search.device_search`; none for another backend) on one host's
    chips `devices` (each host holds the whole index over its own chips, `search.dense_device`), its index's rows
    and dimension read from `retriever.index_path` when it is on this machine, else wiki-18's (`index_source`): one
    per (queries, candidates) pair its calls reach (`device_search.reachable_shapes`), calls of up to
    `max_queries` searches for the rollout's top k (`rollout.retrieval_top_k`) and the start-up check's
    (`search.local.CHECK_K`). First the one the step estimate costs per device call
    (`step_estimate.rollout_time`): the first pass at a device call of the `rows` searches of the training
    rollout's rows in flight (at most `retriever.search_batch`); then the others, smallest first. `resident`: what
    stays beside a rollout program, SESSION added."""
    ret = resolve_config(run.retriever)
    if not isinstance(ret, DeviceFlatOptions):
        return []
    (rows_n, dim), _ = index_source(ret.index_path)
    lay = device_index.layout(rows_n, dim, len(devices), ret.vector_dtype, ret.block_rows)
    top_k = run.rollout.retrieval_top_k
    passes = {"candidates": ret.candidates, "max_candidates": ret.max_candidates}
    shapes = device_search.reachable_shapes([(max_queries, top_k), (len(local.CHECK_QUERIES), local.CHECK_K)],
                                            rows_n, max_batch=ret.search_batch, **passes)
    costed = (device_search.batch_bucket(rows, ret.search_batch),
              device_search.candidate_counts(top_k, rows_n, **passes)[0])
    programs = []
    for queries, m in [costed] + sorted(shapes - {costed}):
        program = device_search.abstract_program(lay, devices, m, queries)
        programs.append(Program(program.name, program.shapes, program.lower(), resident + (SESSION,),
                                role=Role.RETRIEVAL))
    return programs


def encoder_programs(retriever: RetrieverConfig, device: Any, max_queries: int, resident: tuple[str, ...]
                     ) -> list[Program]:
    """The e5 query encoder's programs of the run's `retriever` (`search.e5`; none for a backend without one) on a
    host's first chip `device`, its architecture read from `retriever.encoder_path`'s config.json when it is on this
    machine, else e5-base-v2's (`encoder_source`): one per (B, T) bucket that calls of up to `max_queries` queries
    reach (`e5.reachable_shapes`), smallest first. `resident`: what stays beside a rollout program (and the index, with
    e5_device), SESSION added."""
    ret = resolve_config(retriever)
    if not isinstance(ret, EncoderOptions) or not ret.encoder_path:
        return []
    bert, _ = encoder_source(ret.encoder_path, ret.encoder_dtype)
    e5.check_max_length(ret.max_length, bert, ret.encoder_path)
    shapes = e5.reachable_shapes(max_queries, batch_size=ret.encoder_batch_size, max_length=ret.max_length)
    return [Program(p.name, p.shapes, p.lower(), resident + (SESSION,), role=Role.QUERY_ENCODER)
            for p in e5.abstract_programs(bert, device, shapes)]


def encoder_source(encoder_path: str, dtype: str) -> tuple[Any, str]:
    """(`model.bert.BertConfig` in the compute `dtype`, where from) of the encoder folder `encoder_path` when its
    config.json is on this machine, else intfloat/e5-base-v2's (Search-R1's encoder, `e5.E5_BASE_V2`)."""
    file = os.path.join(encoder_path, "config.json")
    if os.path.isfile(file):
        with open(file, encoding="utf-8") as f:
            return BertConfig.from_hf(json.load(f), file, dtype), encoder_path
    return (dataclasses.replace(e5.E5_BASE_V2, dtype=dtype),
            f"{encoder_path} is not on this machine: e5-base-v2's architecture")


def index_source(index_path: str) -> tuple[tuple[int, int], str]:
    """((rows, dim), where from) of a Flat index file or index_builder folder on this machine, else wiki-18's
    21,015,324 rows of e5-base-v2's 768 (the figures of Search-R1's e5_Flat.index)."""
    file = os.path.join(index_path, dense_index.INDEX_NAME) if os.path.isdir(index_path) else index_path
    if os.path.isfile(file):
        index = read_faiss_index(file, mmap=True)
        return (int(index.ntotal), int(index.d)), file
    return ((step_estimate.WIKI18_ROWS, e5.E5_BASE_V2.hidden_size),
            f"{index_path} is not on this machine: wiki-18's size")


def retriever_lines(retriever: RetrieverConfig, programs: Sequence[Program], sizes: dict[str, float],
                    host_chips: int) -> list[str]:
    """What the retriever keeps on the chips (`long_lived_bytes`' INDEX and ENCODER) and how many programs of each
    kind it runs, in words, for the run's `retriever`; none without a retriever on the chips."""
    lines = []
    count = {role: sum(p.role is role for p in programs) for role in (Role.RETRIEVAL, Role.QUERY_ENCODER)}
    if INDEX in sizes:
        ret = resolve_config(retriever)
        (rows_n, dim), source = index_source(ret.index_path)
        lines.append(f"retrieval index (e5_device, {ret.vector_dtype}): {rows_n:,} rows "
                     f"x {dim} ({source}) over each host's {host_chips} chips (a copy per host): "
                     f"{format_bytes(sizes[INDEX])} per chip, resident in every program; its "
                     f"{count[Role.RETRIEVAL]} search programs (every batch and candidate count its calls reach) "
                     f"hold a rollout session's {format_bytes(sizes[SESSION])} beside it")
    if ENCODER in sizes:
        ret = resolve_config(retriever)
        _, source = encoder_source(ret.encoder_path, ret.encoder_dtype)
        lines.append(f"query encoder (e5, {source}): {format_bytes(sizes[ENCODER])} on each host's first chip, "
                     f"resident in every program there; its {count[Role.QUERY_ENCODER]} programs (every batch and "
                     f"length bucket its calls reach) hold a rollout session's {format_bytes(sizes[SESSION])} "
                     "beside it")
    return lines
