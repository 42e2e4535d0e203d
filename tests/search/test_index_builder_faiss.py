"""index_builder --to faiss --encoder e5: the folder it writes (vectors, row -> document map), resume after the last
complete shard, --skip-bad, and exit status 2 for a bad encoder or changed settings."""
import json
import os

import faiss
import numpy as np
import pytest

from index_builder.__main__ import main as index_builder_main
from index_builder.build import EXIT_BAD_CORPUS
from llds_jax.search.dense import FaissRetriever
from llds_jax.search.synthetic import SyntheticCorpus
from tests.search.test_dense import MAX_LENGTH, assert_brute_force, brute_force, search
from tests.search.test_e5 import reference_embeddings

N_DOCS = 130
BAD_LINE = 121


@pytest.fixture(scope="module")
def records():
    return list(SyntheticCorpus(N_DOCS, seed=4, n_planted=3, vocab_size=300, words_per_doc=(5, 12)).records())


def write_corpus(path, records, bad_line=None) -> str:
    lines = [json.dumps(r) for r in records]
    if bad_line:
        lines.insert(bad_line - 1, '{"id": "cut", "contents": "\\"Cut')
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def faiss_args(corpus, out, e5_folder, *extra):
    return [corpus, "--to", "faiss", "--encoder", "e5", "--encoder-path", e5_folder, "--out", out,
            "--max-length", str(MAX_LENGTH), "--embed-batch", "16", *extra]


def test_folder_search_matches_brute_force(tmp_path, e5_folder, records, capsys):
    corpus = write_corpus(tmp_path / "c.jsonl", records)
    out = str(tmp_path / "idx")
    assert index_builder_main(faiss_args(corpus, out, e5_folder, "--shard-docs", "50")) == 0
    printed, progress = capsys.readouterr()
    assert f"documents indexed this run: {N_DOCS} in" in printed and f"index now holds {N_DOCS} documents" in printed
    assert f"{N_DOCS} docs, " in progress and " docs/s" in progress and "100%" in progress
    assert sorted(os.listdir(out)) == ["doc_offsets.npy", "docs.jsonl", "index.faiss", "llds_index.json"]
    passage_nd = reference_embeddings(e5_folder, ["passage: " + r["contents"] for r in records], MAX_LENGTH)
    index = faiss.read_index(os.path.join(out, "index.faiss"))
    assert isinstance(index, faiss.IndexFlatIP)
    np.testing.assert_allclose(index.reconstruct_n(0, index.ntotal), passage_nd, atol=1e-5)
    queries = ["Which river flows past the village of Zylo1 Quarn1?", "bada kimo", "x"]
    retriever = FaissRetriever(out, e5_folder, max_length=MAX_LENGTH)
    assert_brute_force(search(retriever, queries), records, *brute_force(e5_folder, queries, passage_nd))


def test_interrupted_build_resumes_after_the_last_complete_shard(tmp_path, e5_folder, records, capsys):
    corpus = write_corpus(tmp_path / "c.jsonl", records, bad_line=BAD_LINE)
    out = str(tmp_path / "idx")
    args = faiss_args(corpus, out, e5_folder, "--shard-docs", "50", "--faiss-index", "HNSW32", "--no-progress")
    assert index_builder_main(args) == EXIT_BAD_CORPUS  # stops at the bad line, after two complete shards
    assert f"error: {corpus}:{BAD_LINE}: invalid JSON" in capsys.readouterr().err
    assert sorted(os.listdir(out + ".partial/shards")) == [
        "docs_000000.jsonl", "docs_000001.jsonl", "emb_000000.npy", "emb_000001.npy"]
    assert index_builder_main([*args, "--skip-bad"]) == 0
    printed = capsys.readouterr().out
    assert "documents already present (resume): 100\n" in printed
    assert f"documents indexed this run: {N_DOCS - 100} in" in printed and "malformed lines skipped: 1\n" in printed
    assert not os.path.exists(out + ".partial")
    index = faiss.read_index(os.path.join(out, "index.faiss"))
    assert isinstance(index, faiss.IndexHNSWFlat) and index.ntotal == N_DOCS
    passage_nd = reference_embeddings(e5_folder, ["passage: " + r["contents"] for r in records], MAX_LENGTH)
    np.testing.assert_allclose(index.storage.reconstruct_n(0, N_DOCS), passage_nd, atol=1e-5)
    with open(os.path.join(out, "docs.jsonl"), encoding="utf-8") as f:
        assert [json.loads(line)["id"] for line in f] == [r["id"] for r in records]


def test_resume_with_other_settings_is_refused(tmp_path, e5_folder, records, capsys):
    corpus = write_corpus(tmp_path / "c.jsonl", records, bad_line=BAD_LINE)
    out = str(tmp_path / "idx")
    assert index_builder_main(faiss_args(corpus, out, e5_folder, "--shard-docs", "50", "--no-progress")) == 2
    capsys.readouterr()
    assert index_builder_main(faiss_args(corpus, out, e5_folder, "--shard-docs", "60", "--no-progress")) == 2
    assert f"{out}.partial is a build with other settings (shard_docs: 50 then, 60 now)" in capsys.readouterr().err


@pytest.mark.parametrize("extra, message", [
    (["--encoder-path", "/no/such/e5"], "error: e5 encoder (--encoder-path): /no/such/e5: no model.safetensors"),
    (["--faiss-index", "Nonsense7"], "error: --faiss-index 'Nonsense7' is not a faiss index factory string"),
])
def test_bad_encoder_or_faiss_spec_is_one_line_exit_2(tmp_path, e5_folder, records, capsys, extra, message):
    corpus = write_corpus(tmp_path / "c.jsonl", records[:10])
    status = index_builder_main([*faiss_args(corpus, str(tmp_path / "i"), e5_folder), *extra, "--no-progress"])
    err = capsys.readouterr().err
    assert status == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_faiss_needs_an_encoder(tmp_path, records, capsys):
    corpus = write_corpus(tmp_path / "c.jsonl", records[:10])
    with pytest.raises(SystemExit) as exited:
        index_builder_main([corpus, "--to", "faiss", "--out", str(tmp_path / "i")])
    assert exited.value.code == 2 and "--to faiss needs --encoder e5" in capsys.readouterr().err
