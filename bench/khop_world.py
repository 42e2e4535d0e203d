"""The k-hop world's build (`llds_jax.data.khop.make_khop_world`) vs today's single-/two-hop world
(`llds_jax.data.synthetic.make_world`) at the same number of people, side by side in one process: seconds per build
(the median of --repeats), and the demonstrator's transcripts of every training question searched over the world's
BM25 index (what a demo's assets build: `synthetic.demonstrations` at search_fraction 1, top 3), with the questions,
passages and searches of each.

    python bench/khop_world.py [--people 200 400 4000] [--repeats 5]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time

from index_builder.corpus import CorpusReader
from index_builder.to_bm25 import build_bm25
from llds_jax.data import khop, synthetic
from llds_jax.search.bm25 import Bm25Retriever


def median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def demonstrations_seconds(world, folder: str) -> tuple[float, int]:
    """Seconds of the demonstrator's transcripts of every training question over the world's BM25 index (the
    index's build not counted), and the searches made."""
    files = synthetic.write_world(world, folder)
    build_bm25(CorpusReader(files["corpus.jsonl"]), os.path.join(folder, "index"))
    retriever = Bm25Retriever(os.path.join(folder, "index"), workers=1)
    searches = []

    def search(queries):
        searches.extend(queries)
        return [[doc.contents for doc in result.docs] for result in retriever.search_blocking(queries, 3)]
    try:
        start = time.perf_counter()
        synthetic.demonstrations(world, world.train, search, search_fraction=1.0)
        return time.perf_counter() - start, len(searches)
    finally:
        asyncio.run(retriever.close())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--people", type=int, nargs="+", default=[200, 400, 4000])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    builders = {"k-hop": khop.make_khop_world, "today": synthetic.make_world}
    for people in args.people:
        row = []
        for name, build in builders.items():
            seconds = median_seconds(lambda: build(num_people=people, seed=0), args.repeats)
            world = build(num_people=people, seed=0)
            with tempfile.TemporaryDirectory() as folder:
                demo_s, searches = demonstrations_seconds(world, folder)
            row.append(seconds)
            print(f"{people:6d} people, {name:5s}: build {seconds * 1e3:8.1f} ms, demonstrations {demo_s:6.2f} s "
                  f"({searches} searches); {len(world.passages)} passages, {len(world.train)} train / "
                  f"{len(world.test)} test questions")
        print(f"{people:6d} people: k-hop / today build time {row[0] / row[1]:.2f}x")


if __name__ == "__main__":
    main()
