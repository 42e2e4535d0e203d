"""Retrieval throughput on a generated wiki-18 style corpus (no downloads).

    python bench/retrieval.py                  # 100k passages of ~100 words (the numbers in docs/retrieval.md)
    python bench/retrieval.py --n-docs 5000    # a quick run

Prints, for top-3 retrieval:
1. engine comparison (each engine in its own process, so RAM is its own): our streaming build of the bm25s format
   vs bm25s's in-memory `BM25.index` vs tantivy's index writer: build seconds, queries/s one at a time and in
   batches, resident and peak RAM (MiB), planted answers found at rank 1; plus which k1/b tantivy scores with;
2. the embedded retriever through its async API (`await search(...)`): queries/s, single and batched;
3. our Search-R1 server (`python -m llds_jax.search.server`, bm25 backend) under concurrent clients: requests/s
   with one query per request, and queries/s with batched requests;
4. query evaluation at wiki-18 scale (`--scale-docs`, 21M) on synthetic postings of a 7-term query: bm25s's numpy
   path (dense scores over all documents + argpartition) vs ours (`top_k_postings`, O(postings)).
5. dense (e5): a randomly initialized encoder of e5-base-v2's shape (BERT-base: 768 hidden, 12 layers, 12 heads;
   no model download is possible here, and speed does not depend on the weights): passages/s of
   `index_builder --to faiss --encoder e5`'s embedding (our jit encoder, length-sorted buckets) extrapolated to
   wiki-18's 21M passages; queries/s of our batched encoder + faiss Flat vs transformers' BertModel (PyTorch,
   Search-R1's recipe: a padded batch, mean pooling) + the same faiss search, same process, same queries; the
   search alone over faiss Flat (exact) and HNSW64 (Search-R1's `e5_HNSW64.index`: M 64, efSearch 16, faiss's
   default) built over the same rows, same query vectors: queries/s, seconds per query, Flat's seconds per query
   per million rows extrapolated to wiki-18's 21,015,324 rows, HNSW's recall@3 against Flat's exact top-3, faiss's
   thread count; and the memory of loading a Flat index memory-mapped (our default) vs read into memory.
   `--search-only` runs only the search measurements, on random unit query vectors, without the encoders:

    python bench/retrieval.py --search-only --dense-rows 200000 --dense-queries 256 --dense-batch 64
6. `--calls`: what the step estimate's retrieval line reads (llds_jax/aot/step_estimate.py), faiss on one thread over
   `--dense-rows` random unit rows: seconds of a call of 1 query (faiss's per-query path: one scan of every row
   per query), of `--blas-queries` queries (its BLAS path, from 167 queries at 768 dimensions) per query, both per
   million rows, and HNSW64's seconds per query; then the calls a rollout makes (1, 8, 64 queries) on all threads.
7. `--device`: the e5_device search (llds_jax/search/device_search.py) against faiss Flat in one process, same rows
   and queries, on this process's JAX devices (`XLA_FLAGS=--xla_force_host_platform_device_count=8` for 8 CPU
   devices): queries/s of each and their ratio, the ids equal or not, at calls of `--dense-batch` queries.
8. `--e5-recall`: HNSW64's recall@3 against Flat on e5 vectors: the demo world's passages (`--world-people`) and
   questions embedded by the project's e5 encoder (`--encoder`, an e5 folder such as intfloat/e5-base-v2; without
   one the demo's small random BERT, `demo.retriever = "e5_device"`'s, written with NumPy).

    python bench/retrieval.py --calls --dense-rows 200000
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python bench/retrieval.py --device --dense-rows 200000
    python bench/retrieval.py --e5-recall [--encoder e5-base-v2]
9. `--second-pass`: the e5_device searcher's second-pass rate (what the step estimate's retrieval term reads,
   llds_jax/aot/step_estimate.py `SECOND_PASS`): the demo world's passages (`--world-people`, the demo's 400 by
   default, seed 0) embedded as `demo.retriever = "e5_device"` embeds them (its small random BERT of e5's layout,
   written with NumPy, or `--encoder`), searched on this process's JAX devices for the top 3 with the searcher's
   defaults (32 candidates, 4x more per further pass) by the demonstrator's search queries of every train and
   test question (`World.hops`: the queries the demo's demonstrations issue), one query per search: the share of
   queries each pass count served.

    python bench/retrieval.py --second-pass
Queries are 3-6 filler words drawn like passage words (so they hit long posting lists: a pessimistic load).
"""
from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import numpy as np

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from index_builder.corpus import CorpusReader  # noqa: E402
from index_builder.to_bm25 import build_bm25  # noqa: E402
from llds_jax.search.synthetic import SyntheticCorpus  # noqa: E402
from llds_jax.aot.step_estimate import WIKI18_ROWS  # noqa: E402  (the estimate's retrieval line reads these figures)

TOP_K = 3


def memory_mib() -> tuple[float, float]:
    """(resident, peak resident) memory of this process in MiB, from /proc/self/status."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            fields[key] = value
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def queries_per_s(search, queries: list[str], batch: int) -> float:
    """Queries per second of `search(list_of_queries)` called with `batch` queries at a time."""
    start = time.perf_counter()
    for i in range(0, len(queries), batch):
        search(queries[i:i + batch])
    return len(queries) / (time.perf_counter() - start)


def engine_ours(corpus_path: str, work: str, queries: list[str], planted, batch: int) -> dict:
    from llds_jax.search.bm25 import Bm25Retriever

    start = time.perf_counter()
    build_bm25(CorpusReader(corpus_path), os.path.join(work, "ours"))
    build_s = time.perf_counter() - start
    retriever = Bm25Retriever(os.path.join(work, "ours"), workers=1)
    search = lambda qs: retriever.search_blocking(qs, TOP_K)  # noqa: E731
    found = sum(r.docs[0].id == p.doc_id for r, p in zip(search([p.query for p in planted]), planted))
    return {"build_s": build_s, "single_qps": queries_per_s(search, queries, 1),
            "batched_qps": queries_per_s(search, queries, batch), "planted_top1": found}


def engine_bm25s_in_memory(corpus_path: str, work: str, queries: list[str], planted, batch: int) -> dict:
    import json

    import bm25s

    from llds_jax.search.analyzer import analyze

    start = time.perf_counter()
    with open(corpus_path, encoding="utf-8") as f:
        records = [json.loads(line) for line in f]  # the whole corpus as Python strings: what streaming avoids
    model = bm25s.BM25(k1=0.9, b=0.4, method="atire", idf_method="lucene")
    model.index([analyze(r["contents"]) for r in records], show_progress=False)
    build_s = time.perf_counter() - start

    def search(qs):
        terms = [[t for t in analyze(q) if t in model.vocab_dict] for q in qs]
        return model.retrieve(terms, k=TOP_K, show_progress=False, backend_selection="numpy")

    top = search([p.query for p in planted]).documents[:, 0]
    found = sum(records[n]["id"] == p.doc_id for n, p in zip(top, planted))
    return {"build_s": build_s, "single_qps": queries_per_s(search, queries, 1),
            "batched_qps": queries_per_s(search, queries, batch), "planted_top1": found}


def _tantivy_index(path: str | None):
    import tantivy

    from llds_jax.search.analyzer import ENGLISH_STOPWORDS

    schema_builder = tantivy.SchemaBuilder()
    schema_builder.add_text_field("contents", stored=False, tokenizer_name="english_bm25")
    schema_builder.add_integer_field("number", stored=True)
    index = tantivy.Index(schema_builder.build(), path=path)
    analyzer = (tantivy.TextAnalyzerBuilder(tantivy.Tokenizer.simple()).filter(tantivy.Filter.lowercase())
                .filter(tantivy.Filter.custom_stopword(sorted(ENGLISH_STOPWORDS)))
                .filter(tantivy.Filter.stemmer("english")).build())
    index.register_tokenizer("english_bm25", analyzer)
    return index


def engine_tantivy(corpus_path: str, work: str, queries: list[str], planted, batch: int) -> dict:
    import json

    import tantivy

    folder = os.path.join(work, "tantivy")
    os.makedirs(folder)
    start = time.perf_counter()
    index = _tantivy_index(folder)
    writer = index.writer(256_000_000, 1)
    ids = []
    with open(corpus_path, encoding="utf-8") as f:
        for number, line in enumerate(f):
            record = json.loads(line)
            ids.append(record["id"])
            writer.add_document(tantivy.Document(contents=record["contents"], number=number))
    writer.commit()
    writer.wait_merging_threads()
    index.reload()
    build_s = time.perf_counter() - start
    searcher = index.searcher()

    def search(qs):
        return [[searcher.doc(address)["number"][0]
                 for _, address in searcher.search(index.parse_query(re.sub(r"\W+", " ", q), ["contents"]),
                                                   TOP_K).hits]
                for q in qs]

    found = sum(ids[hits[0]] == p.doc_id for hits, p in zip(search([p.query for p in planted]), planted))
    return {"build_s": build_s, "single_qps": queries_per_s(search, queries, 1),
            "batched_qps": queries_per_s(search, queries, batch), "planted_top1": found}


def tantivy_bm25_parameters() -> str:
    """Which (k1, b) tantivy's scores follow, found by scoring a 4-document index against the formula."""
    import tantivy

    docs = ["apple banana", "apple apple cherry date", "banana cherry", "egg fig grape apple"]
    index = _tantivy_index(None)
    writer = index.writer(15_000_000, 1)
    for number, text in enumerate(docs):
        writer.add_document(tantivy.Document(contents=text, number=number))
    writer.commit()
    index.reload()
    searcher = index.searcher()
    hits = searcher.search(index.parse_query("apple", ["contents"]), 4).hits
    avgdl, idf = sum(len(d.split()) for d in docs) / 4, math.log(1 + (4 - 3 + 0.5) / (3 + 0.5))
    for k1, b in ((0.9, 0.4), (1.2, 0.75)):
        ok = True
        for score, address in hits:
            text = docs[searcher.doc(address)["number"][0]]
            tf, dl = text.split().count("apple"), len(text.split())
            ok &= math.isclose(score, idf * tf * (k1 + 1) / (tf + k1 * (1 - b + b * dl / avgdl)), rel_tol=1e-5)
        if ok:
            return f"k1={k1}, b={b}"
    return "neither k1=0.9,b=0.4 nor k1=1.2,b=0.75"


def _measure(engine: str, args: tuple, out) -> None:
    """Child process body: runs one engine and sends back its numbers with this process's memory."""
    numbers = globals()[engine](*args)
    numbers["rss_mib"], numbers["peak_mib"] = memory_mib()
    out.send(numbers)


def baseline_python_numpy() -> dict:
    return {}


def baseline_bm25s_import() -> dict:
    import bm25s  # noqa: F401 - measured: bm25s imports JAX when it is installed

    return {}


def topk_at_scale(n_docs: int, repeats: int = 2) -> list[tuple[int, int, float, float]]:
    """Per query: (terms, postings, bm25s numpy ms, ours ms) over `n_docs` documents.

    Document frequencies are those of a typical wiki-18 question ("who played paul walker's character in fast and
    furious": who, play, paul, walker, charact, fast, furiou), scaled from 21M passages to `n_docs`; measured for
    the whole question and for its three rarest terms (an entity-style query).
    """
    import bm25s

    from llds_jax.search.bm25 import top_k_postings

    rng = np.random.default_rng(0)
    dfs = [int(f * n_docs) for f in (0.07, 0.05, 0.015, 0.0025, 0.024, 0.005, 0.0002)]
    terms = [(np.sort(rng.choice(n_docs, df, replace=False)).astype(np.int32),
              rng.random(df, dtype=np.float32) + 0.1) for df in dfs]
    indptr = np.r_[0, np.cumsum(dfs)]
    indices, data = np.concatenate([t[0] for t in terms]), np.concatenate([t[1] for t in terms])
    accumulator = np.zeros(n_docs, np.float32)
    rows = []
    for query in (np.arange(len(dfs)), np.array([3, 5, 6])):
        def bm25s_numpy():
            scores = bm25s.BM25._compute_relevance_from_scores(data, indptr, indices, n_docs, query, np.float32)
            return bm25s.selection.topk(scores, TOP_K, backend="numpy")

        def ours():
            return top_k_postings(accumulator, [(*terms[t], 1) for t in query], TOP_K)

        assert sorted(bm25s_numpy()[1].tolist()) == sorted(ours()[0].tolist())
        timings = []
        for fn in (bm25s_numpy, ours):
            best = math.inf
            for _ in range(repeats):
                start = time.perf_counter()
                fn()
                best = min(best, time.perf_counter() - start)
            timings.append(best * 1000)
        rows.append((len(query), sum(dfs[t] for t in query), *timings))
    return rows


def measure_in_child(engine: str, *args) -> dict:
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_measure, args=(engine, args, send))
    child.start()
    numbers = receive.recv()
    child.join()
    return numbers


def async_api_qps(index_dir: str, queries: list[str], batch: int, workers: int) -> tuple[float, float]:
    """(single, batched) queries/s of `await Bm25Retriever.search(...)`."""
    from llds_jax.search.bm25 import Bm25Retriever

    async def run():
        retriever = Bm25Retriever(index_dir, workers=workers)
        result = []
        for size in (1, batch):
            start = time.perf_counter()
            for i in range(0, len(queries), size):
                await retriever.search(queries[i:i + size], TOP_K)
            result.append(len(queries) / (time.perf_counter() - start))
        await retriever.close()
        return tuple(result)

    return asyncio.run(run())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_throughput(index_dir: str, queries: list[str], clients: int, seconds: float,
                      batch: int) -> tuple[float, float]:
    """(requests/s with 1 query each, queries/s with `batch`-query requests) of our server, `clients` at once."""
    import aiohttp

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "llds_jax.search.server", "--port", str(port), "--set",
                               "backend=bm25", "--set", f"index_dir={index_dir}"], cwd=REPO_ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5):
                    break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("the search server did not start") from None
                time.sleep(0.2)

        async def load(size: int) -> float:
            done = 0
            async with aiohttp.ClientSession() as session:
                stop_at = time.monotonic() + seconds

                async def client(offset: int):
                    nonlocal done
                    i = offset
                    while time.monotonic() < stop_at:
                        body = {"queries": [queries[(i + j) % len(queries)] for j in range(size)], "topk": TOP_K}
                        async with session.post(f"{url}/retrieve", json=body) as response:
                            assert response.status == 200, await response.text()
                            await response.read()
                        done += 1
                        i += size * clients
                start = time.monotonic()
                await asyncio.gather(*(client(c * size) for c in range(clients)))
                return done / (time.monotonic() - start)

        return asyncio.run(load(1)), asyncio.run(load(batch)) * batch
    finally:
        server.terminate()
        server.wait(30)


HNSW_M, HNSW_EF_SEARCH = 64, 16  # Search-R1's e5_HNSW64.index; efSearch 16 is faiss's default
E5_BASE_SHAPE = {"hidden_size": 768, "num_layers": 12, "num_heads": 12, "intermediate_size": 3072,
                 "max_positions": 512}


def embed_passages_per_s(encoder: str, passages: list[str], batch: int) -> float:
    """Passages/s of index_builder's embedding: E5Embedder.embed_passages over groups of 4096 (after a warm-up that
    compiles the buckets these passages need)."""
    from llds_jax.search.e5 import E5Embedder

    embedder = E5Embedder(encoder, batch_size=batch)
    embedder.embed_passages(passages)  # compiles
    start = time.perf_counter()
    for i in range(0, len(passages), 4096):
        embedder.embed_passages(passages[i:i + 4096])
    return len(passages) / (time.perf_counter() - start)


def random_unit_rows(rows: int, dim: int, seed: int, chunk: int = 100_000):
    """Yields `rows` random float32 unit vectors of `dim` dimensions, in arrays of at most `chunk` rows."""
    rng = np.random.default_rng(seed)
    for start in range(0, rows, chunk):
        x = rng.standard_normal((min(chunk, rows - start), dim), dtype=np.float32)
        yield x / np.linalg.norm(x, axis=1, keepdims=True)


def dense_indexes(rows: int, dim: int) -> tuple:
    """(faiss Flat, faiss HNSW64, HNSW build seconds) over the same `rows` random unit vectors, inner product.

    HNSW64 is Search-R1's `e5_HNSW64.index`: `IndexHNSWFlat(dim, 64, METRIC_INNER_PRODUCT)`, efConstruction and
    efSearch at faiss's defaults (40 and 16)."""
    import faiss

    flat = faiss.IndexFlatIP(dim)
    hnsw = faiss.IndexHNSWFlat(dim, HNSW_M, faiss.METRIC_INNER_PRODUCT)
    hnsw.hnsw.efSearch = HNSW_EF_SEARCH
    build_s = 0.0
    for x in random_unit_rows(rows, dim, seed=0):
        flat.add(x)
        start = time.perf_counter()
        hnsw.add(x)
        build_s += time.perf_counter() - start
    return flat, hnsw, build_s


def search_seconds(index, query_qd: np.ndarray, batch: int) -> tuple[float, np.ndarray]:
    """(seconds, top-TOP_K row ids [queries, TOP_K]) of `index.search` over `query_qd` in batches of `batch`
    (after one warm-up batch)."""
    index.search(query_qd[:batch], TOP_K)
    ids, seconds = [], 0.0
    for i in range(0, len(query_qd), batch):
        start = time.perf_counter()
        ids.append(index.search(query_qd[i:i + batch], TOP_K)[1])
        seconds += time.perf_counter() - start
    return seconds, np.concatenate(ids)


def recall_at_k(found_qk: np.ndarray, exact_qk: np.ndarray) -> float:
    """Mean over queries of |found top-k ∩ exact top-k| / k (row ids; -1, faiss's "no result", never counts)."""
    return float(np.mean([len(set(f[f >= 0].tolist()) & set(e.tolist())) / exact_qk.shape[1]
                          for f, e in zip(found_qk, exact_qk)]))


def search_alone(flat, hnsw, query_qd: np.ndarray, batch: int) -> dict:
    """The search alone, Flat vs HNSW over the same rows and queries: per index {"qps": queries/s, "s_per_query":
    seconds}; Flat's "s_per_query_per_m_rows" (seconds per query per million rows: its cost is linear in the rows)
    and "wiki18_s_per_query" (that at wiki-18's rows); HNSW's "recall" (recall@TOP_K against Flat's exact top-k);
    "threads": faiss's OpenMP threads; "queries", "rows"."""
    import faiss

    numbers = {"threads": faiss.omp_get_max_threads(), "queries": len(query_qd), "rows": flat.ntotal}
    flat_s, exact_qk = search_seconds(flat, query_qd, batch)
    hnsw_s, hnsw_qk = search_seconds(hnsw, query_qd, batch)
    for name, seconds in (("flat", flat_s), ("hnsw", hnsw_s)):
        numbers[name] = {"qps": len(query_qd) / seconds, "s_per_query": seconds / len(query_qd)}
    numbers["hnsw"]["recall"] = recall_at_k(hnsw_qk, exact_qk)
    per_m = numbers["flat"]["s_per_query"] / (flat.ntotal / 1e6)
    numbers["flat"]["s_per_query_per_m_rows"] = per_m
    numbers["flat"]["wiki18_s_per_query"] = per_m * WIKI18_ROWS / 1e6
    return numbers


def print_search_alone(n: dict, batch: int, hnsw_build_s: float, query_kind: str) -> None:
    """Prints `search_alone`'s numbers: a header with the sizes and faiss's threads, one line per index, the
    caveats."""
    rows, dim = n["rows"], E5_BASE_SHAPE["hidden_size"]
    print(f"search alone ({n['queries']} {query_kind} in batches of {batch}, top-{TOP_K}, {rows:,} random unit rows"
          f" of {dim} floats, faiss threads {n['threads']} (omp_get_max_threads)):")
    flat, hnsw = n["flat"], n["hnsw"]
    print(f"faiss Flat search alone: {flat['qps']:,.0f} queries/s, {flat['s_per_query']:.3e} s/query,"
          f" {flat['s_per_query_per_m_rows']:.3e} s/query per million rows -> {flat['wiki18_s_per_query']:.3e}"
          f" s/query at wiki-18's {WIKI18_ROWS:,} rows ({WIKI18_ROWS * dim * 4 / 1e9:,.1f} GB of vectors)")
    print(f"faiss HNSW{HNSW_M} search alone (efSearch {HNSW_EF_SEARCH}): {hnsw['qps']:,.0f} queries/s,"
          f" {hnsw['s_per_query']:.3e} s/query, recall@{TOP_K} {hnsw['recall']:.3f} of Flat's exact top-{TOP_K}"
          f" (built in {hnsw_build_s:,.1f} s)")
    print("(random vectors are a hard case for HNSW: their nearest neighbours are barely nearer than any other"
          " row, so expect higher recall on real e5 embeddings, whose neighbours are clustered; its cost grows"
          " about with log(rows), not linearly, so it is not extrapolated)", flush=True)


def dense_query_qps(encoder: str, index, queries: list[str], batch: int) -> dict:
    """Queries/s of (our jit encoder | transformers BertModel) + one faiss search of `index`, in batches of
    `batch`; "query_qd": our encoder's query vectors [queries, dim] float32."""
    import torch
    from transformers import AutoTokenizer, BertModel

    from llds_jax.search.e5 import E5Embedder

    ours = E5Embedder(encoder, batch_size=batch)
    tokenizer, model = AutoTokenizer.from_pretrained(encoder), BertModel.from_pretrained(encoder).eval()

    def transformers_embed(texts: list[str]) -> np.ndarray:
        tokens = tokenizer(["query: " + t for t in texts], padding=True, truncation=True, max_length=256,
                           return_tensors="pt")
        with torch.no_grad():
            hidden = model(**tokens).last_hidden_state
        mask = tokens["attention_mask"][..., None].float()
        return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1).numpy()

    numbers = {}
    for name, embed in (("ours", ours.embed_queries), ("transformers", transformers_embed)):
        embed(queries[:batch])  # warm-up (compiles our buckets)
        encode_s = search_s = 0.0
        vectors = []
        for i in range(0, len(queries), batch):
            start = time.perf_counter()
            query_qd = embed(queries[i:i + batch])
            encode_s += time.perf_counter() - start
            start = time.perf_counter()
            index.search(query_qd, TOP_K)
            search_s += time.perf_counter() - start
            vectors.append(np.asarray(query_qd, np.float32))
        numbers[name] = (len(queries) / (encode_s + search_s), len(queries) / encode_s)
        if name == "ours":
            numbers["query_qd"] = np.concatenate(vectors)
    return numbers


def dense_index_memory(path: str, mmap: bool) -> dict:
    """Child process body: RSS after reading the faiss file `path` (memory-mapped or into memory)."""
    from llds_jax.search.dense import read_faiss_index

    before = memory_mib()[0]
    index = read_faiss_index(path, mmap=mmap)
    return {"loaded_mib": memory_mib()[0] - before, "rows": index.ntotal}


def write_flat_index(path: str, rows: int, dim: int) -> str:
    import faiss

    rng = np.random.default_rng(1)
    index = faiss.IndexFlatIP(dim)
    for start in range(0, rows, 100_000):
        index.add(rng.standard_normal((min(100_000, rows - start), dim), dtype=np.float32))
    faiss.write_index(index, path)
    return path


def search_only_section(args: argparse.Namespace) -> None:
    """Section 5's search measurements alone: Flat vs HNSW64 over `--dense-rows` random unit rows, searched with
    `--dense-queries` random unit vectors in batches of `--dense-batch` (no encoder)."""
    dim = E5_BASE_SHAPE["hidden_size"]
    print(f"\n5. dense retrieval, search only, {os.cpu_count()} CPUs, load average"
          f" {' '.join(load_average())}", flush=True)
    flat, hnsw, build_s = dense_indexes(args.dense_rows, dim)
    query_qd = np.concatenate(list(random_unit_rows(args.dense_queries, dim, seed=3)))
    print_search_alone(search_alone(flat, hnsw, query_qd, args.dense_batch), args.dense_batch, build_s,
                       "random unit query vectors")
    print(f"load average after: {' '.join(load_average())}")


def call_costs(args: argparse.Namespace) -> None:
    """Section 6 (`--calls`): faiss's per-call costs on one thread, then calls of 1, 8 and 64 on all threads."""
    import faiss

    dim = E5_BASE_SHAPE["hidden_size"]
    flat, hnsw, _ = dense_indexes(args.dense_rows, dim)
    query_qd = np.concatenate(list(random_unit_rows(max(args.blas_queries, 64), dim, seed=3)))
    mrows = flat.ntotal / 1e6
    threads = faiss.omp_get_max_threads()
    print(f"\n6. faiss per call, {flat.ntotal:,} random unit rows of {dim}, top-{TOP_K}, load average"
          f" {' '.join(load_average())}", flush=True)
    faiss.omp_set_num_threads(1)
    one_s = min(search_seconds(flat, query_qd[i:i + 1], 1)[0] for i in range(3))
    blas_s = search_seconds(flat, query_qd[:args.blas_queries], args.blas_queries)[0]
    hnsw_s = search_seconds(hnsw, query_qd[:64], 64)[0] / 64
    print(f"one thread: a 1-query call {one_s:.3f} s = {one_s / mrows:.4f} s per million rows (per-query path);"
          f" a {args.blas_queries}-query call {blas_s:.3f} s = {blas_s / args.blas_queries / mrows:.5f} s per query"
          f" per million rows (BLAS path); HNSW64 {hnsw_s * 1e3:.3f} ms per query")
    faiss.omp_set_num_threads(threads)
    for size in (1, 8, 64):
        seconds = search_seconds(flat, query_qd[:size], size)[0]
        print(f"{threads} threads: a call of {size} queries {seconds:.3f} s ({seconds / size * 1e3:.1f} ms per query)")
    print(f"load average after: {' '.join(load_average())}")


def device_vs_flat(args: argparse.Namespace) -> None:
    """Section 7 (`--device`): the e5_device search and faiss Flat over the same rows and queries, one process."""
    import faiss
    import jax

    from llds_jax.search.device_index import load
    from llds_jax.search.device_search import ExactSearcher

    dim = E5_BASE_SHAPE["hidden_size"]
    rows_nd = np.concatenate(list(random_unit_rows(args.dense_rows, dim, seed=0)))
    query_qd = np.concatenate(list(random_unit_rows(args.dense_queries, dim, seed=3)))
    flat = faiss.IndexFlatIP(dim)
    flat.add(rows_nd)
    print(f"\n7. e5_device vs faiss Flat, {args.dense_rows:,} random unit rows of {dim}, {len(query_qd)} queries in"
          f" calls of {args.dense_batch}, top-{TOP_K}; {len(jax.devices())} {jax.devices()[0].platform} devices,"
          f" faiss threads {faiss.omp_get_max_threads()}, load average {' '.join(load_average())}", flush=True)
    flat_s, flat_ids = search_seconds(flat, query_qd, args.dense_batch)
    for dtype in ("bfloat16", "int8"):
        start = time.perf_counter()
        index = load(rows_nd, jax.devices(), dtype=dtype)
        load_s = time.perf_counter() - start
        searcher = ExactSearcher(index, rows_nd, max_batch=args.dense_batch)
        searcher.search(query_qd[:args.dense_batch], TOP_K)  # compiles
        start = time.perf_counter()
        answers = [a for i in range(0, len(query_qd), args.dense_batch)
                   for a in searcher.search(query_qd[i:i + args.dense_batch], TOP_K)]
        device_s = time.perf_counter() - start
        same = all(a.ids.tolist() == f.tolist() for a, f in zip(answers, flat_ids))
        print(f"e5_device {dtype}: {len(query_qd) / device_s:,.1f} queries/s vs faiss Flat"
              f" {len(query_qd) / flat_s:,.1f}: {flat_s / device_s:.2f}x; top-{TOP_K} ids equal to Flat's: {same};"
              f" device calls by candidates {searcher.passes}, host scans {searcher.host_scans}; loaded in"
              f" {load_s:.1f} s", flush=True)


def e5_recall(args: argparse.Namespace, work: str) -> None:
    """Section 8 (`--e5-recall`): HNSW64's recall@3 against Flat on the demo world's e5 passage vectors."""
    import faiss

    from llds_jax.data import synthetic
    from llds_jax.search.e5 import E5Embedder
    from llds_jax.search.synthetic import write_random_bert

    from llds_jax.apps.demo import E5_MAX_LENGTH

    encoder = args.encoder
    if not encoder:
        encoder = os.path.join(work, "demo_e5")
        if not os.path.isdir(encoder):
            write_random_bert(encoder, max_positions=E5_MAX_LENGTH)
    world = synthetic.make_world(num_people=args.world_people, seed=0)
    embedder = E5Embedder(encoder, batch_size=args.dense_batch, max_length=E5_MAX_LENGTH)
    passage_nd = embedder.embed_passages([p["contents"] for p in world.passages])
    query_qd = embedder.embed_queries([ex.question for ex in world.train + world.test])
    flat = faiss.IndexFlatIP(passage_nd.shape[1])
    hnsw = faiss.IndexHNSWFlat(passage_nd.shape[1], HNSW_M, faiss.METRIC_INNER_PRODUCT)
    hnsw.hnsw.efSearch = HNSW_EF_SEARCH
    flat.add(passage_nd)
    hnsw.add(passage_nd)
    recall = recall_at_k(hnsw.search(query_qd, TOP_K)[1], flat.search(query_qd, TOP_K)[1])
    print(f"\n8. HNSW{HNSW_M} (efSearch {HNSW_EF_SEARCH}) recall@{TOP_K} against Flat on e5 vectors of the demo world"
          f" ({len(passage_nd):,} passages, {len(query_qd):,} questions, encoder {encoder}): {recall:.3f}")


def second_pass(args: argparse.Namespace, work: str) -> None:
    """Section 9 (`--second-pass`): the share of the demo world's search queries the e5_device searcher proves at
    its first pass, its second, and later."""
    import jax

    from llds_jax.apps.demo import E5_MAX_LENGTH
    from llds_jax.data import synthetic
    from llds_jax.search.device_index import load
    from llds_jax.search.device_search import ExactSearcher
    from llds_jax.search.e5 import E5Embedder
    from llds_jax.search.synthetic import write_random_bert

    encoder = args.encoder
    if not encoder:
        encoder = os.path.join(work, "demo_e5")
        if not os.path.isdir(encoder):
            write_random_bert(encoder, max_positions=E5_MAX_LENGTH, seed=0)  # the demo's, seed 0
    world = synthetic.make_world(num_people=args.world_people, seed=0)
    embedder = E5Embedder(encoder, max_length=E5_MAX_LENGTH)
    passage_nd = embedder.embed_passages([p["contents"] for p in world.passages])
    queries = [query for ex in world.train + world.test for query in world.hops[ex.question]]
    query_qd = embedder.embed_queries(queries)
    searcher = ExactSearcher(load(passage_nd, jax.devices()), passage_nd)
    passes_q = []
    for query_d in query_qd:  # one query per search: the passes it took
        before = sum(searcher.passes.values())
        searcher.search(query_d[None, :], TOP_K)
        passes_q.append(sum(searcher.passes.values()) - before)
    counts = np.bincount(passes_q)
    shares = ", ".join(f"{n} pass{'es' * (n > 1)}: {c:,} ({c / len(passes_q):.2%})"
                       for n, c in enumerate(counts) if c)
    print(f"\n9. e5_device second passes: {len(passage_nd):,} passages of the demo world ({args.world_people} people) "
          f"x {passage_nd.shape[1]} (encoder {encoder}), {len(queries):,} search queries (the demonstrator's, every "
          f"hop of {len(world.train) + len(world.test):,} questions), top-{TOP_K}, {searcher.candidates} candidates "
          f"first; {len(jax.devices())} {jax.devices()[0].platform} devices")
    print(f"queries by device passes: {shares}; host scans {searcher.host_scans}; second-pass rate "
          f"{1 - counts[1] / len(passes_q):.4f}")


def load_average() -> list[str]:
    """The 1, 5 and 15 minute load averages, from /proc/loadavg."""
    with open("/proc/loadavg") as f:
        return f.read().split()[:3]


def dense_section(args: argparse.Namespace, work: str) -> None:
    from llds_jax.search.synthetic import write_random_bert

    encoder = os.path.join(work, "e5_base_shape")
    if not os.path.isdir(encoder):
        write_random_bert(encoder, **E5_BASE_SHAPE, std=0.02)
    corpus = SyntheticCorpus(args.dense_docs, seed=2, n_planted=1, vocab_size=50_000, words_per_doc=(90, 110))
    passages = [r["contents"] for r in corpus.records()]
    queries = corpus.random_queries(args.dense_queries, seed=3)
    print(f"\n5. dense retrieval, e5-base-v2's shape (random weights), {os.cpu_count()} CPUs, jax on"
          f" {__import__('jax').devices()[0].platform}", flush=True)
    rate = embed_passages_per_s(encoder, passages, args.dense_batch)
    print(f"index build embedding ({args.dense_docs:,} passages of 90-110 words, batches of {args.dense_batch}):"
          f" {rate:,.1f} passages/s -> {21_000_000 / rate / 3600:,.1f} h for wiki-18's 21M passages", flush=True)
    flat_index, hnsw_index, hnsw_build_s = dense_indexes(args.dense_rows, E5_BASE_SHAPE["hidden_size"])
    n = dense_query_qps(encoder, flat_index, queries, args.dense_batch)
    print(f"queries ({len(queries)} in batches of {args.dense_batch}, faiss Flat over {args.dense_rows:,} rows,"
          f" top-{TOP_K}):")
    print(f"{'encoder':<38} {'q/s end to end':>15} {'q/s encoding':>13}")
    for name, label in (("ours", "ours: Flax BERT under jit, bucketed"), ("transformers", "transformers BertModel"
                                                                                              " (PyTorch)")):
        print(f"{label:<38} {n[name][0]:>15,.1f} {n[name][1]:>13,.1f}")
    print_search_alone(search_alone(flat_index, hnsw_index, n["query_qd"], args.dense_batch), args.dense_batch,
                       hnsw_build_s, "queries (our encoder's vectors)")
    del flat_index, hnsw_index
    flat = write_flat_index(os.path.join(work, "flat.index"), args.dense_rows, E5_BASE_SHAPE["hidden_size"])
    size = os.path.getsize(flat) / 2**20
    mapped, loaded = (measure_in_child("dense_index_memory", flat, m) for m in (True, False))
    print(f"index load ({size:,.0f} MiB Flat file): memory-mapped +{mapped['loaded_mib']:,.0f} MiB RSS,"
          f" read into memory +{loaded['loaded_mib']:,.0f} MiB RSS")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n-docs", type=int, default=100_000, help="passages to generate (default 100000)")
    parser.add_argument("--queries", type=int, default=1000, help="queries per measurement (default 1000)")
    parser.add_argument("--batch", type=int, default=64, help="queries per batched call (default 64)")
    parser.add_argument("--clients", type=int, default=16, help="concurrent server clients (default 16)")
    parser.add_argument("--seconds", type=float, default=10.0, help="seconds per server measurement (default 10)")
    parser.add_argument("--workers", type=int, default=2, help="search threads of the async retriever (default 2)")
    parser.add_argument("--scale-docs", type=int, default=21_000_000,
                        help="documents of the query evaluation measurement (default 21000000; 0 skips it)")
    parser.add_argument("--work-dir", help="where to write corpus and indexes (default: a temporary folder)")
    parser.add_argument("--dense-only", action="store_true", help="only section 5 (dense retrieval)")
    parser.add_argument("--search-only", action="store_true",
                        help="only section 5's search alone (faiss Flat vs HNSW64 on random query vectors, no"
                             " encoder): --dense-rows, --dense-queries, --dense-batch")
    parser.add_argument("--dense-docs", type=int, default=2048, help="passages embedded in section 5 (default 2048)")
    parser.add_argument("--dense-queries", type=int, default=1024, help="queries of section 5 (default 1024)")
    parser.add_argument("--dense-batch", type=int, default=256, help="texts per encoder call (default 256)")
    parser.add_argument("--dense-rows", type=int, default=500_000,
                        help="rows of section 5's faiss Flat index of random vectors (default 500000)")
    parser.add_argument("--calls", action="store_true", help="only section 6 (faiss per call)")
    parser.add_argument("--blas-queries", type=int, default=256, help="queries of section 6's BLAS call")
    parser.add_argument("--device", action="store_true", help="only section 7 (e5_device vs faiss Flat)")
    parser.add_argument("--e5-recall", action="store_true", help="only section 8 (HNSW64 recall on e5 vectors)")
    parser.add_argument("--encoder", default="", help="section 8's e5 folder (default: a random e5-base shape)")
    parser.add_argument("--world-people", type=int, default=None,
                        help="people of sections 8 and 9's demo world (passages: 1.25 per person; default 20000 "
                             "for section 8, the demo's 400 for section 9)")
    parser.add_argument("--second-pass", action="store_true", help="only section 9 (e5_device second-pass rate)")
    args = parser.parse_args(argv)
    if args.calls:
        call_costs(args)
        return
    if args.device:
        device_vs_flat(args)
        return
    if args.second_pass:
        args.world_people = args.world_people or 400
        second_pass(args, args.work_dir or tempfile.mkdtemp(prefix="llds_bench_"))
        return
    args.world_people = args.world_people or 20_000
    if args.e5_recall:
        e5_recall(args, args.work_dir or tempfile.mkdtemp(prefix="llds_bench_"))
        return
    if args.search_only:
        search_only_section(args)
        return
    work = args.work_dir or tempfile.mkdtemp(prefix="llds_bench_")
    os.makedirs(work, exist_ok=True)
    if args.dense_only:
        dense_section(args, work)
        return
    print(f"corpus: {args.n_docs:,} generated passages of 90-110 words; top-{TOP_K}; work dir {work}; "
          f"{os.cpu_count()} CPUs", flush=True)
    corpus = SyntheticCorpus(args.n_docs, seed=0, n_planted=10, vocab_size=50_000, words_per_doc=(90, 110))
    corpus_path = corpus.write(os.path.join(work, "corpus.jsonl"))
    queries = corpus.random_queries(args.queries)
    planted = corpus.planted

    print("\n1. engines (each in its own process)", flush=True)
    print(f"{'engine':<44} {'build s':>8} {'q/s single':>11} {f'q/s x{args.batch}':>9} {'RSS MiB':>8} "
          f"{'peak MiB':>9} {'planted@1':>9}")
    engines = [("engine_ours", "ours: streaming build -> bm25s format, mmap"),
               ("engine_bm25s_in_memory", "bm25s in-memory BM25.index (whole corpus)"),
               ("engine_tantivy", "tantivy 0.27 writer (1 thread, 256 MB heap)")]
    for engine, label in engines:
        n = measure_in_child(engine, corpus_path, work, queries, planted, args.batch)
        print(f"{label:<44} {n['build_s']:>8.1f} {n['single_qps']:>11,.0f} {n['batched_qps']:>9,.0f} "
              f"{n['rss_mib']:>8,.0f} {n['peak_mib']:>9,.0f} {n['planted_top1']:>6}/{len(planted)}", flush=True)
    print(f"tantivy BM25 scores follow {tantivy_bm25_parameters()} (not configurable)")
    base = measure_in_child("baseline_python_numpy")["rss_mib"]
    with_bm25s = measure_in_child("baseline_bm25s_import")["rss_mib"]
    print(f"RSS of a process with only python+numpy: {base:,.0f} MiB; after `import bm25s` (which imports JAX):"
          f" {with_bm25s:,.0f} MiB")

    index_dir = os.path.join(work, "ours")
    single, batched = async_api_qps(index_dir, queries, args.batch, args.workers)
    print(f"\n2. embedded retriever, await search(...), {args.workers} worker threads: "
          f"{single:,.0f} queries/s single, {batched:,.0f} queries/s in batches of {args.batch}", flush=True)

    requests_s, queries_s = server_throughput(index_dir, queries, args.clients, args.seconds, args.batch)
    print(f"\n3. server (bm25 backend), {args.clients} concurrent clients: {requests_s:,.0f} requests/s with 1 query"
          f" each; {queries_s:,.0f} queries/s with {args.batch}-query requests", flush=True)

    if args.scale_docs:
        print(f"\n4. query evaluation over {args.scale_docs:,} documents, ms per query (best of 2)")
        for terms, postings, dense_ms, ours_ms in topk_at_scale(args.scale_docs):
            print(f"{terms}-term query, {postings:,} postings: bm25s numpy path {dense_ms:,.0f} ms,"
                  f" ours (top_k_postings) {ours_ms:,.0f} ms")
    dense_section(args, work)


if __name__ == "__main__":
    main()
