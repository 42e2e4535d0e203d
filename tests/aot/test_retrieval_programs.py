"""The retriever's programs `--mode=compile` compiles are those a run's retriever runs: the e5_device search at every
(queries, candidates) pair and the e5 query encoder at every (batch, length) bucket its calls can reach.

The run-time side is the real retriever (`make_retriever`, backend e5_device) on this machine's 8 CPU devices,
checked as a run checks it and then called with every number of queries up to a call's most, short and long; its
index makes every query need every pass (all rows equal: no top-k is ever proven, so each query is searched at each
candidate count and then scanned on the host). The compile side is what `compile_check` lowers for the same
retriever config.
"""
import asyncio
import json

import faiss
import jax
import numpy as np
import pytest

from llds_jax import config as config_lib
from llds_jax.aot import retriever_programs
from llds_jax.errors import InputError
from llds_jax.search import make_retriever
from llds_jax.search.device_search import batch_bucket, candidate_counts
from llds_jax.search.e5 import batch_shape
from llds_jax.search.synthetic import write_random_bert
from tests.configs import load

ROWS = 2000
TOP_K = 3
MAX_QUERIES = 20  # the sequences in flight: a call's most searches
SHORT, LONG = "who wrote it", " ".join(["which city was the author of the long novel born in"] * 4)


@pytest.mark.parametrize("k, rows, candidates, max_candidates, expected", [
    (3, 21_015_324, 32, 4096, (32, 128, 512, 2048)),  # the paper configs: then the host's scan
    (1, 21_015_324, 32, 4096, (32, 128, 512, 2048)),  # the start-up check's top 1
    (3, ROWS, 2, 600, (3, 12, 48, 192)),  # k above the candidates
    (1, ROWS, 2, 600, (2, 8, 32, 128, 512)),
    (3, 100, 32, 4096, (32, 100)),  # every row a candidate proves every query
    (10, 1000, 4, 8, (10,)),  # k above max_candidates: one pass
    (3, 1000, 64, 32, ()),  # candidates above max_candidates: the host's scan at once
])
def test_candidate_counts_of_a_searchs_passes(k, rows, candidates, max_candidates, expected):
    assert candidate_counts(k, rows, candidates=candidates, max_candidates=max_candidates) == expected


@pytest.mark.parametrize("queries, max_batch, expected", [(1, 64, 8), (8, 64, 8), (9, 64, 16), (33, 64, 64),
                                                          (64, 64, 64), (20, 48, 32), (40, 48, 48), (3, 4, 4)])
def test_batch_bucket(queries, max_batch, expected):
    assert batch_bucket(queries, max_batch) == expected


def test_encoder_batch_shape():
    assert batch_shape(3, 40, batch_size=16, max_length=64) == (8, 64)
    assert batch_shape(9, 5, batch_size=16, max_length=64) == (16, 32)
    assert batch_shape(2, 70, batch_size=4, max_length=100, length_bucket=32, min_batch=8) == (4, 96)


@pytest.fixture(scope="module")
def tied_index(tmp_path_factory):
    """(index file, corpus file, e5 folder): a tiny random e5 encoder (hidden 32) and a Flat file of ROWS equal
    unit rows of 32 with its corpus."""
    folder = tmp_path_factory.mktemp("tied")
    encoder = write_random_bert(str(folder / "e5"))
    row = np.random.default_rng(3).standard_normal(32).astype(np.float32)
    index = faiss.IndexFlatIP(32)
    index.add(np.tile(row / np.linalg.norm(row), (ROWS, 1)))
    faiss.write_index(index, str(folder / "e5_Flat.index"))
    with open(folder / "corpus.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"id": str(i), "contents": f"passage {i}"}) + "\n" for i in range(ROWS))
    return str(folder / "e5_Flat.index"), str(folder / "corpus.jsonl"), encoder


def retriever_config(tied_index):
    index_path, corpus_path, encoder = tied_index
    return {"backend": "e5_device", "index_path": index_path, "corpus_path": corpus_path, "encoder_path": encoder,
            "vector_dtype": "bfloat16", "candidates": 2, "max_candidates": 600, "search_batch": 16,
            "max_length": 64, "encoder_batch_size": 16}


def reached_shapes(cfg):
    """((queries, candidates) of every search program, (batch, tokens) of every encoder program) the retriever of
    `cfg` ran: checked, then called with 1 to MAX_QUERIES short queries and as many long ones, top TOP_K."""
    retriever = make_retriever(cfg)

    async def run():
        try:
            await retriever.check()
            for n in range(1, MAX_QUERIES + 1):
                for text in (SHORT, LONG):
                    results = await retriever.search([f"{text} {i}" for i in range(n)], TOP_K)
                    assert [[d.id for d in r.docs] for r in results] == [["2", "1", "0"]] * n  # faiss's order
        finally:
            await retriever.close()

    asyncio.run(run())
    assert retriever.searcher.host_scans == 1 + 2 * sum(range(1, MAX_QUERIES + 1))  # every query past every pass
    return retriever.searcher.shapes_compiled, retriever.embedder.shapes_compiled


def lowered_shapes(cfg):
    """The same shapes read off the programs `compile_check` lowers for a run of `cfg` over this process's
    devices: a search program's queries and candidates from its arguments and outputs, an encoder program's batch
    and tokens from its token ids."""
    run_cfg = load("qwen7b_v4", "e5_device")
    run_cfg.retriever, run_cfg.rollout.retrieval_top_k = cfg, TOP_K
    run = config_lib.typed(run_cfg)
    devices = jax.local_devices()
    search = retriever_programs.search_programs(run, devices, MAX_QUERIES, MAX_QUERIES, ())
    encoder = retriever_programs.encoder_programs(run.retriever, devices[0], MAX_QUERIES, ())
    return ({(p.lowered.args_info[0][2].shape[0], p.lowered.out_info[0].shape[1]) for p in search},
            {p.lowered.args_info[0][1].shape for p in encoder})


def test_compile_mode_lowers_every_program_the_retriever_reaches_and_no_other(tied_index):
    """With 2 candidates, at most 600, top 3 over 2,000 rows and device calls of at most 16 queries: the calls'
    passes at 3, 12, 48 and 192 candidates, in batches of 8 and 16, and the check's one query for its top 1 at 2,
    8, 32, 128 and 512 (13 search programs); the encoder at 8 and 16 texts of 32 and 64 tokens (4)."""
    cfg = retriever_config(tied_index)
    search, encoder = reached_shapes(cfg)
    assert search == ({(b, m) for b in (8, 16) for m in (3, 12, 48, 192)} | {(8, m) for m in (2, 8, 32, 128, 512)})
    assert encoder == {(b, t) for b in (8, 16) for t in (32, 64)}
    assert lowered_shapes(cfg) == (search, encoder)


def test_a_max_length_past_the_encoders_positions_is_one_line(tmp_path):
    """As the embedder refuses it at run time, compile mode names the encoder's positions and its config.json."""
    bert = {"model_type": "bert", "vocab_size": 100, "hidden_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 4, "intermediate_size": 48, "max_position_embeddings": 128}
    (tmp_path / "config.json").write_text(json.dumps(bert))
    run_cfg = load("qwen7b_v4", "e5")
    run_cfg.retriever.encoder_path = str(tmp_path)  # retriever.max_length: 256 by default
    retriever = config_lib.typed(run_cfg).retriever
    with pytest.raises(InputError) as e:
        retriever_programs.encoder_programs(retriever, jax.local_devices()[0], MAX_QUERIES, ())
    assert str(e.value) == (f"max_length 256 exceeds the encoder's 128 positions ({tmp_path}/config.json "
                            "max_position_embeddings)")
