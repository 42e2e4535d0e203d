"""The e5 retriever on the devices (backend e5_device): its top-k equals faiss IndexFlatIP's, ids and order, on a
random index of 200,000 unit rows of 768 floats and on an e5 index that index_builder builds over the demo world,
with the rows sharded over the 8 CPU devices; its error bound holds for every row; ties come in faiss's order; in a
run of two processes each searches its own copy."""
import asyncio
import json
import os

import faiss
import jax
import numpy as np
import pytest

from index_builder.__main__ import main as index_builder_main
from llds_jax.data import synthetic
from llds_jax.search import make_retriever
from llds_jax.search.dense import read_faiss_index
from llds_jax.search.device_index import flat_vectors, load
from llds_jax.search.device_search import ExactSearcher, candidates_program, faiss_order, score_bound
from tests.servers import two_process_results

DIM = 768


def unit_rows(rng, n, dim=DIM):
    x = rng.standard_normal((n, dim), dtype=np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@pytest.fixture(scope="module")
def random_flat(tmp_path_factory):
    """(file, faiss index read memory-mapped, queries [64, 768]): 200,000 random unit rows in a Flat IP file."""
    rng = np.random.default_rng(11)
    index = faiss.IndexFlatIP(DIM)
    index.add(unit_rows(rng, 200_000))
    path = str(tmp_path_factory.mktemp("flat") / "e5_Flat.index")
    faiss.write_index(index, path)
    return path, read_faiss_index(path), unit_rows(rng, 64)


def test_eight_devices():
    assert len(jax.devices()) == 8  # the sharded path below splits the rows over all of them


@pytest.mark.parametrize("dtype, k", [("bfloat16", 3), pytest.param("int8", 10, marks=pytest.mark.slow)])
def test_top_k_equals_faiss_flat_on_200k_random_rows(random_flat, dtype, k):
    path, index, query_qd = random_flat
    vectors_nd = flat_vectors(index, path)
    device_index = load(vectors_nd, jax.devices(), dtype=dtype, block_rows=8192)
    assert device_index.layout.shards == 8 and device_index.vectors.sharding.num_devices == 8
    searcher = ExactSearcher(device_index, vectors_nd, candidates=16)
    answers = searcher.search(query_qd, k)
    scores_qk, ids_qk = index.search(query_qd, k)
    assert [a.ids.tolist() for a in answers] == ids_qk.tolist()
    np.testing.assert_allclose([a.scores for a in answers], scores_qk, atol=1e-6)
    assert searcher.host_scans == 0


def test_the_bound_holds_for_every_row_and_unproven_queries_are_widened(random_flat):
    """On 20,000 of the rows in int8 (the coarser storage): every row's approximate score from the chips is within
    B(q) of its exact score; with one candidate per query nothing is proven (the k-th exact score is never above
    the lowest candidate's approximate score plus B), so each query is searched again with more candidates and
    the answer is still faiss's."""
    path, index, query_qd = random_flat
    vectors_nd = flat_vectors(index, path)[:20_000]
    device_index = load(vectors_nd, jax.devices(), dtype="int8", block_rows=1024)
    program = candidates_program(device_index.layout, device_index.mesh, 20_000)
    approx_qn, ids_qn = program(device_index.vectors, device_index.scales,
                                query_qd[:8].astype(jax.numpy.bfloat16))
    approx_qn, ids_qn = np.asarray(approx_qn, np.float64), np.asarray(ids_qn)
    assert sorted(ids_qn[0].tolist()) == list(range(20_000))
    exact_qn = np.einsum("qnd,qd->qn", vectors_nd[ids_qn].astype(np.float64), query_qd[:8].astype(np.float64))
    bound_q = score_bound(query_qd[:8], device_index.error_max, device_index.norm_max)
    gap_q = np.abs(exact_qn - approx_qn).max(axis=1)
    assert np.all(gap_q <= bound_q) and np.all(gap_q > bound_q / 20)  # holds, and not vacuously loose

    searcher = ExactSearcher(device_index, vectors_nd, candidates=1)
    answers = searcher.search(query_qd, 3)
    flat = faiss.IndexFlatIP(DIM)
    flat.add(vectors_nd)
    assert [a.ids.tolist() for a in answers] == flat.search(query_qd, 3)[1].tolist()
    assert searcher.passes[3] == 1 and sum(searcher.passes.values()) > 1


def test_past_max_candidates_a_query_is_scanned_on_the_host(random_flat):
    path, index, query_qd = random_flat
    vectors_nd = flat_vectors(index, path)[:5000]
    device_index = load(vectors_nd, jax.devices(), dtype="int8", block_rows=1024)
    searcher = ExactSearcher(device_index, vectors_nd, candidates=1, max_candidates=2)
    answers = searcher.search(query_qd[:2], 2)
    flat = faiss.IndexFlatIP(DIM)
    flat.add(vectors_nd)
    assert [a.ids.tolist() for a in answers] == flat.search(query_qd[:2], 2)[1].tolist()
    assert searcher.host_scans == 2


def test_ties_come_in_faiss_order():
    """Rows 3, 8, 20, 33, 40 equal row 1's vector: faiss keeps the lowest ids among equal scores and lists them
    highest id first, with a better row (row 0 = 2 x row 1) ahead; the retriever's answer is the same."""
    rng = np.random.default_rng(5)
    x = unit_rows(rng, 48, dim=64)
    for row in (3, 8, 20, 33, 40):
        x[row] = x[1]
    x[0] = 2 * x[1]
    flat = faiss.IndexFlatIP(64)
    flat.add(x)
    device_index = load(x, jax.devices(), dtype="bfloat16", block_rows=8)
    query = x[1:2].copy()
    for k in (2, 3, 5, 7):
        expected = flat.search(query, k)[1][0].tolist()
        assert ExactSearcher(device_index, x, candidates=k).search(query, k)[0].ids.tolist() == expected
    assert flat.search(query, 4)[1][0].tolist() == [0, 8, 3, 1]
    order = faiss_order(np.array([5, 2, 9, 7]), np.array([1.0, 2.0, 1.0, 1.0]), 3)
    assert order.tolist() == [1, 3, 0]  # ids 2, then 7 and 5 of the three tied at 1.0 (the lowest two kept)


@pytest.fixture(scope="module")
def world_e5_index(tmp_path_factory, e5_folder):
    """(index folder, world): index_builder's e5 Flat index over the demo world's 250 passages (200 people)."""
    world = synthetic.make_world(num_people=200, seed=0)
    files = synthetic.write_world(world, str(tmp_path_factory.mktemp("world")))
    out = str(tmp_path_factory.mktemp("world_e5") / "e5")
    status = index_builder_main([files["corpus.jsonl"], "--to", "faiss", "--encoder", "e5", "--encoder-path",
                                 e5_folder, "--out", out, "--max-length", "64", "--no-progress"])
    assert status == 0
    return out, world


def test_the_retriever_over_index_builders_e5_index_of_the_demo_world(world_e5_index, e5_folder):
    """Every question of the world (train and test) through `await search(...)`: the same documents and scores as
    the faiss backend over the same folder (IndexFlatIP), for top 3 and top 10."""
    folder, world = world_e5_index
    questions = [ex.question for ex in world.train + world.test]
    common = {"index_path": folder, "encoder_path": e5_folder, "max_length": 64}
    device = make_retriever({"backend": "e5_device", "candidates": 4, **common})
    host = make_retriever({"backend": "faiss", **common})

    async def both(k):
        await device.check()
        return await device.search(questions, k), await host.search(questions, k)

    async def run():
        try:
            return [await both(k) for k in (3, 10)]
        finally:
            await device.close()
            await host.close()

    for ours, faiss_results in asyncio.run(run()):
        assert len(ours) == len(questions) > 300
        for a, b in zip(ours, faiss_results):
            assert a.error is None and [d.id for d in a.docs] == [d.id for d in b.docs]
            np.testing.assert_allclose([d.score for d in a.docs], [d.score for d in b.docs], atol=1e-6)
    assert device.device_index.layout.shards == 8


def test_bad_inputs_name_the_config_key(tmp_path, e5_folder, world_e5_index):
    hnsw = faiss.IndexHNSWFlat(32, 8, faiss.METRIC_INNER_PRODUCT)
    hnsw.add(np.eye(32, dtype=np.float32))
    path = str(tmp_path / "e5_HNSW64.index")
    faiss.write_index(hnsw, path)
    corpus = os.path.join(world_e5_index[0], "docs.jsonl")
    with pytest.raises(ValueError, match=f"faiss index {path} \\(retriever.index_path\\) is a IndexHNSWFlat: "
                                         "backend e5_device reads the vectors of an exact Flat"):
        make_retriever({"backend": "e5_device", "index_path": path, "corpus_path": corpus,
                        "encoder_path": e5_folder})
    with pytest.raises(ValueError, match="is a file: retriever.corpus_path must name its corpus"):
        make_retriever({"backend": "e5_device", "index_path": path, "encoder_path": e5_folder})


TWO_HOSTS_WORKER = """
import asyncio, json, sys
import jax
from llds_jax.runtime import distributed
from llds_jax.search import make_retriever

port, pid, folder, encoder, questions = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], json.loads(sys.argv[5])
distributed.maybe_initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
retriever = make_retriever({"backend": "e5_device", "index_path": folder, "encoder_path": encoder, "max_length": 64,
                            "candidates": 4, "search_batch": 8})

async def run():
    try:
        # Host 0 sends every question one call at a time, host 1 one call of half of them: no call in step.
        calls = [[q] for q in questions] if pid == 0 else [questions[: len(questions) // 2]]
        return [[d.id for d in r.docs] for call in calls for r in await retriever.search(call, 3)]
    finally:
        await retriever.close()

print("RESULT " + json.dumps({"ids": asyncio.run(run()), "processes": jax.process_count(),
                              "shards": retriever.device_index.layout.shards,
                              "shard_devices": sorted(d.id for d in retriever.device_index.vectors.devices()),
                              "local_devices": sorted(d.id for d in jax.local_devices())}),
      flush=True)
"""


@pytest.mark.slow
def test_each_host_of_a_two_process_run_searches_its_own_copy(tmp_path, world_e5_index, e5_folder):
    """Two JAX processes of 4 CPU devices each (a two-host run): each holds the whole index over its own 4 devices
    and answers its own calls, however many, at its own pace (a search over both hosts' devices would be a
    collective program that hangs unless both call it in step), with faiss IndexFlatIP's top 3."""
    folder, world = world_e5_index
    questions = [ex.question for ex in world.test[:24]]
    script = tmp_path / "worker.py"
    script.write_text(TWO_HOSTS_WORKER)
    results = two_process_results(str(script), folder, e5_folder, json.dumps(questions), timeout=240)
    host = make_retriever({"backend": "faiss", "index_path": folder, "encoder_path": e5_folder, "max_length": 64})

    async def faiss_ids():
        try:
            return [[d.id for d in r.docs] for r in await host.search(questions, 3)]
        finally:
            await host.close()

    expected = asyncio.run(faiss_ids())
    assert results[0]["ids"] == expected and results[1]["ids"] == expected[: len(questions) // 2]
    assert [r["processes"] for r in results] == [2, 2] and [r["shards"] for r in results] == [4, 4]
    assert [r["shard_devices"] for r in results] == [r["local_devices"] for r in results]
    assert not set(results[0]["shard_devices"]) & set(results[1]["shard_devices"])
