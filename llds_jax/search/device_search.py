"""Exact top-k inner-product search over a `device_index.DeviceIndex`: candidates scored on the chips in reduced
precision, re-ranked on the host in float64 from the float32 rows, with a proof that the top-k is among them.

1. On the chips (`candidates_program`, one jitted program per number of candidates m): each device scores its
   rows block by block, x̂ · q̂ (q̂ the query in bfloat16, products exact in float32, float32 sums; int8 rows times
   their scale), keeps each block's best m, then its shard's best m; the shards' candidates are merged into the
   best m of the index (rows past N never count).
2. On the host (`rerank`): the m candidates' float32 rows are read from the memory-mapped file and scored in
   float64 (exact for float32 inputs up to ~1e-16 relative).
3. The proof (`score_bound`, `proven`): for every row r, |q · x_r - s̃_r| <= B(q) with
       B(q) = ||q|| E + ||q - q̂|| X + (γ_D + 2u) ||q̂|| X,   u = 2^-24, γ_D = D u / (1 - D u),
   E = max_r ||x_r - x̂_r||, X = max_r ||x̂_r|| (device_index): the stored rows' error, the query's rounding, and
   the float32 sums' worst case (plus the int8 scale's product). A row that is not a candidate has s̃_r <= τ, the
   lowest candidate's approximate score, so its exact score is at most τ + B(q). When the k-th exact score among the
   candidates is above τ + B(q), no other row can reach it (nor tie it): the candidates hold the exact top-k.
   Otherwise the query is searched again with 4x the candidates (`ExactSearcher`), and past `max_candidates` the
   whole index is scored on the host in float64 (a fallback that no bound of the sizes measured here reaches).

Programs: one per (queries, candidates) pair, queries padded to a power of two (`batch_bucket`) and candidates the
counts of a search's passes (`candidate_counts`); `reachable_shapes` lists every pair a searcher can run, which is
what `--mode=compile` compiles (llds_jax/aot/compile_check.py).

Order: faiss's IndexFlatIP keeps, among rows of equal score, the lowest ids, and lists equal scores highest id first
(checked on faiss-cpu 1.15.1, both its BLAS and its per-query path); `faiss_order` does the same with the exact
scores. Equality with faiss's top-k therefore holds except where faiss's own float32 sums reorder two rows whose
scores differ by less than their rounding (~D 2^-24 |q| |x|; faiss's two paths can then disagree with each other).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from llds_jax.programs import AbstractProgram, Role
from llds_jax.search.dense_options import DeviceFlatOptions
from llds_jax.search.device_index import AXIS, DeviceIndex, IndexLayout

log = logging.getLogger(__name__)

UNIT_ROUNDOFF = 2.0 ** -24  # float32
MIN_BATCH = 8  # queries of the smallest device call


def _local_candidates(vectors_sd, scales_s, query_qd, *, lay: IndexLayout, m: int):
    """This shard's best min(m, S) (scores [Q, m'] float32, global row ids [Q, m'] int32), block by block: each of
    its K blocks of R rows gives its best (at most M), pooled over the blocks (M' = K x min(m, R)), then cut to m."""
    shard = jax.lax.axis_index(AXIS)
    per_block = min(m, lay.block_rows)
    blocks_krd = vectors_sd.reshape(lay.blocks, lay.block_rows, lay.dim)
    scales_kr = None if scales_s is None else scales_s.reshape(lay.blocks, lay.block_rows)

    def block(b):
        rows_rd = blocks_krd[b].astype(jnp.bfloat16)  # int8 codes are exact in bfloat16
        scores_qr = jnp.einsum("qd,rd->qr", query_qd, rows_rd, preferred_element_type=jnp.float32)
        if scales_kr is not None:
            scores_qr = scores_qr * scales_kr[b][None, :]
        ids_r = shard * lay.shard_rows + b * lay.block_rows + jnp.arange(lay.block_rows, dtype=jnp.int32)
        scores_qr = jnp.where(ids_r[None, :] < lay.rows, scores_qr, -jnp.inf)
        top_qm, at_qm = jax.lax.top_k(scores_qr, per_block)
        return top_qm, ids_r[at_qm]

    top_kqm, ids_kqm = jax.lax.map(block, jnp.arange(lay.blocks))
    q = query_qd.shape[0]
    pooled_top_qm = top_kqm.transpose(1, 0, 2).reshape(q, lay.blocks * per_block)
    pooled_ids_qm = ids_kqm.transpose(1, 0, 2).reshape(q, lay.blocks * per_block)
    keep = min(m, lay.blocks * per_block)
    top_qm, at_qm = jax.lax.top_k(pooled_top_qm, keep)
    return top_qm, jnp.take_along_axis(pooled_ids_qm, at_qm, axis=1)


def candidates_fn(lay: IndexLayout, mesh, m: int):
    """The search program's function (vectors, scales or None, query [Q, D] bfloat16) -> (approximate scores
    [Q, m''] float32, row ids [Q, m''] int32), best first, m'' = min(m, every slot of the index); not jitted."""
    int8 = lay.dtype == "int8"
    local = functools.partial(_local_candidates, lay=lay, m=m)
    in_specs = (P(AXIS, None), P(AXIS) if int8 else None, P(None, None))

    def search(vectors, scales, query_qd):
        pooled_top_qm, pooled_ids_qm = jax.shard_map(local, mesh=mesh, in_specs=in_specs,
                                                     out_specs=(P(None, AXIS), P(None, AXIS)))(vectors, scales,
                                                                                               query_qd)
        top_qm, at_qm = jax.lax.top_k(pooled_top_qm, min(m, pooled_top_qm.shape[1]))
        return top_qm, jnp.take_along_axis(pooled_ids_qm, at_qm, axis=1)

    return search


@functools.lru_cache(maxsize=None)
def candidates_program(lay: IndexLayout, mesh, m: int):
    """`candidates_fn` jitted, its outputs replicated (one program per layout, mesh and m)."""
    replicated = NamedSharding(mesh, P())
    return jax.jit(candidates_fn(lay, mesh, m), out_shardings=(replicated, replicated))


def batch_bucket(queries: int, max_batch: int) -> int:
    """The queries of a device call of `queries` searches (1 <= queries <= max_batch) padded: the next power of two,
    at least MIN_BATCH, at most `max_batch`."""
    return min(max_batch, max(MIN_BATCH, 1 << math.ceil(math.log2(queries))))


def candidate_counts(k: int, rows: int, *, candidates: int, max_candidates: int) -> tuple[int, ...]:
    """The candidates per query of each device pass of a search for the top `k` over `rows` rows: max(candidates,
    k), then 4x as many while at most max(max_candidates, k), the last at most `rows` (every row a candidate proves
    every query); a query not proven after them is scanned on the host. E.g. 32, 128, 512, 2048 for the top 3 with
    the defaults (32, 4096) over wiki-18."""
    counts, m = [], max(candidates, k)
    while m <= max(max_candidates, k):
        counts.append(m)
        if m >= rows:
            break
        m = min(4 * m, rows)
    return tuple(counts)


def reachable_shapes(calls: Sequence[tuple[int, int]], rows: int, *, candidates: int, max_candidates: int,
                     max_batch: int) -> set[tuple[int, int]]:
    """Every (queries, candidates) program an `ExactSearcher` over `rows` rows (its `candidates`, `max_candidates`
    and `max_batch`) runs serving calls of at most `queries` searches for the top `k`, for each (queries, k) of
    `calls`: a call's device batches hold 1 to min(queries, max_batch) of its queries (its last batch, or the
    queries a pass left unproven), each batch at every candidate count of its passes."""
    shapes = set()
    for queries, k in calls:
        batches = {batch_bucket(n, max_batch) for n in range(1, min(queries, max_batch) + 1)}
        counts = candidate_counts(k, rows, candidates=candidates, max_candidates=max_candidates)
        shapes |= {(batch, m) for batch in batches for m in counts}
    return shapes


def abstract_program(lay: IndexLayout, devices, m: int, queries: int) -> AbstractProgram:
    """The search program at abstract arguments on `devices` (a pod's chips, for `--mode=compile`): the index of
    `lay` split over them, `queries` bfloat16 queries, `m` candidates."""
    mesh = Mesh(np.asarray(devices), (AXIS,))
    stored = jnp.bfloat16 if lay.dtype == "bfloat16" else jnp.int8
    vectors = jax.ShapeDtypeStruct((lay.shards * lay.shard_rows, lay.dim), stored,
                                   sharding=NamedSharding(mesh, P(AXIS, None)))
    scales = None
    if lay.dtype == "int8":
        scales = jax.ShapeDtypeStruct((lay.shards * lay.shard_rows,), jnp.float32,
                                      sharding=NamedSharding(mesh, P(AXIS)))
    query = jax.ShapeDtypeStruct((queries, lay.dim), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
    shapes = (f"{queries} queries x {lay.rows:,} rows of {lay.dim} in {lay.dtype}, {m} candidates, "
              f"{lay.shard_rows:,} rows per chip")
    return AbstractProgram(Role.RETRIEVAL, shapes, candidates_program(lay, mesh, m), (vectors, scales, query),
                           detail=f"{queries} queries, {m} candidates")


def score_bound(query_qd: np.ndarray, error_max: float, norm_max: float) -> np.ndarray:
    """B(q) [Q] (module docstring) for float32 queries [Q, D]: the most any row's approximate score can differ from
    its exact inner product with q."""
    q = np.asarray(query_qd, np.float64)
    rounded = np.asarray(query_qd, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
    d = q.shape[1]
    gamma = d * UNIT_ROUNDOFF / (1 - d * UNIT_ROUNDOFF)
    bound = (np.linalg.norm(q, axis=1) * error_max + np.linalg.norm(q - rounded, axis=1) * norm_max
             + (gamma + 2 * UNIT_ROUNDOFF) * np.linalg.norm(rounded, axis=1) * norm_max)
    return bound * (1 + 1e-9) + 1e-12  # the bound's own float64 arithmetic


def faiss_order(ids_n: np.ndarray, scores_n: np.ndarray, k: int) -> np.ndarray:
    """Positions of the top `k` of (ids [n], exact scores [n]) in faiss IndexFlatIP's order: the k best by score,
    lowest ids among equal scores, then listed by score, highest id first among equal scores."""
    chosen = np.lexsort((ids_n, -scores_n))[:k]
    return chosen[np.lexsort((-ids_n[chosen], -scores_n[chosen]))]


def exact_scores(vectors_nd: np.ndarray, query_d: np.ndarray, ids_n: np.ndarray) -> np.ndarray:
    """Inner products [n] of the float32 rows `ids_n` (sorted reads of the memory-mapped file) with `query_d`, in
    float64."""
    order = np.argsort(ids_n, kind="stable")
    scores = np.empty(len(ids_n), np.float64)
    scores[order] = vectors_nd[ids_n[order]].astype(np.float64) @ np.asarray(query_d, np.float64)
    return scores


@dataclasses.dataclass(frozen=True)
class Reranked:
    """One query's answer: `ids` [<= k] int64 and `scores` [<= k] float64, faiss's order; `proven`: the exact
    top-k is certainly among the candidates."""

    ids: np.ndarray
    scores: np.ndarray
    proven: bool


def rerank(vectors_nd: np.ndarray, query_d: np.ndarray, ids_m: np.ndarray, approx_m: np.ndarray, k: int,
           bound: float, rows: int) -> Reranked:
    """The exact top-k of one query's candidates (ids [m], approximate scores [m], best first; -inf marks no row),
    and whether it is proven (module docstring): every row is a candidate, or the k-th exact score is above the
    lowest candidate's approximate score plus `bound`."""
    real = np.isfinite(approx_m)
    ids, approx = ids_m[real].astype(np.int64), approx_m[real].astype(np.float64)
    scores = exact_scores(vectors_nd, query_d, ids)
    top = faiss_order(ids, scores, k)
    if len(ids) >= rows:
        return Reranked(ids[top], scores[top], True)
    proven = len(top) == k and scores[top].min() > approx.min() + bound
    return Reranked(ids[top], scores[top], bool(proven))


class ExactSearcher:
    """Exact top-k over a DeviceIndex and its float32 rows `vectors_nd` (memory-mapped), `candidates` per query
    first, 4x as many for the queries not proven, up to `max_candidates`; then the host's exact scan.

    Queries go to the chips in batches of at most `max_batch` (padded: `batch_bucket`): a program per (batch,
    candidates) pair (`reachable_shapes`). `passes` counts the device calls per number of candidates and
    `shapes_compiled` holds the (batch, candidates) pairs called (for tests and metrics)."""

    def __init__(self, index: DeviceIndex, vectors_nd: np.ndarray, *, candidates: int = DeviceFlatOptions.candidates,
                 max_candidates: int = DeviceFlatOptions.max_candidates,
                 max_batch: int = DeviceFlatOptions.search_batch):
        self.index, self.vectors_nd = index, vectors_nd
        self.candidates, self.max_candidates, self.max_batch = candidates, max_candidates, max_batch
        self.passes: dict[int, int] = {}
        self.shapes_compiled: set[tuple[int, int]] = set()
        self.host_scans = 0

    def _device_candidates(self, query_qd: np.ndarray, m: int) -> tuple[np.ndarray, np.ndarray]:
        """(approximate scores [Q, m'], ids [Q, m']) from the chips, in batches."""
        lay = self.index.layout
        program = candidates_program(lay, self.index.mesh, m)
        scores, ids = [], []
        for start in range(0, len(query_qd), self.max_batch):
            part = query_qd[start:start + self.max_batch]
            batch = batch_bucket(len(part), self.max_batch)
            padded = np.zeros((batch, lay.dim), ml_dtypes.bfloat16)
            padded[:len(part)] = part.astype(ml_dtypes.bfloat16)
            top_qm, ids_qm = program(self.index.vectors, self.index.scales, padded)
            scores.append(np.asarray(top_qm)[:len(part)])
            ids.append(np.asarray(ids_qm)[:len(part)])
            self.passes[m] = self.passes.get(m, 0) + 1
            self.shapes_compiled.add((batch, m))
        return np.concatenate(scores), np.concatenate(ids)

    def _host_scan(self, query_d: np.ndarray, k: int, chunk_rows: int = 1 << 18) -> Reranked:
        """The exact top-k of every row, in float64 on the host, chunk by chunk."""
        self.host_scans += 1
        rows = self.index.layout.rows
        log.warning("exact search: a query not proven at %d candidates; scanning all %s rows on the host",
                    self.max_candidates, f"{rows:,}")
        best_ids, best_scores = np.zeros(0, np.int64), np.zeros(0, np.float64)
        for start in range(0, rows, chunk_rows):
            block = np.asarray(self.vectors_nd[start:start + chunk_rows], np.float64) @ query_d.astype(np.float64)
            ids = np.concatenate([best_ids, np.arange(start, start + len(block))])
            scores = np.concatenate([best_scores, block])
            keep = np.lexsort((ids, -scores))[:k]
            best_ids, best_scores = ids[keep], scores[keep]
        top = faiss_order(best_ids, best_scores, k)
        return Reranked(best_ids[top], best_scores[top], True)

    def search(self, query_qd: np.ndarray, k: int) -> list[Reranked]:
        """The exact top-k of each float32 query [Q, D] (faiss's order), every one proven."""
        query_qd = np.asarray(query_qd, np.float32)
        bounds = score_bound(query_qd, self.index.error_max, self.index.norm_max)
        rows = self.index.layout.rows
        answers: list[Reranked | None] = [None] * len(query_qd)
        pending = np.arange(len(query_qd))
        for m in candidate_counts(k, rows, candidates=self.candidates, max_candidates=self.max_candidates):
            if not len(pending):
                break
            approx_qm, ids_qm = self._device_candidates(query_qd[pending], m)
            left = []
            for row, i in enumerate(pending):
                answer = rerank(self.vectors_nd, query_qd[i], ids_qm[row], approx_qm[row], k, bounds[i], rows)
                if answer.proven:
                    answers[i] = answer
                else:
                    left.append(i)
            pending = np.asarray(left, np.int64)
        for i in pending:
            answers[i] = self._host_scan(query_qd[i], k)
        return answers
