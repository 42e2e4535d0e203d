"""index_builder: malformed lines (stop or --skip-bad), gzip input, interrupted builds, Elasticsearch resume."""
import asyncio
import gzip
import json
import os
import subprocess
import sys

import pytest

from index_builder.__main__ import main as index_builder_main
from index_builder.build import EXIT_BAD_CORPUS, EXIT_INDEX
from index_builder.corpus import CorpusError, CorpusReader, parse_line
from index_builder.to_bm25 import build_bm25
from index_builder.to_elasticsearch import build_elasticsearch
from llds_jax.search.bm25 import Bm25Retriever
from llds_jax.search.elastic import make_client
from llds_jax.search.synthetic import SyntheticCorpus

BROKEN_LINE = 5


@pytest.fixture
def broken_corpus(tmp_path):
    """(path, records): 20 passages with a truncated JSON line inserted as line 5."""
    records = list(SyntheticCorpus(20, seed=1, n_planted=2, vocab_size=100, words_per_doc=(5, 10)).records())
    lines = [json.dumps(r) for r in records]
    lines.insert(BROKEN_LINE - 1, '{"id": "bad", "contents": "\\"Cut\\"\\nthis line stops')
    path = tmp_path / "broken.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path), records


def test_malformed_line_stops_the_build_naming_file_and_line(broken_corpus, tmp_path, capsys):
    path, _ = broken_corpus
    out = str(tmp_path / "index")
    status = index_builder_main([path, "--to", "bm25", "--out", out, "--no-progress"])
    assert status == EXIT_BAD_CORPUS
    assert f"error: {path}:{BROKEN_LINE}: invalid JSON (Unterminated string" in capsys.readouterr().err
    assert not os.path.exists(out) and not os.path.exists(out + ".partial")


def test_skip_bad_indexes_the_rest_and_reports_one_skipped(broken_corpus, tmp_path, capsys):
    path, records = broken_corpus
    out = str(tmp_path / "index")
    assert index_builder_main([path, "--to", "bm25", "--out", out, "--skip-bad"]) == 0
    printed, progress = capsys.readouterr()
    assert f"{len(records)} docs, " in progress and " docs/s" in progress and "100%" in progress
    assert "malformed lines skipped: 1\n" in printed
    assert f"documents indexed this run: {len(records)} in" in printed
    retriever = Bm25Retriever(out)
    assert retriever.num_docs == len(records)
    assert retriever.search_blocking(["Zylo1 Quarn1"], 1)[0].docs[0].contents == next(
        r["contents"] for r in records if r["contents"].startswith('"Zylo1 Quarn1"'))


def test_cli_runs_as_a_module(broken_corpus, tmp_path):
    path, _ = broken_corpus
    done = subprocess.run([sys.executable, "-m", "index_builder", path, "--to", "bm25", "--out",
                           str(tmp_path / "x"), "--no-progress"], capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert done.returncode == EXIT_BAD_CORPUS
    assert f"{path}:{BROKEN_LINE}: invalid JSON" in done.stderr


@pytest.mark.parametrize("line, reason", [
    (b'[1, 2]', "expected a JSON object, got list"),
    (b'{"contents": "x"}', 'missing key "id"'),
    (b'{"id": "1"}', 'missing key "contents"'),
    (b'{"id": 1.5, "contents": "x"}', '"id" must be a string or integer, got float'),
    (b'{"id": "1", "contents": null}', '"contents" must be a string, got NoneType'),
    (b'{"id": "1", "contents": "\xff"}', "not UTF-8 (invalid start byte at byte 25)"),
])
def test_malformed_line_reasons(line, reason):
    with pytest.raises(ValueError) as error:
        parse_line(line)
    assert str(error.value) == reason


def test_integer_ids_and_extra_fields_are_accepted():
    assert parse_line(b'{"id": 12, "contents": "\\"T\\"\\nx", "title": "T"}') == ("12", '"T"\nx')


def test_gzip_corpus_gives_the_same_index(small_corpus, bm25_index, tmp_path, build_bm25_index):
    path, corpus = small_corpus
    gz_path = str(tmp_path / "corpus.jsonl.gz")
    with open(path, "rb") as src, gzip.open(gz_path, "wb") as dst:
        dst.write(src.read())
    from_gz = build_bm25_index(gz_path, str(tmp_path / "index"))
    queries = [p.query for p in corpus.planted] + corpus.random_queries(10)
    assert Bm25Retriever(from_gz).search_blocking(queries, 3) == Bm25Retriever(bm25_index).search_blocking(queries, 3)


class Interrupted(Exception):
    """Stands for a crash or kill in the middle of a build."""


class InterruptedReader(CorpusReader):
    """A corpus reader that raises `error` after `limit` passages."""

    def __init__(self, path, limit, error):
        super().__init__(path)
        self.limit, self.error = limit, error

    def __iter__(self):
        for number, passage in enumerate(super().__iter__()):
            if number == self.limit:
                raise self.error
            yield passage


def test_interrupted_bm25_build_leaves_nothing(small_corpus, tmp_path):
    out = str(tmp_path / "index")
    with pytest.raises(KeyboardInterrupt):
        build_bm25(InterruptedReader(small_corpus[0], 100, KeyboardInterrupt()), out, chunk_docs=32)
    assert os.listdir(tmp_path) == []


def test_rerunning_an_interrupted_elasticsearch_build_does_not_duplicate(es_url, fresh_es_index, small_corpus,
                                                                        capsys):
    path, corpus = small_corpus
    index = fresh_es_index
    location = f"{es_url} index {index!r}"

    async def interrupted_run():
        client = make_client([es_url], timeout_s=30)
        try:
            await build_elasticsearch(InterruptedReader(path, 130, Interrupted()), client, index, location=location,
                                      bulk_docs=50)
        finally:
            await client.close()

    with pytest.raises(Interrupted):
        asyncio.run(interrupted_run())
    args = [path, "--to", "elasticsearch", "--es-hosts", es_url, "--es-index", index, "--bulk-docs", "50",
            "--no-progress"]
    assert index_builder_main(args) == 0
    printed = capsys.readouterr().out
    # The interrupted run had sent its first two full bulks (100 passages); the rest is new.
    assert "documents already present (resume): 100\n" in printed
    assert f"documents indexed this run: {corpus.n_docs - 100} in" in printed
    assert f"index now holds {corpus.n_docs} documents" in printed
    assert index_builder_main(args) == 0
    printed = capsys.readouterr().out
    assert f"documents already present (resume): {corpus.n_docs}\n" in printed
    assert f"index now holds {corpus.n_docs} documents" in printed


def test_unreachable_cluster_fails_cleanly(small_corpus, free_port, capsys):
    host = f"http://127.0.0.1:{free_port()}"
    status = index_builder_main([small_corpus[0], "--to", "elasticsearch", "--es-hosts", f"http://u:pw@{host[7:]}",
                                 "--es-index", "wiki", "--no-progress", "--es-timeout", "5"])
    assert status == EXIT_INDEX
    err = capsys.readouterr().err
    assert err.startswith(f"error: elasticsearch at {host} failed (ConnectionError")
    assert err.rstrip().endswith("re-run the same command to resume") and ":pw@" not in err


def test_missing_corpus_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        index_builder_main([str(tmp_path / "nope.jsonl"), "--to", "bm25", "--out", str(tmp_path / "i")])
    assert exit_info.value.code == 2 and "nope.jsonl: no such file" in capsys.readouterr().err


def test_line_numbers_count_blank_lines_in_a_gzip_corpus(tmp_path):
    path = tmp_path / "corpus.jsonl.gz"
    path.write_bytes(gzip.compress(b'{"id": "0", "contents": "x"}\n\n[1]\n\n{"id": "1", "contents": "y"}\n'))
    with pytest.raises(CorpusError, match=f"^{path}:3: expected a JSON object, got list \\(pass --skip-bad"):
        list(CorpusReader(str(path)))
    reader = CorpusReader(str(path), skip_bad=True)
    assert [(p.id, p.line) for p in reader] == [("0", 1), ("1", 5)] and reader.skipped == 1


def test_a_truncated_gzip_corpus_names_the_last_line_read(tmp_path):
    path = tmp_path / "cut.jsonl.gz"
    path.write_bytes(gzip.compress(b'{"id": "0", "contents": "x"}\n\n' + b"\n".join(
        json.dumps({"id": str(i), "contents": "w" * 50}).encode() for i in range(1, 200)))[:-30])
    read = []
    with pytest.raises(CorpusError) as error:
        read.extend(CorpusReader(str(path)))
    assert len(read) > 2 and str(error.value).startswith(f"{path}: cannot read past line {read[-1].line}: ")
