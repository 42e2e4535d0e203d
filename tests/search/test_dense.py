"""The embedded dense backend: Search-R1-style faiss files (Flat, HNSW) and index_builder folders, searched through
the async Retriever API, against a brute-force NumPy search over the same embeddings; and its bad-input errors."""
import asyncio
import gzip
import json

import faiss
import numpy as np
import pytest

from llds_jax.search import make_retriever
from llds_jax.search.dense import FaissRetriever
from llds_jax.search.docstore import DocStore, line_offsets
from llds_jax.search.e5 import E5Embedder
from llds_jax.search.synthetic import SyntheticCorpus
from tests.search.test_e5 import reference_embeddings

MAX_LENGTH = 64
K = 3


@pytest.fixture(scope="module")
def dense_corpus(tmp_path_factory):
    """(path, records, queries): 120 short passages with 4 planted ones, plain JSON lines."""
    corpus = SyntheticCorpus(120, seed=3, n_planted=4, vocab_size=400, words_per_doc=(6, 14))
    path = corpus.write(str(tmp_path_factory.mktemp("dense") / "wiki.jsonl"))
    queries = [q.query for q in corpus.planted] + corpus.random_queries(6, seed=5)
    return path, list(corpus.records()), queries


@pytest.fixture(scope="module")
def passage_emb(e5_folder, dense_corpus):
    """[120, 32] passage embeddings computed the way Search-R1 builds its index (transformers, "passage: ")."""
    return reference_embeddings(e5_folder, ["passage: " + r["contents"] for r in dense_corpus[1]], MAX_LENGTH)


def write_index(path: str, spec: str, emb_nd: np.ndarray) -> str:
    index = faiss.index_factory(emb_nd.shape[1], spec, faiss.METRIC_INNER_PRODUCT)
    index.add(emb_nd)
    faiss.write_index(index, path)
    return path


def brute_force(e5_folder, queries, passage_nd, k=K):
    """(rows [Q, k], scores [Q, k]) of the exact inner-product search in NumPy."""
    query_qd = reference_embeddings(e5_folder, ["query: " + q for q in queries], MAX_LENGTH)
    scores_qn = query_qd @ passage_nd.T
    rows_qk = np.argsort(-scores_qn, axis=1, kind="stable")[:, :k]
    return rows_qk, np.take_along_axis(scores_qn, rows_qk, axis=1)


def search(retriever, queries, k=K):
    async def run():
        await retriever.check()
        try:
            return await retriever.search(queries, k)
        finally:
            await retriever.close()

    return asyncio.run(run())


def assert_brute_force(results, records, rows_qk, scores_qk):
    for result, rows, scores in zip(results, rows_qk, scores_qk):
        assert result.error is None
        assert [d.id for d in result.docs] == [records[r]["id"] for r in rows]
        assert [d.contents for d in result.docs] == [records[r]["contents"] for r in rows]
        np.testing.assert_allclose([d.score for d in result.docs], scores, atol=2e-5)


@pytest.mark.parametrize("spec, ef_search", [("Flat", 0), ("HNSW64", 256)])
def test_search_r1_index_file_matches_brute_force(tmp_path, e5_folder, dense_corpus, passage_emb, spec, ef_search):
    path, records, queries = dense_corpus
    index = write_index(str(tmp_path / f"e5_{spec}.index"), spec, passage_emb)
    retriever = make_retriever({"backend": "faiss", "index_path": index, "corpus_path": path,
                                "encoder_path": e5_folder, "max_length": MAX_LENGTH, "hnsw_ef_search": ef_search})
    rows_qk, scores_qk = brute_force(e5_folder, queries, passage_emb)
    results = search(retriever, queries)
    assert len(results) == len(queries)
    assert_brute_force(results, records, rows_qk, scores_qk)


def test_more_documents_asked_than_indexed(tmp_path, e5_folder, dense_corpus, passage_emb):
    path, records, queries = dense_corpus
    index = write_index(str(tmp_path / "small.index"), "Flat", passage_emb[:5])
    retriever = FaissRetriever(index, e5_folder, corpus_path=path, max_length=MAX_LENGTH)
    (result,) = search(retriever, queries[:1], k=10)
    rows_qk, scores_qk = brute_force(e5_folder, queries[:1], passage_emb[:5], k=5)
    assert_brute_force([result], records, rows_qk, scores_qk)


def test_corpus_row_store_reads_lines_by_offset(tmp_path):
    path = tmp_path / "c.jsonl"
    lines = [{"id": 7, "contents": '"T"\nünïcode'}, {"id": "b", "contents": '"U"\nx'}]
    path.write_bytes(("\n".join(json.dumps(r, ensure_ascii=False) for r in lines)).encode())  # no final newline
    np.testing.assert_array_equal(line_offsets(str(path)), [0, len(path.read_bytes().split(b"\n")[0]) + 1,
                                                            path.stat().st_size])
    store = DocStore.of_corpus(str(path))
    assert len(store) == 2 and store.get(0) == ("7", '"T"\nünïcode') and store.get(1) == ("b", '"U"\nx')
    store.close()
    assert (tmp_path / "c.jsonl.offsets.npy").exists()  # cached for the next start
    gz = tmp_path / "c.jsonl.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    with pytest.raises(ValueError, match="c.jsonl.gz: rows are read by byte offset.*decompress it"):
        DocStore.of_corpus(str(gz))


def test_dimension_mismatch_names_index_and_encoder(tmp_path, e5_folder, dense_corpus):
    index = write_index(str(tmp_path / "d16.index"), "Flat", np.eye(16, dtype=np.float32))
    with pytest.raises(ValueError, match=f"faiss index {index} holds 16-dimensional vectors but encoder"
                                         f" {e5_folder} embeds 32 dimensions"):
        FaissRetriever(index, e5_folder, corpus_path=dense_corpus[0], max_length=MAX_LENGTH)


def test_short_corpus_names_corpus_and_index(tmp_path, e5_folder, dense_corpus, passage_emb):
    index = write_index(str(tmp_path / "e5.index"), "Flat", passage_emb)
    short = tmp_path / "short.jsonl"
    short.write_text("".join(open(dense_corpus[0]).readlines()[:100]))
    with pytest.raises(ValueError, match=f"corpus {short} has 100 lines but faiss index {index} has 120 rows"):
        FaissRetriever(index, e5_folder, corpus_path=str(short), max_length=MAX_LENGTH)


def test_missing_encoder_folder_and_missing_corpus_key(tmp_path, e5_folder, dense_corpus, passage_emb):
    index = write_index(str(tmp_path / "e5.index"), "Flat", passage_emb)
    with pytest.raises(FileNotFoundError, match=f"encoder folder {tmp_path}/none \\(retriever.encoder_path\\)"):
        FaissRetriever(index, str(tmp_path / "none"), corpus_path=dense_corpus[0])
    with pytest.raises(ValueError, match="is a file: retriever.corpus_path must name its corpus"):
        FaissRetriever(index, e5_folder)
    with pytest.raises(FileNotFoundError, match=f"faiss index {tmp_path}/nope.index not found"):
        FaissRetriever(str(tmp_path / "nope.index"), e5_folder, corpus_path=dense_corpus[0])
    with pytest.raises(ValueError, match="hnsw_ef_search is set but faiss index .* is not HNSW"):
        FaissRetriever(index, e5_folder, corpus_path=dense_corpus[0], hnsw_ef_search=64, max_length=MAX_LENGTH)


def test_our_embedder_matches_the_reference_used_above(e5_folder, dense_corpus, passage_emb):
    ours = E5Embedder(e5_folder, max_length=MAX_LENGTH).embed_passages([r["contents"] for r in dense_corpus[1]])
    np.testing.assert_allclose(ours, passage_emb, atol=1e-5)


@pytest.mark.slow
def test_search_r1_server_serves_the_dense_backend(tmp_path, e5_folder, dense_corpus, passage_emb,
                                                   search_server_factory, post_json, free_port):
    """POST /retrieve (Search-R1's request and answer) over the faiss backend equals the brute-force search."""
    path, records, queries = dense_corpus
    index = write_index(str(tmp_path / "e5_Flat.index"), "Flat", passage_emb)
    url = search_server_factory(free_port(), "backend=faiss", f"index_path={index}", f"corpus_path={path}",
                                f"encoder_path={e5_folder}", f"max_length={MAX_LENGTH}")
    status, body = post_json(f"{url}/retrieve", {"queries": queries, "topk": K, "return_scores": True})
    assert status == 200
    rows_qk, scores_qk = brute_force(e5_folder, queries, passage_emb)
    for items, rows, scores in zip(body["result"], rows_qk, scores_qk):
        assert [item["document"] for item in items] == [records[r] for r in rows]
        np.testing.assert_allclose([item["score"] for item in items], scores, atol=2e-5)
