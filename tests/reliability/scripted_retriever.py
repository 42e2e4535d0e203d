"""A Search-R1 retrieval server on loopback whose behaviour a test scripts while a run uses it: it answers every
query with one passage, fails with HTTP 503 (`failing`) or never answers (`hanging`: an endpoint that stopped
responding), and calls `on_request` as each request arrives (before answering) and `on_answered` once an answer is
written (the client is still reading it). `documents`, when set, are the `contents` of the hits it serves per query
(anything JSON holds); by default `topk` copies of one passage. Import as
`from tests.reliability.scripted_retriever import ScriptedRetriever`."""
from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tests.servers import free_port

PASSAGE = "Nobody\nNobody was born in a city that no question asks about."


class ScriptedRetriever:
    """`with ScriptedRetriever() as server:` serves `server.url` (the `/retrieve` endpoint) until the block ends.

    Attributes a test may set at any time: `failing` (answer 503), `hanging` (answer nothing until the server
    closes), `on_request` (called with the request's queries, on the server's thread), `on_answered` (the same,
    after a 200 answer's last byte was handed to the socket). `requests` counts the requests received."""

    def __init__(self):
        self.failing = False
        self.hanging = False
        self.documents: list[object] | None = None
        self._closed = threading.Event()
        self.on_request: Callable[[list[str]], None] | None = None
        self.on_answered: Callable[[list[str]], None] | None = None
        self.requests = 0
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/retrieve"
        scripted = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - the http.server interface
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                scripted.requests += 1
                if scripted.on_request is not None:
                    scripted.on_request(body["queries"])
                if scripted.hanging:
                    scripted._closed.wait()
                    return
                if scripted.failing:
                    self._send(503, {"error": "scripted outage"})
                else:
                    served = scripted.documents or [PASSAGE] * body["topk"]
                    hits = [{"document": {"id": str(i), "contents": contents}, "score": 1.0}
                            for i, contents in enumerate(served)]
                    self._send(200, {"result": [hits for _ in body["queries"]]})
                    if scripted.on_answered is not None:
                        scripted.on_answered(body["queries"])

            def _send(self, status: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> ScriptedRetriever:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._closed.set()
        self._server.shutdown()
        self._server.server_close()

    def config(self) -> dict:
        """The run config's `retriever` section for this server: one attempt of at most 5 s per request."""
        return {"backend": "http", "url": self.url, "timeout_s": 5.0, "max_retries": 0}
