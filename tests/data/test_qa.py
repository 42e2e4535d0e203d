"""Search-R1 QA files: writer/reader round trips (local and gs://), error messages, over-long questions."""
import dataclasses
import json
import logging
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from llds_jax.data import qa
from llds_jax import protocol
from llds_jax.train.trainer import read_examples

EXAMPLES = [
    qa.QAExample("nq-0", "who wrote hamlet?", ("William Shakespeare", "Shakespeare"), "nq", "test_0"),
    qa.QAExample("hotpotqa-1", "Which city is larger", ("Paris",), "hotpotqa", "test_0"),
    qa.QAExample("nq-2", "capital of japan", ("Tokyo",), "nq", None),
]


def write_qa_jsonl(path, examples, split="test"):
    """`examples` as JSONL, one Search-R1 row per line (the format read_qa reads besides parquet)."""
    with open(path, "w", encoding="utf-8") as f:
        for record in qa.search_r1_records(examples, split):
            f.write(json.dumps(record, ensure_ascii=False) + "\n")


@pytest.mark.parametrize("suffix,writer", [
    (".parquet", qa.write_qa_parquet),
    (".jsonl", write_qa_jsonl),
])
def test_round_trip(tmp_path, suffix, writer):
    path = tmp_path / f"test{suffix}"
    writer(path, EXAMPLES)
    expected = list(EXAMPLES)
    expected[2] = qa.QAExample("nq-2", "capital of japan", ("Tokyo",), "nq", "test_1")
    assert qa.read_qa(path) == expected
    assert qa.read_qa(str(path)) == expected


def test_gcs_files_read_like_local_ones(tmp_path, gcs_dir, gcs_fs):
    for suffix, writer in ((".parquet", qa.write_qa_parquet), (".jsonl", write_qa_jsonl)):
        writer(tmp_path / f"test{suffix}", EXAMPLES)
        gcs_fs.put(str(tmp_path / f"test{suffix}"), f"{gcs_dir}/test{suffix}")
        assert qa.read_qa(f"{gcs_dir}/test{suffix}") == qa.read_qa(tmp_path / f"test{suffix}")
    files = [f"{gcs_dir}/test.parquet", f"{gcs_dir}/test.jsonl"]
    assert [ex.uid for ex in read_examples(files, "train_files", "search_r1", 256)] == [
        f"{i}:{ex.data_source}-{row}" for i in range(2) for row, ex in enumerate(EXAMPLES)]
    with pytest.raises(FileNotFoundError, match=f"^data.eval_files: file not found: {gcs_dir}/missing.parquet$"):
        read_examples([files[0], f"{gcs_dir}/missing.parquet"], "eval_files", "search_r1", 256)
    pq.write_table(pq.read_table(tmp_path / "test.parquet").drop(["question"]), tmp_path / "bad.parquet")
    gcs_fs.put(str(tmp_path / "bad.parquet"), f"{gcs_dir}/bad.parquet")
    with pytest.raises(ValueError, match=f"^{gcs_dir}/bad.parquet: missing required column 'question'$"):
        qa.read_qa(f"{gcs_dir}/bad.parquet")


def test_written_rows_follow_search_r1_schema(tmp_path):
    path = tmp_path / "train.parquet"
    qa.write_qa_parquet(path, EXAMPLES, split="train")
    table = pq.read_table(path)
    assert table.column_names == [
        "id", "question", "golden_answers", "data_source", "prompt", "ability", "reward_model", "extra_info"]
    rows = table.to_pylist()
    assert rows[0] == {
        "id": "test_0",
        "question": "who wrote hamlet?",
        "golden_answers": ["William Shakespeare", "Shakespeare"],
        "data_source": "nq",
        "prompt": [{"role": "user", "content": protocol.make_prompt("who wrote hamlet?")}],
        "ability": "fact-reasoning",
        "reward_model": {"style": "rule", "ground_truth": {"target": ["William Shakespeare", "Shakespeare"]}},
        "extra_info": {"split": "train", "index": 0},
    }
    # Search-R1's index restarts per data source, so it collides across sources; our uids do not.
    assert [r["extra_info"]["index"] for r in rows] == [0, 0, 1]
    assert rows[2]["id"] == "train_1"
    assert len({ex.uid for ex in qa.read_qa(path)}) == 3


def test_fallback_to_reward_model_target(tmp_path):
    path = tmp_path / "no_golden.parquet"
    qa.write_qa_parquet(path, EXAMPLES)
    pq.write_table(pq.read_table(path).drop_columns(["golden_answers", "id"]), path)
    assert qa.read_qa(path)[0] == qa.QAExample("nq-0", "who wrote hamlet?", ("William Shakespeare", "Shakespeare"),
                                               "nq", None)
    jsonl = tmp_path / "no_golden.jsonl"
    jsonl.write_text(json.dumps({"question": "q", "data_source": "popqa",
                                 "reward_model": {"ground_truth": {"target": ["x"]}}}) + "\n")
    assert qa.read_qa(jsonl) == [qa.QAExample("popqa-0", "q", ("x",), "popqa", None)]


@pytest.mark.parametrize("column", ["question", "data_source"])
def test_missing_column_parquet(tmp_path, column):
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": "q", "golden_answers": ["a"], "data_source": "nq"}])
                   .drop_columns([column]), path)
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: missing required column '{column}'$"):
        qa.read_qa(path)


def test_missing_answers_parquet(tmp_path):
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": "q", "data_source": "nq"}]), path)
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: missing required column 'golden_answers'"):
        qa.read_qa(path)


def test_jsonl_errors_name_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    good = json.dumps({"question": "q", "golden_answers": ["a"], "data_source": "nq"})
    path.write_text(good + "\n\n" + good + "\n" + '{"question": "q", ' + "\n")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}:4: invalid JSON"):
        qa.read_qa(path)
    path.write_text(good + "\n" + json.dumps({"question": "q", "golden_answers": ["a"]}) + "\n")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}:2: missing required column 'data_source'$"):
        qa.read_qa(path)
    path.write_text("[1, 2]\n")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}:1: expected a JSON object"):
        qa.read_qa(path)


@pytest.mark.parametrize("record,message", [
    ({"question": "q", "golden_answers": [], "data_source": "nq"}, "'golden_answers' must be a non-empty list"),
    ({"question": "q", "golden_answers": [1984], "data_source": "nq"}, "'golden_answers' must be a non-empty list"),
    ({"question": None, "golden_answers": ["a"], "data_source": "nq"}, "'question' must be a string"),
    ({"question": "q", "reward_model": {"style": "rule"}, "data_source": "nq"},
     "no 'golden_answers' and no 'reward_model.ground_truth.target'"),
])
def test_bad_values_name_file_and_line(tmp_path, record, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(record) + "\n")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}:1: .*{message}"):
        qa.read_qa(path)


def test_single_string_answer_and_unknown_format(tmp_path):
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps({"id": 7, "question": "q", "golden_answers": "x", "data_source": "nq"}) + "\n")
    assert qa.read_qa(path) == [qa.QAExample("nq-0", "q", ("x",), "nq", "7")]
    with pytest.raises(ValueError, match="unknown QA file format"):
        qa.read_qa(tmp_path / "data.csv")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no examples"):
        qa.read_qa(tmp_path / "empty.jsonl")


@pytest.mark.parametrize("suffix,writer", [(".parquet", qa.write_qa_parquet), (".jsonl", write_qa_jsonl)])
def test_a_1_mb_question_is_bounded_as_it_is_read_and_counted_in_one_line(tmp_path, caplog, suffix, writer):
    """Issue 66: a 1 MB question cost seconds to fit, once per sample. It keeps its last 2 x max_prompt_tokens x 128
    characters (the prompt keeps the same tokens: tests/test_protocol.py); one warning line counts such rows."""
    page = ("a pasted page of text, " * 50_000)[:1_000_000] + " who founded Acme?\n"
    long_examples = [qa.QAExample(f"nq-{i}", page, ("x",), "nq", f"test_{i}") for i in range(4)]
    path = tmp_path / f"test{suffix}"
    writer(path, [*long_examples, *EXAMPLES[:1]])
    with caplog.at_level(logging.WARNING, logger="llds_jax.data.qa"):
        examples = qa.read_qa(path, "search_r1", 256)
    limit = 2 * 256 * 128
    assert [ex.question for ex in examples] == [page.strip()[-limit:]] * 4 + [EXAMPLES[0].question]
    assert examples[0].question.endswith(" who founded Acme?") and len(examples[0].question) == 65_536
    where = [f"{path}:{row}" if suffix == ".jsonl" else f"{path}: row {row - 1}" for row in (1, 2, 3)]
    assert caplog.messages == [
        "the questions of 4 rows are longer than 65,536 characters; each keeps its last 65,536 (its start cut as the"
        f" prompt of rollout.max_prompt_tokens = 256 would cut it, keeping the same tokens): {'; '.join(where)}; ..."]
    files = [str(path)]
    assert read_examples(files, "train_files", "search_r1", 256) == [
        dataclasses.replace(ex, uid=f"0:{ex.uid}") for ex in examples]
