"""Timeouts and retries with exponential backoff for the network backends (elasticsearch, http).

A call is tried up to `1 + max_retries` times; each attempt is cut off after `timeout_s` seconds; before retry i
(1-based) it sleeps `backoff_s * 2 ** (i - 1)` seconds. The worst case before giving up is therefore
`(1 + max_retries) * timeout_s + backoff_s * (2 ** max_retries - 1)` seconds (`RequestPolicy.worst_case_s`).

Every message (the retry warnings, GiveUpError, `describe`) shows URLs as `llds_jax.runtime.redaction.redact`
makes them: a client library's error text may hold the URL with its user info.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from llds_jax.bounds import AT_LEAST_1, NON_NEGATIVE, POSITIVE
from llds_jax.runtime import redaction
from llds_jax.search.options import Options, option

T = TypeVar("T")
log = logging.getLogger(__name__)


class GiveUpError(RuntimeError):
    """All attempts failed, or one failed in a way a retry cannot fix; the message says why."""


@dataclasses.dataclass(frozen=True)
class RequestPolicy(Options):
    """The network backends' requests (elasticsearch, http): `timeout_s` per attempt (seconds), `max_retries` after
    the first attempt, `backoff_s` first pause (seconds), `max_concurrency` requests in flight per backend."""

    timeout_s: float = option(10.0, POSITIVE, doc="seconds per attempt of a request", operational=True)
    max_retries: int = option(3, NON_NEGATIVE, doc="retries of a failed request", operational=True)
    backoff_s: float = option(0.5, NON_NEGATIVE, doc="seconds of the first pause before a retry, doubled each time",
                              operational=True)
    max_concurrency: int = option(8, AT_LEAST_1, doc="requests in flight", operational=True)

    @classmethod
    def of(cls, options: "RequestPolicy") -> "RequestPolicy":
        """The policy part of a backend's options (a subclass)."""
        return cls(**{f.name: getattr(options, f.name) for f in dataclasses.fields(cls)})

    @property
    def worst_case_s(self) -> float:
        """Seconds a failing call can take before it gives up."""
        return (1 + self.max_retries) * self.timeout_s + self.backoff_s * (2**self.max_retries - 1)


async def call_with_retries(attempt: Callable[[], Awaitable[T]], policy: RequestPolicy, *, what: str,
                            is_permanent: Callable[[BaseException], bool]) -> T:
    """Awaits `attempt()` under `policy`; raises GiveUpError naming `what` when it cannot succeed.

    `is_permanent(error)` says an error will not go away on retry (a bad request): it stops at once. URL user info
    in `what` is redacted.
    """
    what = redaction.redact(what)
    last: BaseException | None = None
    for i in range(1 + policy.max_retries):
        if i:
            pause = policy.backoff_s * 2 ** (i - 1)
            log.warning("%s: attempt %d failed (%s); retrying in %.2f s", what, i, describe(last), pause)
            await asyncio.sleep(pause)
        try:
            return await asyncio.wait_for(attempt(), policy.timeout_s)
        except asyncio.TimeoutError:  # the builtin TimeoutError from Python 3.11 on
            last = TimeoutError(f"no answer within {policy.timeout_s:g} s")
        except Exception as e:  # anything else a network call raises is judged by is_permanent
            if is_permanent(e):
                raise GiveUpError(f"{what}: {describe(e)}") from e
            last = e
    attempts = 1 + policy.max_retries
    raise GiveUpError(f"{what}: gave up after {attempts} attempt{'s' if attempts > 1 else ''},"
                      f" last error: {describe(last)}") from last


def describe(error: BaseException | None) -> str:
    """A one-line description of an error: its type and message, URL user info redacted (`redaction.redact`)."""
    name, text = type(error).__name__, redaction.redact(str(error).strip())
    if not text:
        return name
    return text if text.startswith(name) else f"{name}: {text}"
