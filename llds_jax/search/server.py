"""A Search-R1 compatible retrieval server in front of any of our backends (aiohttp, requests served concurrently).

    python -m llds_jax.search.server --set backend=bm25 --set index_dir=/data/wiki18_bm25 --port 8000
    python -m llds_jax.search.server --config retriever.json --host 0.0.0.0 --port 8000

`--config` is a JSON object of make_retriever keys (factory.py); each `--set KEY=VALUE` overrides one key (VALUE is
parsed as JSON when it is valid JSON, else taken as a string).

Endpoints:
- `POST /retrieve` `{"queries": [str, ...], "topk": 3, "return_scores": true}` ->
  `{"result": [[{"document": {"id": str, "contents": str}, "score": float}, ...], ...]}`; with `return_scores`
  false (the default, as in Search-R1) the items are the bare documents. `topk` defaults to `--topk`.
  A malformed request gets 400 and a backend failure 503, each with `{"error": message}`.
- `GET /health`: 200 `{"status": "ok", "backend": name}` when the backend can serve, else 503 `{"error": message}`.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys

from aiohttp import web

from llds_jax.search.factory import make_retriever
from llds_jax.search.types import Retriever, RetrieverUnavailableError

log = logging.getLogger(__name__)
RETRIEVER_KEY = web.AppKey("retriever", Retriever)


def _bad_request(message: str) -> web.Response:
    return web.json_response({"error": message}, status=400)


def parse_request(body: object, default_topk: int) -> tuple[list[str], int, bool]:
    """(queries, topk, return_scores) of a /retrieve body; raises ValueError naming the bad field."""
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    queries = body.get("queries")
    if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
        raise ValueError('"queries" must be a list of strings')
    topk = body.get("topk")
    topk = default_topk if topk is None else topk
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError(f'"topk" must be an integer >= 1, got {topk!r}')
    return_scores = body.get("return_scores", False)
    if not isinstance(return_scores, bool):
        raise ValueError(f'"return_scores" must be true or false, got {return_scores!r}')
    return queries, topk, return_scores


def build_app(retriever: Retriever, *, default_topk: int = 3) -> web.Application:
    """The aiohttp application serving `retriever`; it closes the retriever on cleanup."""

    async def retrieve(request: web.Request) -> web.Response:
        try:
            queries, topk, return_scores = parse_request(await request.json(), default_topk)
        except json.JSONDecodeError:
            return _bad_request("the body is not valid JSON")
        except ValueError as e:
            return _bad_request(str(e))
        results = await retriever.search(queries, topk)
        failed = [r.error for r in results if r.error is not None]
        if failed:
            return web.json_response({"error": f"{len(failed)} of {len(queries)} queries failed: {failed[0]}"},
                                     status=503)
        if return_scores:
            payload = [[{"document": {"id": d.id, "contents": d.contents}, "score": d.score} for d in r.docs]
                       for r in results]
        else:
            payload = [[{"id": d.id, "contents": d.contents} for d in r.docs] for r in results]
        return web.json_response({"result": payload})

    async def health(request: web.Request) -> web.Response:
        try:
            await retriever.check()
        except RetrieverUnavailableError as e:
            return web.json_response({"error": str(e)}, status=503)
        return web.json_response({"status": "ok", "backend": retriever.backend})

    async def close_retriever(app: web.Application) -> None:
        await app[RETRIEVER_KEY].close()

    app = web.Application()
    app[RETRIEVER_KEY] = retriever
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m llds_jax.search.server", description=__doc__.split("\n")[0])
    parser.add_argument("--config", help="JSON file with the retriever config (make_retriever keys)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override one config key")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to bind (default 8000)")
    parser.add_argument("--topk", type=int, default=3, help="documents per query when a request has no topk")
    args = parser.parse_args(argv)
    if args.topk < 1:
        parser.error(f"--topk must be >= 1, got {args.topk}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("elastic_transport").setLevel(logging.WARNING)  # it logs every request at INFO
    try:
        cfg = config_from_args(args)
    except (OSError, ValueError) as e:
        sys.exit(f"error: {e}")

    async def app_factory() -> web.Application:
        retriever = make_retriever(cfg)
        try:
            await retriever.check()
        except RetrieverUnavailableError:
            await retriever.close()
            raise
        log.info("serving backend %s at http://%s:%d/retrieve", retriever.backend, args.host, args.port)
        return build_app(retriever, default_topk=args.topk)

    try:
        web.run_app(app_factory(), host=args.host, port=args.port, access_log=None, print=None)
    except (RetrieverUnavailableError, ValueError, OSError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
