"""The embedded BM25 backend: planted answers, exact Lucene-variant scores, streaming build, save/load, laziness."""
import asyncio
import collections
import math
import os
import shutil
import threading

import bm25s
import numpy as np
import pytest

from llds_jax.search import SearchResult, make_retriever
from llds_jax.search.analyzer import analyze
from llds_jax.search.bm25 import Bm25Retriever, top_k_postings
from llds_jax.search.bm25_index import Bm25IndexWriter
from llds_jax.search.docstore import DocStore
from llds_jax.search.synthetic import SyntheticCorpus

K1, B = 0.9, 0.4


def lucene_bm25(records, query):
    """Scores of every document for `query`, from the formula alone (terms from the same analyzer)."""
    docs = [collections.Counter(analyze(r["contents"])) for r in records]
    lengths = [sum(d.values()) for d in docs]
    n, avgdl = len(docs), sum(lengths) / len(docs)
    df = collections.Counter(t for d in docs for t in d)
    scores = []
    for tf, dl in zip(docs, lengths):
        score = 0.0
        for t in analyze(query):
            if tf[t]:
                idf = math.log(1 + (n - df[t] + 0.5) / (df[t] + 0.5))
                score += idf * tf[t] * (K1 + 1) / (tf[t] + K1 * (1 - B + B * dl / avgdl))
        scores.append(score)
    return scores


def build(records, out_dir, chunk_docs):
    writer = Bm25IndexWriter(out_dir, k1=K1, b=B, chunk_docs=chunk_docs)
    for r in records:
        writer.add(r["id"], r["contents"])
    writer.finish()
    return out_dir


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(records, index folder) of 60 short passages over a 150-word vocabulary (repeated terms, varied lengths)."""
    corpus = SyntheticCorpus(60, seed=3, n_planted=2, vocab_size=150, words_per_doc=(3, 30))
    records = list(corpus.records())
    return records, build(records, str(tmp_path_factory.mktemp("tiny") / "index"), chunk_docs=16)


def test_planted_answer_is_top1(small_corpus, bm25_index):
    corpus = small_corpus[1]

    async def run():
        async with make_retriever({"backend": "bm25", "index_dir": bm25_index, "workers": 3}) as retriever:
            await retriever.check()
            return await retriever.search([p.query for p in corpus.planted], k=3)

    results = asyncio.run(run())
    assert [r.error for r in results] == [None] * len(corpus.planted)
    assert [r.docs[0].id for r in results] == [p.doc_id for p in corpus.planted]
    assert all(len(r.docs) == 3 for r in results)
    top = results[0].docs[0]
    assert top.title == '"Zylo0 Quarn0"' and top.text.startswith("Zylo0 Quarn0 is a village")


def test_scores_match_independent_lucene_bm25_formula(tiny):
    records, index_dir = tiny
    queries = SyntheticCorpus(60, seed=3, n_planted=2, vocab_size=150).random_queries(25, seed=5)
    retriever = Bm25Retriever(index_dir)
    results = retriever.search_blocking(queries, k=10)
    for query, result in zip(queries, results):
        expected = lucene_bm25(records, query)
        got = [d.score for d in result.docs]
        assert len(got) == min(10, sum(s > 0 for s in expected))
        np.testing.assert_allclose(got, sorted(expected, reverse=True)[:len(got)], rtol=2e-6)
        for doc in result.docs:  # each document carries its own score, not a neighbour's
            assert doc.score == pytest.approx(expected[int(doc.id)], rel=2e-6)
            assert doc.contents == records[int(doc.id)]["contents"]
    asyncio.run(retriever.close())


def test_streaming_build_equals_bm25s_in_memory_build(tiny):
    records, index_dir = tiny  # built 16 documents at a time
    tokens = [analyze(r["contents"]) for r in records]
    reference = bm25s.BM25(k1=K1, b=B, method="atire", idf_method="lucene")
    reference.index(tokens, show_progress=False)
    ours = bm25s.BM25.load(index_dir, mmap=True)
    assert ours.scores["num_docs"] == reference.scores["num_docs"] == len(records)
    assert set(ours.vocab_dict) == set(reference.vocab_dict) - {""}
    for term, ours_id in ours.vocab_dict.items():
        ref_id = reference.vocab_dict[term]
        a, b = (ours.scores["indptr"][ours_id:ours_id + 2], reference.scores["indptr"][ref_id:ref_id + 2])
        our_docs, ref_docs = ours.scores["indices"][a[0]:a[1]], reference.scores["indices"][b[0]:b[1]]
        order = np.argsort(ref_docs)
        np.testing.assert_array_equal(our_docs, ref_docs[order])
        np.testing.assert_allclose(ours.scores["data"][a[0]:a[1]], reference.scores["data"][b[0]:b[1]][order],
                                   rtol=1e-6)


def test_save_load_round_trip_gives_identical_results(tiny, tmp_path):
    records, index_dir = tiny
    queries = SyntheticCorpus(60, seed=3, n_planted=2, vocab_size=150).random_queries(30, seed=9)
    tokens = [analyze(r["contents"]) for r in records]
    in_memory = bm25s.BM25(k1=K1, b=B, method="atire", idf_method="lucene")
    in_memory.index(tokens, show_progress=False)
    found = in_memory.retrieve([[t for t in analyze(q) if t in in_memory.vocab_dict] for q in queries], k=5,
                               show_progress=False, backend_selection="numpy")

    moved = str(tmp_path / "moved")
    shutil.copytree(index_dir, moved)
    first = Bm25Retriever(index_dir).search_blocking(queries, k=5)
    rebuilt = Bm25Retriever(build(records, str(tmp_path / "rebuilt"), chunk_docs=1000)).search_blocking(queries, 5)
    assert Bm25Retriever(moved).search_blocking(queries, k=5) == first
    assert rebuilt == first
    for result, numbers, scores in zip(first, found.documents, found.scores):
        # bm25s orders equal scores arbitrarily, we by document number.
        reference = sorted((-s, n) for n, s in zip(numbers, scores) if s > 0)
        assert [d.id for d in result.docs] == [str(n) for _, n in reference]
        np.testing.assert_allclose([d.score for d in result.docs], [-s for s, _ in reference], rtol=1e-6)


def test_docstore_reads_each_document_back_lazily(tmp_path):
    records = [{"id": "a", "contents": '"Tïtle"\nline one\nline "two" ✓'}, {"id": "b", "contents": '"B"\n'},
               {"id": "c", "contents": '"C"\nthe end'}]
    index_dir = build(records, str(tmp_path / "index"), chunk_docs=2)
    store = DocStore(index_dir)
    assert [store.get(i) for i in range(len(store))] == [(r["id"], r["contents"]) for r in records]
    store.close()
    with open(os.path.join(index_dir, "docs.jsonl"), "ab") as f:
        f.write(b"extra")
    expected = r"docs.jsonl: 148 bytes but doc_offsets.npy expects 143 \(the index folder is incomplete"
    with pytest.raises(ValueError, match=expected):
        DocStore(index_dir)


def test_search_runs_off_the_event_loop_and_keeps_query_order(small_corpus, bm25_index):
    corpus = small_corpus[1]
    planted = corpus.planted
    queries = [planted[0].query, "nothing matches xqxq", planted[3].query, "the of and", planted[5].query]
    retriever = Bm25Retriever(bm25_index, workers=2)
    threads = []
    blocking = retriever.search_blocking

    def spy(part, k):
        threads.append(threading.current_thread().name)
        return blocking(part, k)

    retriever.search_blocking = spy

    async def run():
        results = await retriever.search(queries, k=2)
        await retriever.close()
        return results

    results = asyncio.run(run())
    assert threads and all(name.startswith("bm25-search") for name in threads)
    assert len(threads) == 2  # the batch was split over both workers
    assert [r.docs[0].id if r.docs else None for r in results] == [
        planted[0].doc_id, None, planted[3].doc_id, None, planted[5].doc_id]
    assert results[1] == SearchResult([]) and results[3] == SearchResult([])


def test_k_larger_than_corpus_returns_every_matching_document(tiny):
    records, index_dir = tiny
    retriever = Bm25Retriever(index_dir)
    query = records[0]["contents"]
    result = retriever.search_blocking([query], k=1000)[0]
    assert len(result.docs) == sum(s > 0 for s in lucene_bm25(records, query))


def test_backend_failure_becomes_error_results(tiny, tmp_path):
    broken = str(tmp_path / "broken")
    shutil.copytree(tiny[1], broken)

    async def run():
        retriever = Bm25Retriever(broken)
        os.truncate(os.path.join(broken, "docs.jsonl"), 0)  # the store vanishes under a running retriever
        results = await retriever.search(["Zylo0 Quarn0", "Zylo1"], k=3)
        await retriever.close()
        return results

    results = asyncio.run(run())
    assert [r.docs for r in results] == [[], []]
    assert all(r.error.startswith(f"bm25 backend (index {broken}) failed:") for r in results)


def test_missing_index_folder_is_named():
    with pytest.raises(FileNotFoundError, match="/no/such/index: not an embedded BM25 index folder"):
        make_retriever({"backend": "bm25", "index_dir": "/no/such/index"})


def test_equal_scores_are_ordered_by_document_number(tmp_path):
    records = [{"id": f"d{i}", "contents": '"Same"\nalpha beta'} for i in range(6)]
    records.insert(3, {"id": "other", "contents": '"Other"\nalpha alpha beta gamma'})
    retriever = Bm25Retriever(build(records, str(tmp_path / "index"), chunk_docs=4))
    result = retriever.search_blocking(["alpha beta"], k=4)[0]
    assert [d.id for d in result.docs] == ["other", "d0", "d1", "d2"]
    assert result.docs[1].score == result.docs[2].score == result.docs[3].score < result.docs[0].score


def test_top_k_postings_sums_terms_counts_duplicates_and_leaves_the_accumulator_zero():
    accumulator = np.zeros(20, np.float32)  # 6 postings < 20 documents / 2: the sparse path
    postings = [(np.array([1, 4, 7]), np.array([1.0, 2.0, 0.5], np.float32), 1),
                (np.array([4, 7, 9]), np.array([0.25, 3.0, 1.0], np.float32), 2)]
    numbers, scores = top_k_postings(accumulator, postings, k=3)
    assert numbers.tolist() == [7, 4, 9] and scores.tolist() == [6.5, 2.5, 2.0]
    assert not accumulator.any()
    numbers, scores = top_k_postings(accumulator, postings, k=10)
    assert numbers.tolist() == [7, 4, 9, 1] and scores.tolist() == [6.5, 2.5, 2.0, 1.0]
    assert top_k_postings(accumulator, [], k=3)[0].tolist() == []


def test_top_k_postings_dense_path_when_most_documents_match():
    accumulator = np.zeros(4, np.float32)
    postings = [(np.array([0, 1, 2]), np.array([1.0, 3.0, 2.0], np.float32), 1),
                (np.array([2, 3]), np.array([2.0, 0.5], np.float32), 1)]
    numbers, scores = top_k_postings(accumulator, postings, k=2)  # 5 postings >= 4 documents / 2
    assert numbers.tolist() == [2, 1] and scores.tolist() == [4.0, 3.0]
    assert not accumulator.any()


def test_documents_without_indexable_terms_are_stored_but_never_match(tmp_path):
    records = [{"id": "0", "contents": '"A"\nalpha beta'}, {"id": "1", "contents": "the of and"},
               {"id": "2", "contents": '"The"\nto be or not to be'}, {"id": "3", "contents": '"Beta"\nbeta'}]
    index_dir = build(records, str(tmp_path / "index"), chunk_docs=1)  # chunks 1 and 2 have no terms at all
    retriever = Bm25Retriever(index_dir)
    assert retriever.num_docs == 4
    assert [d.id for d in retriever.search_blocking(["beta the"], k=4)[0].docs] == ["3", "0"]
    assert retriever.search_blocking(["to be"], k=4)[0].docs == []
    expected = lucene_bm25(records, "alpha beta")
    assert [d.score for d in retriever.search_blocking(["alpha beta"], k=4)[0].docs] == pytest.approx(
        sorted((s for s in expected if s > 0), reverse=True), rel=2e-6)
