"""A Search-R1 compatible retrieval server in front of any of our backends (aiohttp, requests served concurrently).

    python -m llds_jax.search.server --set backend=bm25 --set index_dir=/data/wiki18_bm25 --port 8000
    python -m llds_jax.search.server --config retriever.json --host 0.0.0.0 --port 8000 --max-topk 50

`--config` is a JSON object of make_retriever keys (factory.py); each `--set KEY=VALUE` overrides one key (VALUE is
parsed as JSON when it is valid JSON, else taken as a string).

Endpoints:
- `POST /retrieve` `{"queries": [str, ...], "topk": 3, "return_scores": true}` ->
  `{"result": [[{"document": {"id": str, "contents": str}, "score": float}, ...], ...]}`; with `return_scores`
  false (the default, as in Search-R1) the items are the bare documents. `topk` defaults to `--topk`.
  A malformed request gets 400 and a backend failure 503, each with `{"error": message}`.
- `GET /health`: 200 `{"status": "ok", "backend": name, "slow_clients_dropped": n}` when the backend can serve,
  else 503 `{"error": message}`.

Limits (`Limits`, one flag each): `topk` above `--max-topk`, more queries than `--max-queries` or a response
(JSON) above `--max-response-bytes` get 400, a body above `--max-request-bytes` 413; the `{"error": message}`
names the flag, its value and what the request had. A body nesting arrays or objects too deeply to parse gets 400.
The response size is checked twice: before any search, against `response_bound` when the backend knows the most
bytes one document takes (`max_document_bytes`: the embedded bm25 and faiss backends), and exactly while it is
encoded. Queries are searched in calls of at most `CHUNK_DOCUMENTS` documents and each call's results are encoded
at once, so a request holds at most its encoded answer (<= --max-response-bytes) and one call's documents; the
answer is JSON in UTF-8 (as Search-R1's FastAPI server sends it), sent without being copied whole.
Slow clients (`Limits.header_timeout_s`, `--header-timeout-s`, 10 s; `body_timeout_s`, `--body-timeout-s`, 30 s):
a connection whose request headers are not complete in time is closed, a request whose body is not in time gets
408 and its connection closed; each is counted (`slow_clients_dropped` in /health). The first drop is one warning
line, the drops after it one summary line per `--slow-client-summary-s` (60 s) that had any (`SlowClients`; before
issue 66, 3,500 slow clients wrote 3,500 lines). A client that closes its connection mid-body is one info line
(before: a 29-line traceback).
A start-up failure (bad config, missing index, unavailable backend, address in use) is one line on stderr,
`python -m llds_jax.search.server: error: <reason>`, and exit status 2.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import json
import logging
import socket
import sys
from collections.abc import Awaitable, Iterator, Sequence

import aiohttp
import aiohttp.http_exceptions
from aiohttp import web

from llds_jax.search.factory import make_retriever
from llds_jax.search.types import Retriever, RetrieverUnavailableError, SearchResult

log = logging.getLogger(__name__)
PROG = "python -m llds_jax.search.server"
EXIT_START_FAILED = 2
RETRIEVER_KEY = web.AppKey("retriever", Retriever)
SLOW_CLIENTS_KEY = web.AppKey("slow_clients", "SlowClients")
EMPTY_RESPONSE = b'{"result": []}'
SCORE_CHARS = 24  # the most characters json.dumps writes for a float: "-2.2250738585072014e-308"
# What `return_scores` wraps around a document: {"document": DOC, "score": SCORE}.
SCORED_EXTRA_BYTES = len('{"document": , "score": }') + SCORE_CHARS
# Documents one backend call may return (it gets CHUNK_DOCUMENTS // topk queries, at least one): what a request
# holds in memory as Python objects at a time, ~9 MB of wiki-18 passages.
CHUNK_DOCUMENTS = 8192
SLOW_CLIENT_SUMMARY_S = 60.0  # seconds between the summary lines of dropped slow clients (`SlowClients`)


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one /retrieve request may ask for; the defaults are the command's.

    max_topk: documents per query. max_queries: queries per request. max_request_bytes: body bytes (after any
    content decoding). max_response_bytes: bytes of the JSON answer. header_timeout_s: seconds a new connection
    has to send its first request's headers (and an idle kept-alive connection its next ones), else it is closed.
    body_timeout_s: seconds a request has to send its body once its headers are in, else it gets 408 and the
    connection is closed.
    """

    max_topk: int = 100
    max_queries: int = 4096
    max_request_bytes: int = 4 << 20
    max_response_bytes: int = 64 << 20
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0


class SlowClients:
    """Counts the connections dropped for being slow (`header_timeout_s`, `body_timeout_s`); /health reports the
    count. A drop after a quiet spell is one warning line naming the client; the drops after it are summed up, one
    line every `summary_s` seconds that had any (by reason), so that a flood of slow clients is a count, not a
    line each. Called on the event loop."""

    def __init__(self, summary_s: float):
        self.dropped = 0
        self.summary_s = summary_s
        self._unreported: collections.Counter[str] = collections.Counter()  # drops since the last line, by reason
        self._summary: asyncio.TimerHandle | None = None  # the next summary line; None: quiet, log the next drop

    def drop(self, peer: object, why: str) -> None:
        self.dropped += 1
        if self._summary is not None:
            self._unreported[why] += 1
            return
        log.warning("dropped a slow client %s: %s; %d slow client(s) dropped so far (more within %g s are summed "
                    "up in one line)", _peer(peer), why, self.dropped, self.summary_s)
        self._summary = asyncio.get_running_loop().call_later(self.summary_s, self._summarize)

    def _summarize(self) -> None:
        """The summary line of the drops since the last line, if any; then the next one, or quiet."""
        if not self._unreported:
            self._summary = None
            return
        reasons = "; ".join(f"{count} x {why}" for why, count in self._unreported.items())
        log.warning("dropped %d more slow client(s) in %g s (%s); %d slow client(s) dropped so far",
                    self._unreported.total(), self.summary_s, reasons, self.dropped)
        self._unreported.clear()
        self._summary = asyncio.get_running_loop().call_later(self.summary_s, self._summarize)


def _peername(request: web.Request) -> object:
    return request.transport.get_extra_info("peername") if request.transport is not None else request.remote


def _peer(peer: object) -> str:
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else str(peer)


class _HeaderDeadline(asyncio.Protocol):
    """aiohttp's protocol of one connection, closed when its first request's headers (up to the blank line) do
    not arrive within `timeout_s` (a slow or silent client holds a connection and a task otherwise: 10,126
    connections stayed open for 40 s before issue 58). A kept-alive connection's later requests fall under
    aiohttp's keep-alive timeout, set to the same value."""

    def __init__(self, inner: asyncio.Protocol, timeout_s: float, slow: SlowClients):
        self._inner, self._timeout_s, self._slow = inner, timeout_s, slow
        self._deadline: asyncio.TimerHandle | None = None
        self._tail = b""  # the last 3 bytes received, for a blank line split across reads

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport
        self._deadline = asyncio.get_running_loop().call_later(self._timeout_s, self._expire)
        self._inner.connection_made(transport)

    def _expire(self) -> None:
        self._deadline = None
        self._slow.drop(self._transport.get_extra_info("peername"), f"no complete request headers within "
                        f"{self._timeout_s:g} s (--header-timeout-s)")
        self._transport.abort()

    def data_received(self, data: bytes) -> None:
        if self._deadline is not None:
            if b"\r\n\r\n" in self._tail + data:
                self._deadline.cancel()
                self._deadline = None
            self._tail = (self._tail + data)[-3:]
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()


class ResponseTooLargeError(ValueError):
    """The answer to a request would pass Limits.max_response_bytes."""


def _error(message: str, status: int = 400) -> web.Response:
    return web.json_response({"error": message}, status=status)


def parse_request(body: object, default_topk: int, limits: Limits = Limits()) -> tuple[list[str], int, bool]:
    """(queries, topk, return_scores) of a /retrieve body; raises ValueError naming the bad field or the limit."""
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    queries = body.get("queries")
    if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
        raise ValueError('"queries" must be a list of strings')
    if len(queries) > limits.max_queries:
        raise ValueError(f'"queries" must hold at most {limits.max_queries} queries (--max-queries),'
                         f" got {len(queries)}")
    topk = body.get("topk")
    topk = default_topk if topk is None else topk
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError(f'"topk" must be an integer >= 1, got {topk!r}')
    if topk > limits.max_topk:
        raise ValueError(f'"topk" must be at most {limits.max_topk} (--max-topk), got {topk}')
    return_scores = body.get("return_scores", False)
    if not isinstance(return_scores, bool):
        raise ValueError(f'"return_scores" must be true or false, got {return_scores!r}')
    return queries, topk, return_scores


def encode_result(result: SearchResult, return_scores: bool) -> bytes:
    """One query's list of documents as JSON in UTF-8 (json.dumps' separators; a lone surrogate as its \\u
    escape)."""
    if return_scores:
        items = [{"document": {"id": d.id, "contents": d.contents}, "score": d.score} for d in result.docs]
    else:
        items = [{"id": d.id, "contents": d.contents} for d in result.docs]
    return json.dumps(items, ensure_ascii=False).encode("utf-8", "backslashreplace")


def response_bound(num_queries: int, topk: int, return_scores: bool, document_bytes: int) -> int:
    """The size in bytes of the largest body `ResponseBody` can make from `num_queries` results of at most `topk`
    documents each, when one document's `{"id": ..., "contents": ...}` takes at most `document_bytes` bytes: every
    list full, every score SCORE_CHARS long."""
    if num_queries == 0:
        return len(EMPTY_RESPONSE)
    item = document_bytes + (SCORED_EXTRA_BYTES if return_scores else 0)
    # '{"result": [' + lists + ']}', ", " after every list but the last; a list is '[' + items + ']', ", " after
    # every item but the last.
    return len(EMPTY_RESPONSE) + num_queries * (topk * (item + 2) + 2) - 2


class ResponseBody:
    """The JSON body `{"result": [...]}` (UTF-8), built from the results of `num_queries` queries in order, one
    backend call at a time. `add` raises ResponseTooLargeError as soon as the body would pass `max_bytes`. The body
    is held as one byte string per `add`, never joined: `take` hands them out, dropping each."""

    def __init__(self, num_queries: int, return_scores: bool, max_bytes: int):
        self.num_queries, self.return_scores, self.max_bytes = num_queries, return_scores, max_bytes
        self.size = len(EMPTY_RESPONSE)  # bytes
        self.done = 0  # queries encoded
        self._parts: collections.deque[bytes] = collections.deque([b'{"result": ['])

    def add(self, results: Sequence[SearchResult]) -> None:
        """Encodes the next results (queries `done`, `done` + 1, ...)."""
        if not results:
            return
        if self.done:
            self._parts.append(b", ")
        lists = []
        for r in results:
            lists.append(encode_result(r, self.return_scores))
            self.size += len(lists[-1]) + (2 if self.done else 0)  # ", " between lists
            self.done += 1
            if self.size > self.max_bytes:
                raise ResponseTooLargeError(
                    f"the response would pass {self.max_bytes} bytes (--max-response-bytes): {self.size} bytes"
                    f' after {self.done} of {self.num_queries} queries; ask for fewer queries or a smaller "topk"')
        self._parts.append(b", ".join(lists))

    def take(self) -> Iterator[bytes]:
        """The body's byte strings in order, each dropped from the body as it is handed out."""
        while self._parts:
            yield self._parts.popleft()
        yield b"]}"


async def _read_json(request: web.Request, max_bytes: int) -> object:
    """The parsed body; raises web.HTTPRequestEntityTooLarge past `max_bytes` (the app's client_max_size) and
    json.JSONDecodeError."""
    if request.content_length is not None and request.content_length > max_bytes:
        raise web.HTTPRequestEntityTooLarge(max_bytes, request.content_length)
    return await request.json()


class ClientGone(Exception):
    """The client closed its connection before its body was in (logged in one line, not answered)."""


def _bound_error(num_queries: int, topk: int, return_scores: bool, document_bytes: int | None,
                 max_bytes: int) -> web.Response | None:
    """The 400 for a request whose `response_bound` passes `max_bytes`; None when it fits or the backend gives no
    `document_bytes`."""
    if document_bytes is None:
        return None
    bound = response_bound(num_queries, topk, return_scores, document_bytes)
    if bound <= max_bytes:
        return None
    return _error(f"the response could pass {max_bytes} bytes (--max-response-bytes): up to {bound} bytes for"
                  f" {num_queries} queries x topk {topk} (the longest document takes {document_bytes} bytes);"
                  ' ask for fewer queries or a smaller "topk"')


async def _search_into(body: ResponseBody, retriever: Retriever, queries: list[str], topk: int,
                       searched: int) -> web.Response | None:
    """Searches `queries` (the next after `searched` of the request's) and adds their results to `body`; the error
    response when the backend failed or the body passed its limit, else None."""
    results = await retriever.search(queries, topk)
    failed = [r.error for r in results if r.error is not None]
    if failed:
        searched += len(queries)
        rest = body.num_queries - searched
        return _error(f"{len(failed)} of {searched} queries failed"
                      + (f" (the other {rest} were not searched)" if rest else "") + f": {failed[0]}", status=503)
    try:
        body.add(results)
    except ResponseTooLargeError as e:
        return _error(str(e))
    return None


async def _send(request: web.Request, body: ResponseBody) -> web.StreamResponse:
    """A 200 with `body`, written part by part (never copied whole)."""
    response = web.StreamResponse(headers={"Content-Type": "application/json; charset=utf-8"})
    response.content_length = body.size
    await response.prepare(request)
    for part in body.take():
        await response.write(part)
    await response.write_eof()
    return response


def build_app(retriever: Retriever, *, default_topk: int = 3, limits: Limits = Limits(),
              slow_client_summary_s: float = SLOW_CLIENT_SUMMARY_S) -> web.Application:
    """The aiohttp application serving `retriever` under `limits`; it closes the retriever on cleanup. Dropped slow
    clients are summed up in one log line per `slow_client_summary_s` seconds (`SlowClients`)."""
    document_bytes = getattr(retriever, "max_document_bytes", None)  # the embedded backends know it
    slow = SlowClients(slow_client_summary_s)

    async def retrieve(request: web.Request) -> web.StreamResponse:
        try:
            try:
                payload = await asyncio.wait_for(_read_json(request, limits.max_request_bytes), limits.body_timeout_s)
            except (ConnectionError, aiohttp.ClientPayloadError, aiohttp.http_exceptions.HttpProcessingError) as e:
                raise ClientGone(e) from None
            queries, topk, return_scores = parse_request(payload, default_topk, limits)
        except ClientGone as e:
            log.info("client %s closed its connection before its body was in (%s)", _peer(_peername(request)),
                     type(e.args[0]).__name__)
            raise web.HTTPBadRequest() from None  # nobody reads the answer; aiohttp closes the connection
        except asyncio.TimeoutError:
            slow.drop(_peername(request), f"its body was not in within {limits.body_timeout_s:g} s "
                      "(--body-timeout-s)")
            response = _error(f"the body did not arrive within {limits.body_timeout_s:g} s (--body-timeout-s)", 408)
            response.force_close()
            await response.prepare(request)
            await response.write_eof()
            if request.transport is not None:  # at once: aiohttp would wait 10 s more for the rest of the body
                request.transport.close()
            return response
        except web.HTTPRequestEntityTooLarge:
            got = "more" if request.content_length is None else request.content_length
            return _error(f"the body must be at most {limits.max_request_bytes} bytes (--max-request-bytes),"
                          f" got {got}", status=413)
        except json.JSONDecodeError:
            return _error("the body is not valid JSON")
        except RecursionError:
            return _error("the body nests JSON arrays or objects too deeply to parse")
        except ValueError as e:
            return _error(str(e))
        refused = _bound_error(len(queries), topk, return_scores, document_bytes, limits.max_response_bytes)
        if refused is not None:
            return refused
        body = ResponseBody(len(queries), return_scores, limits.max_response_bytes)
        per_call = max(1, CHUNK_DOCUMENTS // topk)
        for start in range(0, len(queries), per_call):
            failure = await _search_into(body, retriever, queries[start:start + per_call], topk, start)
            if failure is not None:
                return failure
        return await _send(request, body)

    async def health(request: web.Request) -> web.Response:
        try:
            await retriever.check()
        except RetrieverUnavailableError as e:
            return web.json_response({"error": str(e)}, status=503)
        return web.json_response({"status": "ok", "backend": retriever.backend, "slow_clients_dropped": slow.dropped})

    async def close_retriever(app: web.Application) -> None:
        await app[RETRIEVER_KEY].close()

    app = web.Application(client_max_size=limits.max_request_bytes)
    app[RETRIEVER_KEY] = retriever
    app[SLOW_CLIENTS_KEY] = slow
    app.router.add_post("/retrieve", retrieve)
    app.router.add_get("/health", health)
    app.on_cleanup.append(close_retriever)
    return app


def config_from_args(args: argparse.Namespace) -> dict:
    """The retriever config from --config and --set; raises ValueError naming the file or the bad --set."""
    cfg: dict = {}
    if args.config:
        with open(args.config, encoding="utf-8") as f:
            try:
                cfg = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{args.config}:{e.lineno}: not valid JSON ({e.msg})") from e
        if not isinstance(cfg, dict):
            raise ValueError(f"{args.config}: must hold a JSON object of retriever config keys")
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE")
        try:
            cfg[key] = json.loads(value)
        except json.JSONDecodeError:
            cfg[key] = value
    return cfg


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket listening on host:port; raises OSError naming the address (e.g. one in use)."""
    sock = None
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen()
        return sock
    except OSError as e:
        if sock is not None:
            sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    parser.add_argument("--config", help="JSON file with the retriever config (make_retriever keys)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override one config key")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to bind (default 8000)")
    parser.add_argument("--topk", type=int, default=3, help="documents per query when a request has no topk")
    limits = Limits()
    parser.add_argument("--max-topk", type=int, default=limits.max_topk,
                        help=f"most documents per query a request may ask for (default {limits.max_topk})")
    parser.add_argument("--max-queries", type=int, default=limits.max_queries,
                        help=f"most queries in one request (default {limits.max_queries})")
    parser.add_argument("--max-request-bytes", type=int, default=limits.max_request_bytes,
                        help=f"largest request body in bytes (default {limits.max_request_bytes})")
    parser.add_argument("--max-response-bytes", type=int, default=limits.max_response_bytes,
                        help=f"largest response body in bytes (default {limits.max_response_bytes})")
    parser.add_argument("--header-timeout-s", type=float, default=limits.header_timeout_s,
                        help=f"seconds a connection has to send a request's headers, else it is closed (default "
                             f"{limits.header_timeout_s:g})")
    parser.add_argument("--body-timeout-s", type=float, default=limits.body_timeout_s,
                        help=f"seconds a request has to send its body, else 408 and the connection closed (default "
                             f"{limits.body_timeout_s:g})")
    parser.add_argument("--slow-client-summary-s", type=float, default=SLOW_CLIENT_SUMMARY_S,
                        help="seconds between the log lines that sum up the slow clients dropped after the first "
                             f"one (default {SLOW_CLIENT_SUMMARY_S:g})")
    args = parser.parse_args(argv)
    for name in ("topk", "slow_client_summary_s", *(f.name for f in dataclasses.fields(Limits))):
        value, flag = getattr(args, name), f"--{name.replace('_', '-')}"
        if name.endswith("_s") and not (0 < value < float("inf")):
            parser.error(f"{flag} must be finite and > 0, got {value}")
        if not name.endswith("_s") and value < 1:
            parser.error(f"{flag} must be >= 1, got {value}")
    if args.topk > args.max_topk:
        parser.error(f"--topk must be at most --max-topk ({args.max_topk}), got {args.topk}")
    return args


async def serve(app: Awaitable[web.Application], sock: socket.socket, limits: Limits) -> None:
    """Serves `app` on the listening `sock` until SIGTERM or SIGINT (web.GracefulExit), as web.run_app does, with
    every connection's headers bounded by limits.header_timeout_s (`_HeaderDeadline`, which run_app cannot add)."""
    app = await app
    runner = web.AppRunner(app, access_log=None, keepalive_timeout=limits.header_timeout_s)
    await runner.setup()
    slow = app[SLOW_CLIENTS_KEY]
    server = await asyncio.get_running_loop().create_server(
        lambda: _HeaderDeadline(runner.server(), limits.header_timeout_s, slow), sock=sock)
    try:
        await asyncio.Event().wait()
    finally:
        server.close()
        await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("elastic_transport").setLevel(logging.WARNING)  # it logs every request at INFO
    # It warns of every failed request; the retriever reports failures (with retries) itself.
    logging.getLogger("elastic_transport.node_pool").setLevel(logging.ERROR)
    limits = Limits(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Limits)})

    async def app_factory() -> web.Application:
        retriever = make_retriever(cfg)
        try:
            await retriever.check()
        except BaseException:
            await retriever.close()
            raise
        log.info("serving backend %s at http://%s:%d/retrieve", retriever.backend, args.host, args.port)
        return build_app(retriever, default_topk=args.topk, limits=limits,
                         slow_client_summary_s=args.slow_client_summary_s)

    try:
        cfg = config_from_args(args)
        with listen(args.host, args.port) as sock:  # bound before the backend loads: a used address fails at once
            asyncio.run(serve(app_factory(), sock, limits))
    except (web.GracefulExit, KeyboardInterrupt):  # SIGTERM, SIGINT
        pass
    except (RetrieverUnavailableError, ValueError, OSError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        sys.exit(EXIT_START_FAILED)


if __name__ == "__main__":
    main()
