"""Bad data, models and indexes: one line naming the file (exit status 2 from the commands), or, for QA rows only
an empty answer can match, counted in one warning (and skipped under `reward.empty_answer='zero'`, where an empty
answer never earns reward); a run failing after its retriever opened leaves no unclosed client session behind."""
import json
import logging
import os
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import save_file

from llds_jax.data import qa
from llds_jax.data.rewards import em_reward, exact_match
from llds_jax.model import from_hf_config, hf_io
from llds_jax.search.synthetic import SyntheticCorpus
from llds_jax.model.tokenizer import load_tokenizer
from tests.servers import free_port, http_ok, wait_until

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(*args, timeout=120, **kwargs):
    """(exit status, stdout, stderr) of `python -m ARGS` in the repository root."""
    done = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, **kwargs)
    return done.returncode, done.stdout, done.stderr


@pytest.mark.parametrize("content, why", [(b"", "the file is empty"), (b"\n  \n\n", "it has only blank lines")])
def test_index_builder_on_a_corpus_without_passages_is_one_line(tmp_path, content, why):
    corpus, out = tmp_path / "corpus.jsonl", tmp_path / "index"
    corpus.write_bytes(content)
    code, stdout, stderr = run("index_builder", str(corpus), "--to", "bm25", "--out", str(out), "--no-progress")
    assert (code, stdout, stderr) == (2, "", f"error: {corpus}: no passages to index ({why})\n")
    assert not out.exists()


def test_index_builder_to_unreachable_elasticsearch_is_one_line(tmp_path):
    corpus = SyntheticCorpus(5, seed=1, n_planted=1, vocab_size=50).write(str(tmp_path / "corpus.jsonl"))
    address = f"http://127.0.0.1:{free_port()}"
    code, _, stderr = run("index_builder", corpus, "--to", "elasticsearch", "--es-hosts", address, "--es-index",
                          "wiki18", "--no-progress")
    assert (code, stderr) == (3, f"error: elasticsearch at {address} failed (ConnectionError: Connection error);"
                                 " re-run the same command to resume\n")


@pytest.mark.parametrize("rule, empty_scores", [("search_r1", 1.0), ("zero", 0.0)])
def test_an_answer_that_normalizes_to_nothing_scores_by_the_rule(rule, empty_scores):
    # search_r1: Search-R1's compute_score_em (normalize both sides, compare), which an empty answer wins against
    # an empty gold; zero: an empty answer never earns reward.
    assert em_reward("<answer>a</answer>", ["a"], rule) == empty_scores
    assert em_reward("<answer></answer>", [""], rule) == empty_scores
    assert em_reward("<answer> The. </answer>", ["the", "Paris"], rule) == empty_scores
    assert em_reward("<answer>a</answer>", ["Tokyo"], rule) == 0.0  # no empty gold: no match under either rule
    assert em_reward("<answer>The Paris.</answer>", ["paris"], rule) == 1.0
    assert em_reward("no answer tags", [""], rule) == 0.0
    assert exact_match("", ["the"]) == 1.0  # Search-R1's exact match itself is unchanged


def test_the_default_rule_is_search_r1s():
    assert em_reward("<answer>a</answer>", ["a"]) == 1.0
    with pytest.raises(ValueError, match="reward.empty_answer must be one of"):
        em_reward("<answer>a</answer>", ["a"], "strict")


def rows(*answer_lists):
    return [{"question": f"q{i}", "golden_answers": answers, "data_source": "nq"}
            for i, answers in enumerate(answer_lists)]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_rows_only_an_empty_answer_can_match_are_kept_and_counted_by_search_r1s_rule(tmp_path, caplog):
    path = write_jsonl(tmp_path / "qa.jsonl", rows(["Paris"], [""], ["The", "."], ["a", "Tokyo"], ["  "], [" an! "]))
    with caplog.at_level(logging.WARNING, logger="llds_jax.data.qa"):
        examples = qa.read_qa(path, "search_r1")
    assert [ex.uid for ex in examples] == [f"nq-{row}" for row in range(6)]
    assert caplog.messages == [
        f"kept 4 rows whose golden answers are all empty once normalized (blank, articles or punctuation only), which"
        f" an empty answer matches (reward.empty_answer='search_r1', as Search-R1; 'zero' skips them):"
        f" {path}:2; {path}:3; {path}:5; ..."]


def test_rows_no_answer_can_match_are_skipped_and_counted_once_by_the_zero_rule(tmp_path, caplog):
    path = write_jsonl(tmp_path / "qa.jsonl", rows(["Paris"], [""], ["The", "."], ["a", "Tokyo"], ["  "], [" an! "]))
    with caplog.at_level(logging.WARNING, logger="llds_jax.data.qa"):
        examples = qa.read_qa(path, "zero")
    assert [(ex.uid, ex.golden_answers) for ex in examples] == [("nq-0", ("Paris",)), ("nq-3", ("a", "Tokyo"))]
    assert caplog.messages == [
        f"skipped 4 rows whose golden answers are all empty once normalized (blank, articles or punctuation only):"
        f" {path}:2; {path}:3; {path}:5; ..."]
    parquet = str(tmp_path / "qa.parquet")
    qa.write_qa_parquet(parquet, [qa.QAExample("nq-0", "q", ("The",), "nq")])
    with pytest.raises(ValueError) as error:
        qa.read_qa(parquet, "zero")
    assert str(error.value) == (f"{parquet}: no examples; skipped 1 row whose golden answers are all empty once"
                                f" normalized (blank, articles or punctuation only): {parquet}: row 0")


@pytest.mark.parametrize("name, content, reason", [
    ("empty.parquet", b"", "not a readable parquet file (Parquet file size is 0 bytes)"),
    ("garbage.parquet", b"PAR1 this is not parquet at all",
     "not a readable parquet file (Parquet magic bytes not found in footer. Either the file is corrupted or this is"
     " not a parquet file.)"),
    ("binary.jsonl", b"\xff\xfe{}\n", "1: not UTF-8 (invalid start byte at byte 0)"),
    # issue 58 item 9: "make_prompt: the question is empty" at the first rollout, naming neither file nor row
    ("blank.jsonl", b'{"question": "q", "golden_answers": ["a"], "data_source": "nq"}\n'
                    b'{"question": "   ", "golden_answers": ["a"], "data_source": "nq"}\n',
     "2: column 'question' is blank ('   ')"),
])
def test_unreadable_qa_files_name_the_file(tmp_path, name, content, reason):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ValueError) as error:
        qa.read_qa(path)
    separator = ":" if name.endswith(".jsonl") else ": "
    assert str(error.value) == f"{path}{separator}{reason}"


@pytest.fixture
def checkpoint(tmp_path):
    """A folder with a valid config.json and model.safetensors (one 4x4 float32 tensor: 64 data bytes)."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    save_file({"w": np.zeros((4, 4), np.float32)}, str(folder / "model.safetensors"))
    return folder


@pytest.mark.parametrize("text, reason", [
    ('{"model_type": "qwen2",}', "invalid JSON (Expecting property name enclosed in double quotes at line 1"
                                 " column 24)"),
    ("[1, 2]", "expected a JSON object, got list"),
    ("\xff", "invalid JSON (Expecting value at line 1 column 1)"),
])
def test_bad_config_json_names_the_file(checkpoint, text, reason):
    (checkpoint / "config.json").write_text(text)
    with pytest.raises(ValueError) as error:
        hf_io.read_config(str(checkpoint))
    assert str(error.value) == f"{checkpoint}/config.json: {reason}"


@pytest.mark.parametrize("hf_config, reason", [
    ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported (supported: ('qwen2', 'llama'))"),
    ({}, "model_type None is not supported (supported: ('qwen2', 'llama'))"),
    ({"model_type": "llama"}, "missing keys ['vocab_size', 'hidden_size', 'intermediate_size', 'num_hidden_layers',"
                              " 'num_attention_heads']"),
])
def test_unsupported_config_json_names_the_file(checkpoint, hf_config, reason):
    """What the trainer and --mode=compile do: the architecture from the folder's config.json."""
    (checkpoint / "config.json").write_text(json.dumps(hf_config))
    with pytest.raises((ValueError, KeyError)) as error:
        from_hf_config(hf_io.read_config(str(checkpoint)))
    assert error.value.args[0] == f"{checkpoint}/config.json: {reason}"


@pytest.mark.parametrize("files", [{}, {"config.json": '{"model_type": "qwen2"}'}])
def test_model_folder_without_tokenizer_files_is_one_line(tmp_path, files):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(FileNotFoundError) as error:
        load_tokenizer(str(tmp_path))
    assert str(error.value) == (f"tokenizer folder {tmp_path}: no tokenizer files in it (tokenizer.json, "
                                "tokenizer_config.json, vocab.json, ...)")


def test_corrupt_safetensors_names_the_file(checkpoint):
    weights = checkpoint / "model.safetensors"
    data = weights.read_bytes()
    (header_bytes,) = struct.unpack("<Q", data[:8])
    size = 8 + header_bytes + 64
    assert len(data) == size
    cases = [
        (b"", "Requested byte range [0, 8) is not valid for value of size 0"),
        (data[:-10], f"Requested byte range [{size - 1}, {size}) is not valid for value of size {size - 10}"),
    ]
    for content, reason in cases:
        weights.write_bytes(content)
        with pytest.raises(ValueError) as error:
            hf_io.CheckpointFolder(str(checkpoint))
        assert str(error.value) == f"{weights}: not a valid safetensors file (ValueError: OUT_OF_RANGE: {reason})"
    weights.write_bytes(b"\xff" * 20)
    with pytest.raises(ValueError) as error:
        hf_io.CheckpointFolder(str(checkpoint))
    assert str(error.value) == (f"{weights}: not a valid safetensors file (ValueError: a header of {2 ** 64 - 1}"
                                " bytes, more than the format's 100000000)")
    weights.write_bytes(struct.pack("<Q", 2) + b"[]")
    with pytest.raises(ValueError) as error:
        hf_io.CheckpointFolder(str(checkpoint))
    assert str(error.value) == (f"{weights}: not a valid safetensors file (AttributeError: 'list' object has no"
                                " attribute 'items')")


def test_tokenizer_folder_with_bad_config_json_is_one_line(tmp_path, qwen_tokenizer_dir):
    folder = tmp_path / "tokenizer"
    shutil.copytree(qwen_tokenizer_dir, folder)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ValueError) as error:
        load_tokenizer(str(folder))
    assert str(error.value) == (f"tokenizer folder {folder}: It looks like the config file at"
                                f" '{folder}/config.json' is not a valid JSON file.")


@pytest.mark.slow
def test_run_with_a_bad_eval_file_and_a_live_retriever_is_one_line(tmp_path, tiny_assets, config_writer, launch):
    """A reachable http retriever (it would pass its check) and a bad eval file: one line, no unclosed session."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "llds_jax.search.server", "--port", str(port), "--set",
                               "backend=bm25", "--set", f"index_dir={tiny_assets['index']}"], cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: http_ok(f"http://127.0.0.1:{port}/health"), 60, "llds_jax.search.server")
        bad = tmp_path / "eval.jsonl"
        bad.write_text("not json\n")
        config = config_writer(tmp_path / "cfg.py", tiny_assets, run_dir=str(tmp_path / "run"), retriever={
            "backend": "http", "url": f"http://127.0.0.1:{port}/retrieve", "max_retries": 0},
            **{"data.eval_files": (str(bad),)})
        code, _, stderr = launch(config, "--mode=eval")
    finally:
        server.terminate()
        server.wait(10)
    assert (code, stderr) == (2, f"llds_jax: error: {bad}:1: invalid JSON (Expecting value at column 1)\n")
