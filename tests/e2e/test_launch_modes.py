"""--mode=eval (EM table equal to a recomputation from the transcripts), --mode=export, and one-line errors for
bad data, a missing model folder, an unreachable retriever and a dense index that does not fit its encoder."""
import json
import os
import re
import string

import faiss
import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForCausalLM

from llds_jax.data.qa import read_qa
from llds_jax.search.synthetic import write_random_bert
from tests.servers import free_port


def normalize(s):
    """Search-R1's answer normalization, written out independently."""
    s = "".join(ch for ch in s.lower() if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def printed_table(out, title):
    """The rows of the printed table under `title` ("exact match" or "searches per question")."""
    text = out[out.index(title + "\n") + len(title) + 1:]
    rows = []
    for line in text.splitlines()[1:]:  # after the header
        match = re.fullmatch(r"(\S+)\s+(\d+\.\d{3})(?:\s+\d+)?", line)
        if not match:
            break
        rows.append(match.groups())
    return {name: float(value) for name, value in rows}


def means_by_source(records, value):
    """{data_source: mean of value(record)} and their unweighted "mean", rounded as the printed table is."""
    by_source = {}
    for record in records:
        by_source.setdefault(record["data_source"], []).append(value(record))
    means = {source: sum(v) / len(v) for source, v in by_source.items()}
    return {**{source: round(m, 3) for source, m in means.items()}, "mean": round(sum(means.values()) / len(means), 3)}


@pytest.mark.slow
def test_eval_table_equals_recomputation_from_transcripts(tmp_path, tiny_assets, answer_policy, config_writer,
                                                        launch):
    policy, city = answer_policy
    config = config_writer(tmp_path / "cfg.py", tiny_assets, model_path=policy, run_dir=str(tmp_path / "run"),
                          **{"eval.max_examples": 0, "eval.batch_size": 8})
    code, out, err = launch(config, "--mode=eval")
    assert code == 0, err[-3000:]
    table = printed_table(out, "exact match")
    searches = printed_table(out, "searches per question")
    (folder,) = [os.path.join(tmp_path, "run", "eval", d) for d in os.listdir(tmp_path / "run" / "eval")]
    with open(os.path.join(folder, "transcripts.jsonl")) as f:
        records = [json.loads(line) for line in f]
    test_set = read_qa(tiny_assets["test"])
    assert len(records) == len(test_set)
    def em(record):
        model_text = "".join(turn["text"] for turn in record["turns"])
        answers = re.findall(r"<answer>(.*?)</answer>", model_text, flags=re.S)
        return float(bool(answers) and normalize(answers[-1]) in {normalize(g) for g in record["golden_answers"]})

    assert table == pytest.approx(means_by_source(records, em), abs=1e-3)
    assert searches == pytest.approx(
        means_by_source(records, lambda r: sum(turn["action"] == "search" for turn in r["turns"])), abs=1e-3)
    # The policy answers `city` to everything: EM is the share of questions whose answer is that city.
    assert all(r["final_answer"] == city for r in records)
    truth = {}
    for ex in test_set:
        truth.setdefault(ex.data_source, []).append(float(city in ex.golden_answers))
    assert table["single_hop"] == pytest.approx(sum(truth["single_hop"]) / len(truth["single_hop"]), abs=1e-3)
    assert 0 < table["single_hop"] < 1


def test_export_reloads_in_transformers(tmp_path, tiny_assets, config_writer, launch):
    config = config_writer(tmp_path / "cfg.py", tiny_assets, run_dir=str(tmp_path / "run"))
    code, out, err = launch(config, "--mode=export", f"--export_dir={tmp_path / 'hf'}")
    assert code == 0, err[-3000:]
    assert "exported step 0" in out
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    original = AutoModelForCausalLM.from_pretrained(tiny_assets["model"])
    ids = torch.tensor([[9707, 11, 1879, 0]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, original(ids).logits)
    assert os.path.exists(tmp_path / "hf" / "tokenizer_config.json")


def test_missing_data_column_is_one_line(tmp_path, tiny_assets, config_writer, launch):
    table = pq.read_table(tiny_assets["train"]).drop(["question"])
    bad = str(tmp_path / "bad.parquet")
    pq.write_table(table, bad)
    config = config_writer(tmp_path / "cfg.py", tiny_assets, run_dir=str(tmp_path / "run"),
                          **{"data.train_files": [bad]})
    code, _, err = launch(config)
    assert code == 2
    assert f"{bad}: missing required column 'question'" in err and "Traceback" not in err


def test_missing_model_folder_is_one_line(tmp_path, tiny_assets, config_writer, launch):
    missing = str(tmp_path / "no_such_model")
    config = config_writer(tmp_path / "cfg.py", tiny_assets, model_path=missing, run_dir=str(tmp_path / "run"))
    code, _, err = launch(config)
    assert code == 2
    assert missing in err and "Traceback" not in err
    assert len([line for line in err.splitlines() if line.startswith("llds_jax: error")]) == 1


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["http", "elasticsearch"])
def test_unreachable_retriever_is_one_line(tmp_path, tiny_assets, config_writer, launch, backend):
    """Nothing listens at the retriever's address: exit 2 and one line naming backend and address, nothing else."""
    address = f"http://127.0.0.1:{free_port()}"
    retriever = ({"backend": "http", "url": f"{address}/retrieve"} if backend == "http" else
                 {"backend": "elasticsearch", "hosts": address, "index": "wiki18"})
    config = config_writer(tmp_path / "cfg.py", tiny_assets, run_dir=str(tmp_path / "run"),
                           retriever={**retriever, "max_retries": 0, "timeout_s": 2.0})
    code, _, err = launch(config)
    assert code == 2
    assert err.startswith(f"llds_jax: error: {backend} backend at {address}") and err.count("\n") == 1, err


@pytest.mark.slow
@pytest.mark.parametrize("problem", ["dimension", "short corpus", "no encoder"])
def test_dense_index_that_does_not_fit_is_one_line(tmp_path, tiny_assets, config_writer, launch, problem):
    """A faiss index of 16-dimensional vectors with a 32-dimensional encoder, a corpus shorter than the index, or
    no encoder folder: exit 2 with one line naming both sides, before any step."""
    encoder = write_random_bert(str(tmp_path / "e5")) if problem != "no encoder" else str(tmp_path / "no_e5")
    dim = 16 if problem == "dimension" else 32
    index_path = str(tmp_path / "e5_Flat.index")
    index = faiss.IndexFlatIP(dim)
    index.add(np.eye(dim, dtype=np.float32))
    faiss.write_index(index, index_path)
    corpus = tmp_path / "wiki-18.jsonl"
    lines = 10 if problem == "short corpus" else dim
    corpus.write_text("".join(json.dumps({"id": str(i), "contents": f'"T{i}"\nx'}) + "\n" for i in range(lines)))
    config = config_writer(tmp_path / "cfg.py", tiny_assets, run_dir=str(tmp_path / "run"), retriever={
        "backend": "faiss", "index_path": index_path, "corpus_path": str(corpus), "encoder_path": encoder})
    code, out, err = launch(config)
    expected = {
        "dimension": f"faiss index {index_path} holds 16-dimensional vectors but encoder {encoder} embeds 32",
        "short corpus": f"corpus {corpus} has 10 lines but faiss index {index_path} has 32 rows",
        "no encoder": f"encoder folder {encoder} (retriever.encoder_path): no config.json there",
    }[problem]
    assert code == 2
    assert err.startswith(f"llds_jax: error: {expected}") and err.count("\n") == 1, err
    assert "step 1" not in out
