"""Secrets stay in the process: a password in the Elasticsearch host URL or the http retriever's URL
(docs/retrieval.md), holding unencoded `/ # ? @ :` and a space, appears in no output of a real training run and in
no file of its run folder, also when every search fails and the errors become the policy's observations,
TensorBoard transcripts and warnings; `config.redacted` is what the run prints and saves, and every retriever
message shows the URL redacted (`llds_jax.runtime.redaction`)."""
import asyncio
import base64
import json
import logging
import os
import re
import subprocess
import sys
import urllib.parse
import uuid

import ml_collections
import pytest
from aiohttp import web

from llds_jax import config as config_lib
from llds_jax.search.elastic import ElasticsearchRetriever, hosts_for_display, make_client
from llds_jax.search.factory import resolve_config
from llds_jax.search.http import HttpRetriever
from llds_jax.search.retry import RequestPolicy
from llds_jax.search.types import RetrieverUnavailableError
from tests.configs import CONFIGS, load
from tests.reliability.scripted_retriever import ScriptedRetriever
from tests.servers import delete_es_index, free_port

ROOT = os.path.dirname(CONFIGS)
# Distinct pieces between the characters that end the user info in a naive URL parser.
PASSWORD = "Pw1-7c3e/Pw2-91ab#Pw3-5d20?Pw4-e8f6 Pw5-0b4c@Pw6-a1d9:Pw7-66f3"
PLAIN_PASSWORD = "Pw-4f81c9e2-never-printed"


def secrets_of(password: str) -> tuple[str, ...]:
    """What must appear nowhere: the password, percent-encoded, and each of its pieces."""
    return (password, urllib.parse.quote(password, safe=""), *re.split(r"[/#? @:]", password))


def basic_auth(password: str) -> str:
    """The Authorization header of user elastic with `password`."""
    return "Basic " + base64.b64encode(f"elastic:{password}".encode()).decode()


SECRETS = secrets_of(PASSWORD)
FAST_FAIL = RequestPolicy(timeout_s=5.0, max_retries=1, backoff_s=0.0)
TIMEOUT_S = 300
# A run of the searching policy (tests/reliability/conftest.py) whose every search fails: the start evaluation, step
# 1 (its transcripts to TensorBoard), step 2 ends it (rollout.max_failed_search_steps).
FAILING_RUN = {"data__prompts_per_step": 2, "rollout__max_batch_size": 4, "train__total_steps": 2,
               "train__transcripts_every": 1, "train__eval_at_start": True, "eval__max_examples": 2,
               "rollout__max_failed_search_steps": 2}


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


def with_password(url: str, password: str = PASSWORD) -> str:
    """`url` (http://host:port) with user info elastic:`password`."""
    scheme, rest = url.split("://", 1)
    return f"{scheme}://elastic:{password}@{rest}"


def leaked(text: str, secrets: tuple[str, ...] = SECRETS) -> list[str]:
    """The `secrets` found in `text`."""
    return [secret for secret in secrets if secret in text]


def files_holding(folder: str, texts: tuple[str, ...] = SECRETS) -> list[str]:
    """Every file under `folder` (relative path) whose bytes contain one of `texts`."""
    found = []
    for parent, _, names in os.walk(folder):
        for name in names:
            with open(os.path.join(parent, name), "rb") as f:
                data = f.read()
            if any(text.encode() in data for text in texts):
                found.append(os.path.relpath(os.path.join(parent, name), folder))
    return sorted(found)


@pytest.mark.slow
def test_password_in_es_host_url_is_in_no_output_or_file_of_a_run(tmp_path, tiny_assets, config_writer, launch,
                                                                   es_url, es_index):
    run_dir = str(tmp_path / "run")
    # configs/tiny_test.py on prebuilt assets, retrieving from Elasticsearch with the password in the host URL.
    config = config_writer(tmp_path / "cfg.py", tiny_assets, run_dir=run_dir, retriever={
        "backend": "elasticsearch", "hosts": with_password(es_url), "index": es_index},
        **{"data.eval_files": (), "train.total_steps": 1, "train.eval_every": 0, "train.final_eval": False})
    code, out, err = launch(config, "--print_config")
    assert code == 0, err[-3000:]
    assert "training stopped after step 1 of 1" in out
    assert leaked(out) == [] and leaked(err) == []
    assert files_holding(run_dir) == []
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


@pytest.mark.slow
def test_password_in_http_retriever_url_is_in_no_output_or_file_of_a_run_whose_searches_fail(searching_runs):
    run_dir = searching_runs.run_dir("secrets_http")
    with ScriptedRetriever() as server:
        # The start-up check (the first request) is answered; every search after it fails with HTTP 503.
        server.on_request = lambda queries: setattr(server, "failing", server.requests > 1)
        retriever = {**server.config(), "url": with_password(server.url), "max_retries": 1, "backoff_s": 0.0}
        launched = searching_runs.start(retriever, "secrets_http", "--print_config", **FAILING_RUN)
        launched.process.wait(TIMEOUT_S)
    output = launched.output()
    shown = server.url.replace("://", "://***@")
    assert launched.process.returncode == 2, output[-4000:]
    assert output.strip().splitlines()[-1] == (
        "llds_jax: error: the retriever failed more than 50% of the searches in 2 steps in a row"
        " (rollout.search_failure_rate, rollout.max_failed_search_steps); last error: http backend at"
        f' {shown}: gave up after 2 attempts, last error: HttpStatusError: HTTP 503: {{"error": "scripted outage"}};'
        " the run is saved before step 2: the same command resumes there")
    assert f"url: {shown}\n" in output  # the printed config
    assert re.search(r"\] http backend at " + re.escape(f"{shown}: attempt 1 failed (HttpStatusError: HTTP 503: "),
                     output)  # a retry warning (absl's log format)
    assert leaked(output) == []
    assert files_holding(run_dir) == []
    # The failed searches did reach the run folder as observations: the start evaluation's transcripts and step 1's
    # TensorBoard transcripts hold the redacted URL.
    holding = files_holding(run_dir, (f"Search failed: http backend at {shown}",))
    assert any(path.startswith("eval/") for path in holding) and any("events" in path for path in holding), holding


@pytest.mark.parametrize("password", [PLAIN_PASSWORD, PASSWORD], ids=["plain", "special_characters"])
def test_http_retriever_sends_url_user_info_as_basic_auth_and_shows_it_in_no_message(password, caplog):
    port = free_port()
    url = f"http://127.0.0.1:{port}/retrieve"
    shown = f"http://***@127.0.0.1:{port}/retrieve"
    authorizations = []

    async def retrieve(request: web.Request) -> web.Response:  # answers the first request, fails the others
        authorizations.append(request.headers.get("Authorization"))
        queries = (await request.json())["queries"]
        if len(authorizations) > 1:
            return web.json_response({"error": "down"}, status=500)
        return web.json_response({"result": [[{"document": {"id": "1", "contents": "c"}, "score": 1.0}]
                                             for _ in queries]})

    async def run():
        app = web.Application()
        app.router.add_post("/retrieve", retrieve)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        retriever = HttpRetriever(with_password(url, password), policy=FAST_FAIL)
        try:
            answered, failed = await retriever.search(["q"], 1), await retriever.search(["q"], 1)
        finally:
            await retriever.close()
            await runner.cleanup()
        with pytest.raises(RetrieverUnavailableError) as unavailable:  # nobody listens now
            await HttpRetriever(with_password(url, password), policy=FAST_FAIL).check()
        return retriever.url, answered[0], failed[0].error, str(unavailable.value)

    with caplog.at_level(logging.WARNING, logger="llds_jax.search.retry"):
        shown_url, answered, failed, unavailable = asyncio.run(run())
    assert authorizations == [basic_auth(password)] * 3  # one answered request, then two attempts of the failing search
    assert shown_url == shown and answered.error is None and [d.id for d in answered.docs] == ["1"]
    assert failed == f'http backend at {shown}: gave up after 2 attempts, last error: HttpStatusError: HTTP 500: ' \
                     '{"error": "down"}'
    assert unavailable.startswith(f"http backend at {shown} cannot serve searches: ClientConnectorError: Cannot "
                                  f"connect to host 127.0.0.1:{port}"), unavailable
    assert caplog.messages == [f'http backend at {shown}: attempt 1 failed (HttpStatusError: HTTP 500: '
                               '{"error": "down"}); retrying in 0.00 s']
    assert leaked(failed + unavailable + caplog.text, secrets_of(password)) == []


def test_es_password_with_special_characters_is_in_no_message_of_the_retriever(caplog):
    port = free_port()
    host = f"http://127.0.0.1:{port}"
    where = f"elasticsearch backend at {host} (index 'wiki')"

    async def run():
        retriever = ElasticsearchRetriever(with_password(host), "wiki", policy=FAST_FAIL)
        try:
            with pytest.raises(RetrieverUnavailableError) as unavailable:  # nobody listens
                await retriever.check()
            return retriever.hosts, str(unavailable.value), (await retriever.search(["q"], 1))[0].error
        finally:
            await retriever.close()

    with caplog.at_level(logging.WARNING, logger="llds_jax.search.retry"):
        hosts, unavailable, failed = asyncio.run(run())
    assert hosts == [f"http://***@127.0.0.1:{port}"]
    assert unavailable.startswith(f"{where} cannot serve searches: ConnectionError"), unavailable
    assert failed.startswith(f"{where} msearch: gave up after 2 attempts, last error: ConnectionError"), failed
    retry_warnings = [r.getMessage() for r in caplog.records if r.name == "llds_jax.search.retry"]
    assert len(retry_warnings) == 1 and retry_warnings[0].startswith(
        f"{where} msearch: attempt 1 failed (ConnectionError"), retry_warnings
    assert leaked(unavailable + failed + caplog.text) == []
    # The client reads the password whole (sent as basic auth); a host it rejects is named without it.
    client = make_client([with_password(host)], timeout_s=1.0)
    try:
        headers = [node.config.headers["authorization"] for node in client.transport.node_pool.all()]
        assert headers == [basic_auth(PASSWORD)]
    finally:
        asyncio.run(client.close())
    with pytest.raises(ValueError) as rejected:
        make_client([with_password("http://127.0.0.1:no-port")], timeout_s=1.0)
    assert str(rejected.value) == ("elasticsearch hosts http://127.0.0.1:no-port: ValueError: Could not parse URL "
                                   "'http://***@127.0.0.1:no-port'")
    assert hosts_for_display([with_password(host), "elastic:pw@es:9200"]) == f"{host},es:9200"


def test_es_password_with_special_characters_is_redacted_in_the_config_and_arguments():
    cfg = load("tiny_test")
    cfg.retriever = ml_collections.ConfigDict({
        "backend": "elasticsearch", "hosts": f"https://elastic:{PASSWORD}@a:9200,https://elastic:{PASSWORD}@b:9200",
        "index": "wiki18"})
    shown = config_lib.redacted(cfg)
    assert shown.retriever.hosts == "https://***@a:9200,https://***@b:9200"
    assert leaked(str(shown)) == [] and leaked(shown.to_json_best_effort()) == []
    assert config_lib.redacted_argument(f"--config.retriever.hosts=https://elastic:{PASSWORD}@a:9200") == (
        "--config.retriever.hosts=https://***@a:9200")
    # A URL without a scheme is refused before anything prints it, without quoting it.
    with pytest.raises(ValueError) as refused:
        resolve_config({"backend": "elasticsearch", "index": "w", "hosts": f"http://a:9200,elastic:{PASSWORD}@b:9200"})
    assert str(refused.value) == ("retriever.hosts: entry 2 of the value needs a scheme (http:// or "
                                  "https://), e.g. http://127.0.0.1:9200")
    with pytest.raises(ValueError) as wrong_type:
        resolve_config({"backend": "http", "url": [f"http://elastic:{PASSWORD}@h:8000/retrieve"]})
    assert str(wrong_type.value) == "retriever.url must be str, got ['http://***@h:8000/retrieve']"
