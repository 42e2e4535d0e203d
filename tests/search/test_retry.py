"""Per-attempt timeouts, exponential backoff and giving up (retry.py)."""
import asyncio

import pytest

from llds_jax.search import retry
from llds_jax.search.retry import GiveUpError, RequestPolicy, call_with_retries


class Flaky:
    """An async call failing with `errors` in turn, then returning "ok"; counts attempts."""

    def __init__(self, *errors):
        self.errors, self.attempts = list(errors), 0

    async def __call__(self):
        self.attempts += 1
        if self.errors:
            error = self.errors.pop(0)
            if error == "hang":
                await asyncio.sleep(3600)
            raise error
        return "ok"


def run(attempt, policy, permanent=lambda e: isinstance(e, ValueError)):
    return asyncio.run(call_with_retries(attempt, policy, what="svc at host:1", is_permanent=permanent))


@pytest.fixture
def pauses(monkeypatch):
    """Backoff pauses requested (seconds), skipped instantly."""
    recorded = []
    real_sleep = asyncio.sleep

    async def fake_sleep(seconds, *args):
        recorded.append(seconds)
        await real_sleep(0)

    monkeypatch.setattr(retry.asyncio, "sleep", fake_sleep)
    return recorded


def test_transient_errors_are_retried_with_doubling_backoff(pauses):
    flaky = Flaky(ConnectionError("refused"), ConnectionError("refused"), OSError("reset"))
    assert run(flaky, RequestPolicy(timeout_s=1, max_retries=3, backoff_s=0.5)) == "ok"
    assert flaky.attempts == 4
    assert pauses == [0.5, 1.0, 2.0]


def test_gives_up_after_max_retries_naming_the_last_error(pauses):
    flaky = Flaky(*[ConnectionError("refused")] * 5)
    expected = r"^svc at host:1: gave up after 3 attempts, last error: ConnectionError: refused$"
    with pytest.raises(GiveUpError, match=expected):
        run(flaky, RequestPolicy(timeout_s=1, max_retries=2, backoff_s=0.1))
    assert flaky.attempts == 3


def test_permanent_error_stops_at_once(pauses):
    flaky = Flaky(ValueError("bad request"))
    with pytest.raises(GiveUpError, match=r"^svc at host:1: ValueError: bad request$"):
        run(flaky, RequestPolicy(max_retries=5))
    assert flaky.attempts == 1 and pauses == []


def test_each_attempt_is_cut_at_the_timeout():
    flaky = Flaky("hang", "hang")
    expected = "gave up after 2 attempts, last error: TimeoutError: no answer within 0.05 s"
    with pytest.raises(GiveUpError, match=expected):
        run(flaky, RequestPolicy(timeout_s=0.05, max_retries=1, backoff_s=0.0))
    flaky = Flaky("hang")
    assert run(flaky, RequestPolicy(timeout_s=0.05, max_retries=1, backoff_s=0.0)) == "ok"


def test_worst_case_and_validation():
    assert RequestPolicy(timeout_s=2, max_retries=3, backoff_s=0.5).worst_case_s == 11.5
    for bad in ({"timeout_s": 0}, {"backoff_s": -1}, {"max_retries": -1}, {"max_concurrency": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            RequestPolicy(**bad)
