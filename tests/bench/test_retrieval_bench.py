"""bench/retrieval.py --search-only on tiny sizes: faiss Flat and HNSW64 over the same rows, every printed figure
present, HNSW's recall@3 a fraction, and the recall helper against hand-made top-k lists."""
import re

import numpy as np
import pytest

from tests.bench.loading import load_bench


def test_recall_at_k_counts_shared_ids_and_never_faiss_missing_results():
    bench = load_bench("retrieval")
    exact = np.array([[1, 2, 3], [4, 5, 6]])
    assert bench.recall_at_k(exact, exact) == 1.0
    assert bench.recall_at_k(np.array([[3, 9, 1], [-1, -1, -1]]), exact) == (2 / 3 + 0) / 2


def test_search_only_prints_flat_and_hnsw_costs_and_a_recall_fraction(capsys):
    bench = load_bench("retrieval")
    bench.main(["--search-only", "--dense-rows", "2000", "--dense-queries", "32", "--dense-batch", "16"])
    out = capsys.readouterr().out
    assert "search only" in out and "load average" in out
    assert re.search(r"32 random unit query vectors in batches of 16, top-3, 2,000 random unit rows of 768 floats,"
                     r" faiss threads \d+ \(omp_get_max_threads\)", out)
    number = r"[\d,.]+(?:e[-+]\d+)?"
    assert re.search(rf"faiss Flat search alone: {number} queries/s, {number} s/query, {number} s/query per million"
                     rf" rows -> {number} s/query at wiki-18's 21,015,324 rows", out)
    hnsw = re.search(rf"faiss HNSW64 search alone \(efSearch 16\): {number} queries/s, {number} s/query,"
                     rf" recall@3 ({number}) of Flat's exact top-3", out)
    assert hnsw, out
    assert 0.0 <= float(hnsw.group(1)) <= 1.0
    assert "hard case for HNSW" in out
    assert "passages/s" not in out and "BertModel" not in out  # no encoder in --search-only


def test_flat_and_hnsw_hold_the_same_rows_and_flat_is_exact():
    bench = load_bench("retrieval")
    flat, hnsw, build_s = bench.dense_indexes(500, 768)
    assert flat.ntotal == hnsw.ntotal == 500 and build_s >= 0
    assert hnsw.hnsw.efSearch == 16
    rows = np.concatenate(list(bench.random_unit_rows(500, 768, seed=0)))
    query_qd = np.concatenate(list(bench.random_unit_rows(8, 768, seed=3)))
    n = bench.search_alone(flat, hnsw, query_qd, batch=4)
    assert n["rows"] == 500 and n["queries"] == 8 and n["threads"] >= 1
    assert 0.0 <= n["hnsw"]["recall"] <= 1.0
    _, flat_ids = bench.search_seconds(flat, query_qd, 4)
    np.testing.assert_array_equal(flat_ids, np.argsort(-(query_qd @ rows.T), axis=1)[:, :3])
    assert n["flat"]["wiki18_s_per_query"] == pytest.approx(n["flat"]["s_per_query_per_m_rows"] * 21.015324)
