"""Secrets stay in the process: a password in the Elasticsearch host URL (docs/retrieval.md) appears in no output of
a real one-step training run and in no file of its run folder; `config.redacted` is what the run prints and saves."""
import json
import os
import subprocess
import sys
import uuid

import ml_collections
import pytest

from llds_jax import config as config_lib
from tests.configs import CONFIGS, load
from tests.servers import delete_es_index

ROOT = os.path.dirname(CONFIGS)
PASSWORD = "Pw-4f81c9e2-never-printed"


@pytest.fixture(scope="module")
def es_index(es_url, tiny_assets):
    """The tiny world's corpus indexed on `es_url` with the real command; deleted afterwards."""
    name = f"llds-secrets-{uuid.uuid4().hex[:8]}"
    corpus = os.path.join(os.path.dirname(tiny_assets["train"]), "corpus.jsonl")
    built = subprocess.run([sys.executable, "-m", "index_builder", corpus, "--to", "elasticsearch", "--es-hosts",
                            es_url, "--es-index", name, "--no-progress"], cwd=ROOT, capture_output=True, text=True,
                           timeout=120)
    assert built.returncode == 0, built.stdout + built.stderr
    yield name
    delete_es_index(es_url, name)


def with_password(url: str) -> str:
    """`url` (http://host:port) with user info elastic:PASSWORD."""
    scheme, rest = url.split("://", 1)
    return f"{scheme}://elastic:{PASSWORD}@{rest}"


def files_holding(folder: str, secret: str) -> list[str]:
    """Every file under `folder` whose bytes contain `secret`."""
    found = []
    for parent, _, names in os.walk(folder):
        for name in names:
            with open(os.path.join(parent, name), "rb") as f:
                if secret.encode() in f.read():
                    found.append(os.path.join(parent, name))
    return found


@pytest.mark.slow
def test_password_in_es_host_url_is_in_no_output_or_file_of_a_run(tmp_path, tiny_assets, config_writer, launch,
                                                                   es_url, es_index):
    run_dir = str(tmp_path / "run")
    # configs/tiny_test.py on prebuilt assets, retrieving from Elasticsearch with the password in the host URL.
    config = config_writer(tmp_path / "cfg.py", tiny_assets, run_dir=run_dir, retriever={
        "backend": "elasticsearch", "hosts": with_password(es_url), "index": es_index},
        **{"data.eval_files": (), "train.total_steps": 1, "train.eval_every": 0, "train.final_eval": False})
    code, out, err = launch(config)
    assert code == 0, err[-3000:]
    assert "training stopped after step 1 of 1" in out
    assert PASSWORD not in out and PASSWORD not in err
    assert files_holding(run_dir, PASSWORD) == []
    with open(os.path.join(run_dir, "config.json")) as f:
        assert json.load(f)["retriever"]["hosts"] == es_url.replace("://", "://***@")
    assert "hosts: " + es_url.replace("://", "://***@") in out  # the printed config


def test_redacted_hides_url_user_info_and_secret_keys():
    cfg = load("tiny_test")
    cfg.retriever = ml_collections.ConfigDict({
        "backend": "elasticsearch", "hosts": ("https://elastic:pw1@a:9200", "https://b:9200"), "index": "wiki18",
        "api_key": "k3y", "es_password": "pw2"})
    cfg.model.path = "gs://bucket/models/qwen"
    shown = config_lib.redacted(cfg)
    assert shown.retriever.to_dict() == {"backend": "elasticsearch", "hosts": ("https://***@a:9200", "https://b:9200"),
                                         "index": "wiki18", "api_key": "***", "es_password": "***"}
    assert shown.model.path == "gs://bucket/models/qwen" and shown.rollout.max_turn_tokens == 8
    assert cfg.retriever.hosts[0] == "https://elastic:pw1@a:9200"  # the run itself keeps the secret
