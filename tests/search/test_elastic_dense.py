"""e5 kNN through Elasticsearch: the request bodies and mapping against ES's documented API, and, on noida-db (which
answers top-level `knn` searches) or the cluster at env LLDS_ES_URL, index_builder --to elasticsearch --encoder e5,
retrieval equal to a brute-force NumPy search, resume, and a BM25 index refused by check()."""
import asyncio
import json
import uuid

import numpy as np
import pytest

from index_builder.__main__ import main as index_builder_main
from index_builder.build import EXIT_INDEX
from llds_jax.search import RetrieverUnavailableError, make_retriever
from llds_jax.search.elastic import index_body, knn_body
from llds_jax.search.synthetic import SyntheticCorpus
from tests.search.test_dense import MAX_LENGTH, assert_brute_force, brute_force
from tests.search.test_e5 import reference_embeddings
from tests.servers import delete_es_index

N_DOCS = 60


def test_knn_body_is_es_top_level_knn_search():
    # https://www.elastic.co/guide/en/elasticsearch/reference/8.15/knn-search.html: "knn": {field, query_vector,
    # k, num_candidates}; size and _source as in any search.
    assert knn_body(np.array([0.5, -0.25], np.float32), 3, num_candidates=100) == {
        "knn": {"field": "embedding", "query_vector": [0.5, -0.25], "k": 3, "num_candidates": 100},
        "size": 3, "_source": ["id", "contents"]}
    assert knn_body([1.0], 200, field="v", num_candidates=100)["knn"]["num_candidates"] == 200  # at least k
    json.dumps(knn_body(np.ones(4, np.float32), 1))  # float32 entries become JSON numbers


def test_dense_mapping_is_a_dot_product_dense_vector():
    # https://www.elastic.co/guide/en/elasticsearch/reference/8.15/dense-vector.html
    properties = index_body(dense_dims=768)["mappings"]["properties"]
    assert properties["embedding"] == {"type": "dense_vector", "dims": 768, "index": True,
                                       "similarity": "dot_product", "index_options": {"type": "hnsw"}}
    assert "embedding" not in index_body()["mappings"]["properties"]
    assert index_body(dense_dims=8, vector_index="int8_hnsw")["mappings"]["properties"]["embedding"][
        "index_options"] == {"type": "int8_hnsw"}


@pytest.fixture(scope="module")
def dense_es(es_url, e5_folder, tmp_path_factory):
    """(index name, records, corpus path) of a dense index built with the CLI; deleted at the end."""
    records = list(SyntheticCorpus(N_DOCS, seed=8, n_planted=2, vocab_size=200, words_per_doc=(5, 12)).records())
    path = tmp_path_factory.mktemp("es_dense") / "c.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    name = f"llds-test-{uuid.uuid4().hex[:8]}"
    status = index_builder_main([str(path), "--to", "elasticsearch", "--encoder", "e5", "--encoder-path", e5_folder,
                                 "--max-length", str(MAX_LENGTH), "--es-hosts", es_url, "--es-index", name,
                                 "--bulk-docs", "16", "--no-progress"])
    assert status == 0
    yield name, records, str(path)
    delete_es_index(es_url, name)


def dense_search(es_url, e5_folder, index, queries, k=3):
    async def run():
        retriever = make_retriever({"backend": "elasticsearch", "hosts": es_url, "index": index,
                                    "encoder_path": e5_folder, "max_length": MAX_LENGTH, "batch_size": 2,
                                    "num_candidates": N_DOCS})
        try:
            await retriever.check()
            return await retriever.search(queries, k)
        finally:
            await retriever.close()

    return asyncio.run(run())


def test_knn_search_matches_brute_force(es_url, e5_folder, dense_es):
    index, records, _ = dense_es
    queries = ["Which river flows past the village of Zylo0 Quarn0?", "bada kimo", "x", "river banks"]
    passage_nd = reference_embeddings(e5_folder, ["passage: " + r["contents"] for r in records], MAX_LENGTH)
    results = dense_search(es_url, e5_folder, index, queries)
    assert_brute_force(results, records, *brute_force(e5_folder, queries, passage_nd))


def test_rebuild_embeds_nothing_already_indexed(es_url, e5_folder, dense_es, capsys):
    index, _, path = dense_es
    status = index_builder_main([path, "--to", "elasticsearch", "--encoder", "e5", "--encoder-path", e5_folder,
                                 "--max-length", str(MAX_LENGTH), "--es-hosts", es_url, "--es-index", index,
                                 "--bulk-docs", "16", "--no-progress"])
    printed = capsys.readouterr().out
    assert status == 0
    assert "documents indexed this run: 0 in" in printed and f"already present (resume): {N_DOCS}\n" in printed


def test_bm25_index_is_refused_for_knn_naming_field_and_encoder(es_url, es_index, e5_folder, capsys,
                                                                small_corpus):
    with pytest.raises(RetrieverUnavailableError,
                       match=f"index '{es_index}'\\): field 'embedding' is missing, not a dense_vector, but"
                             f" retriever.encoder_path {e5_folder} \\(32 dimensions\\) asks for kNN search"):
        dense_search(es_url, e5_folder, es_index, ["q"])
    status = index_builder_main([small_corpus[0], "--to", "elasticsearch", "--encoder", "e5", "--encoder-path",
                                 e5_folder, "--max-length", str(MAX_LENGTH), "--es-hosts", es_url, "--es-index",
                                 es_index, "--no-progress"])
    assert status == EXIT_INDEX
    assert "exists without a dense_vector field 'embedding' (a BM25 index)" in capsys.readouterr().err
