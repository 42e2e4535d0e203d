"""llds_jax.runtime.redaction: URL user info becomes `***` wherever it ends (passwords with unencoded `/ # ? @ :` and
spaces), URLs without user info are unchanged, and the parts a request needs are split off exactly."""
import urllib.parse

import pytest
import urllib3
import yarl

from llds_jax import config as config_lib
from llds_jax.runtime.redaction import credentials, encoded_userinfo, redact, split_userinfo

# Every character that ends the user info in a naive parser, each between distinct pieces.
SPECIAL = "Pw1-7c3e/Pw2-91ab#Pw3-5d20?Pw4-e8f6 Pw5-0b4c@Pw6-a1d9:Pw7-66f3"


@pytest.mark.parametrize("password", ["a/b", "a#b", "a?b", "a b", "a@b", "a:b", "/lead", " lead", "@lead", "trail/",
                                      "a@b.c/d", "a@h:9/x", SPECIAL])
@pytest.mark.parametrize("rest", ["host:9200", "host", "host:9200/retrieve", "10.0.0.7:8000/retrieve?x=1#f",
                                  "[::1]:9200"])
def test_a_password_with_any_special_character_is_redacted(password, rest):
    url = f"https://elastic:{password}@{rest}"
    assert redact(url) == f"https://***@{rest}"
    assert split_userinfo(url) == (f"https://{rest}", f"elastic:{password}")
    assert credentials(url) == (f"https://{rest}", "elastic", password)


@pytest.mark.parametrize("text", [
    "https://host:9200", "https://host:9200/a@b", "gs://bucket/models/qwen@v2", "http://10.0.0.7:8000/retrieve",
    "http://[::1]:9200/x", "runs/demo_world/index", "mail bob@example.com", "http://h:80/r: HTTP 500: bob@example.com",
    "https://h1:9200,https://h2:9200", "",
])
def test_text_without_user_info_is_unchanged(text):
    assert redact(text) == text
    assert split_userinfo(text) == (text, None)
    assert credentials(text) is None and encoded_userinfo(text) == text


@pytest.mark.parametrize("text, shown", [
    # comma-separated host lists, as retriever.hosts takes them
    (f"https://elastic:{SPECIAL}@h1:9200,https://elastic:{SPECIAL}@h2:9200,https://h3:9200",
     "https://***@h1:9200,https://***@h2:9200,https://h3:9200"),
    ("https://e:p/1@h1:9200, https://e:p#2@h2:9200", "https://***@h1:9200, https://***@h2:9200"),
    # several URLs in a message, quoted, at a line end, followed by a colon
    (f"at http://elastic:{SPECIAL}@h:8000/retrieve: gave up; see https://u:q@g/x.",
     "at http://***@h:8000/retrieve: gave up; see https://***@g/x."),
    (f"Could not parse URL 'http://elastic:{SPECIAL}@127.0.0.1:9200'",
     "Could not parse URL 'http://***@127.0.0.1:9200'"),
    (f"http://elastic:{SPECIAL}@127.0.0.1:no-port", "http://***@127.0.0.1:no-port"),  # a port the parser rejects
    (f"a http://elastic:{SPECIAL}@h1\nb http://elastic:{SPECIAL}@h2", "a http://***@h1\nb http://***@h2"),
    # user info in the standard form: user names with @, a token alone, percent-encoded passwords
    ("https://me@corp.com:pw@host/x", "https://***@host/x"), ("https://TOKEN@host/x", "https://***@host/x"),
    ("https://me@corp.com:9200/path@v2", "https://***@corp.com:9200/path@v2"),
    ("http://elastic:a%2Fb%23c@h:1", "http://***@h:1"),
])
def test_every_url_of_a_text_is_redacted(text, shown):
    assert redact(text) == shown
    assert redact(shown) == shown  # idempotent


def test_encoded_user_info_is_what_url_parsers_read_back():
    url = f"http://elastic:{SPECIAL}@127.0.0.1:9200/retrieve"
    encoded = encoded_userinfo(url)
    assert encoded == ("http://elastic:Pw1-7c3e%2FPw2-91ab%23Pw3-5d20%3FPw4-e8f6%20Pw5-0b4c%40Pw6-a1d9%3APw7-66f3"
                       "@127.0.0.1:9200/retrieve")
    assert encoded_userinfo(encoded) == encoded  # an encoded one stays as it is
    assert (yarl.URL(encoded).host, yarl.URL(encoded).port, yarl.URL(encoded).password) == ("127.0.0.1", 9200, SPECIAL)
    parsed = urllib3.util.parse_url(encoded)  # the Elasticsearch client's parser; it leaves the user info encoded
    assert (parsed.host, parsed.port, urllib.parse.unquote(parsed.auth.partition(":")[2])) == ("127.0.0.1", 9200,
                                                                                               SPECIAL)
    assert redact(encoded) == "http://***@127.0.0.1:9200/retrieve"
    assert encoded_userinfo("https://TOKEN@host/x") == "https://TOKEN@host/x"  # a user alone stays alone
    assert encoded_userinfo("https://u:a b@host/x") == "https://u:a%20b@host/x"


def test_config_redaction_uses_it_for_values_and_arguments():
    cfg = config_lib.default_config()
    cfg.retriever.hosts = f"https://elastic:{SPECIAL}@es:9200,https://es2:9200"
    assert config_lib.redacted(cfg).retriever.hosts == "https://***@es:9200,https://es2:9200"
    assert config_lib.redacted_argument(f"--config.retriever.url=http://u:{SPECIAL}@h:8000/retrieve") == (
        "--config.retriever.url=http://***@h:8000/retrieve")
    assert config_lib.redacted_argument(f"--config.retriever.es_password={SPECIAL}") == (
        "--config.retriever.es_password=***")
