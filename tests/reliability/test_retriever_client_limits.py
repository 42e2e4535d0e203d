"""The http retriever against a server on loopback that answers without end (issue 58 item 14: the client had no
response-size limit and went from 37 MB to 1.47 GB in one 5 s attempt). Now the answer is abandoned once it passes
`retriever.max_response_bytes`, the queries fail with an error naming the key (as a timed-out request's do, counted
in rollout/retriever_errors), the request is not retried, and the client's memory stays bounded."""
import asyncio
import resource
import socketserver
import threading

import pytest

from llds_jax.search import make_retriever

CHUNK = b"x" * (1 << 16)


class EndlessHandler(socketserver.BaseRequestHandler):
    """Reads the request head, then sends a chunked 200 answer whose body never ends, until the client hangs up."""

    def handle(self):
        self.request.recv(1 << 16)
        self.server.requests += 1
        self.request.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
                             b'1\r\n{\r\n')
        try:
            while True:
                self.request.sendall(b"%x\r\n%s\r\n" % (len(CHUNK), CHUNK))
        except OSError:  # the client hung up
            return


@pytest.fixture
def endless_server():
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), EndlessHandler)
    server.daemon_threads, server.requests = True, 0
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def max_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def test_an_endless_answer_is_abandoned_at_max_response_bytes_and_not_retried(endless_server):
    url = f"http://127.0.0.1:{endless_server.server_address[1]}/retrieve"

    async def search():
        async with make_retriever({"backend": "http", "url": url, "max_response_bytes": 4 << 20,
                                   "timeout_s": 30.0}) as retriever:
            return await retriever.search(["who founded Acme", "where is Acme"], 3)

    before = max_rss_mb()
    results = asyncio.run(asyncio.wait_for(search(), 20))
    assert [r.docs for r in results] == [[], []]
    for result in results:
        assert "ResponseTooLargeError: the answer passed max_response_bytes = 4194304 bytes " \
               "(retriever.max_response_bytes)" in result.error
    assert endless_server.requests == 1  # not retried: the same request would get the same answer
    assert max_rss_mb() - before < 64


def test_max_response_bytes_is_validated_naming_the_key():
    with pytest.raises(ValueError, match=r"^retriever\.max_response_bytes must be >= 1, got 0$"):
        make_retriever({"backend": "http", "url": "http://127.0.0.1:1/retrieve", "max_response_bytes": 0})
