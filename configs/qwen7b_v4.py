"""Qwen2.5-7B-Base, GRPO + LLDS (lambda 0.2, action gate), the paper's setup, on a TPU v4-32 slice (16 chips,
32 GiB HBM each, 4 hosts), with the paper's retriever: e5-base-v2 over wiki-18, Search-R1's exact Flat inner-product
index, top 3 (docs/retrieval.md, "Which retriever the paper used"), searched on the run's own chips.

Retrievers (`--config=configs/qwen7b_v4.py:NAME`, default e5_device; the other paper configs take the same names):
- e5_device: the paper's exact Flat search on the chips (`backend = "e5_device"`, docs/retrieval.md): Search-R1's
  `e5_Flat.index` and `wiki-18.jsonl` on each host's local disk; each host holds the index's rows in int8 over its
  own 4 chips and re-ranks the candidates from the memory-mapped float32 rows, so its top 3 are faiss's.
- e5: the same index searched by faiss on the host's CPUs (read in process, memory-mapped; queries embedded on the
  host's first TPU chip): no HBM, but a scan of every row per query (docs/tpu.md, "The step at expected lengths").
- e5_hnsw: Search-R1's `e5_HNSW64.index` on the host: far less CPU per query, approximate (a little recall lost).
- e5_es: e5 kNN through Elasticsearch (`index_builder --to elasticsearch --encoder e5`).
- bm25_es: BM25 through Elasticsearch (not the paper's retriever: EM and search behaviour differ from its tables).
- bm25: the embedded BM25 index (`index_builder --to bm25`), same caveat.

Each host samples its own sequences on its own 4 chips, the rollout copy split over them by heads and MLP width.
Memory per chip, the largest program and the estimated step time on this slice, as `--mode=compile` prints them:
docs/tpu.md ("The step at expected lengths: the paged engine", its table of every paper config).
"""
import ml_collections

from llds_jax.config import default_config


WIKI18 = "/data/wiki18"  # Search-R1's download: e5_Flat.index, e5_HNSW64.index, wiki-18.jsonl (gunzipped)
E5 = "gs://YOUR_BUCKET/models/e5-base-v2"  # a copy of intfloat/e5-base-v2 (safetensors + tokenizer files)
ES_HOSTS = "https://YOUR_ES_HOST:9200"
RETRIEVERS = {
    "e5": {"backend": "faiss", "index_path": f"{WIKI18}/e5_Flat.index", "corpus_path": f"{WIKI18}/wiki-18.jsonl",
           "encoder_path": E5},
    "e5_hnsw": {"backend": "faiss", "index_path": f"{WIKI18}/e5_HNSW64.index",
                "corpus_path": f"{WIKI18}/wiki-18.jsonl", "encoder_path": E5},
    "e5_device": {"backend": "e5_device", "index_path": f"{WIKI18}/e5_Flat.index",
                  "corpus_path": f"{WIKI18}/wiki-18.jsonl", "encoder_path": E5, "vector_dtype": "int8",
                  "candidates": 32, "search_batch": 64},
    "e5_es": {"backend": "elasticsearch", "hosts": ES_HOSTS, "index": "wiki18_e5", "encoder_path": E5},
    "bm25_es": {"backend": "elasticsearch", "hosts": ES_HOSTS, "index": "wiki18"},
    "bm25": {"backend": "bm25", "index_dir": f"{WIKI18}/bm25"},
}


def retriever(name: str):
    """The retriever config named `name` (a key of RETRIEVERS)."""
    if name not in RETRIEVERS:
        raise ValueError(f"retriever {name!r} is not one of {', '.join(RETRIEVERS)} (--config=CONFIG.py:NAME)")
    return ml_collections.ConfigDict(RETRIEVERS[name])


def get_config(retriever_name: str = "e5_device"):
    c = default_config()
    c.run_dir = "gs://YOUR_BUCKET/runs/qwen7b_base_llds"
    c.model.path = "gs://YOUR_BUCKET/models/Qwen2.5-7B"
    c.model.chat_template = "base"
    c.model.preset = "qwen2.5-7b"
    c.mesh.topology = "v4:2x2x4"
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, -1, 1
    c.data.train_files = ["gs://YOUR_BUCKET/data/nq_hotpotqa_train/train.parquet"]
    c.data.eval_files = ["gs://YOUR_BUCKET/data/nq_hotpotqa_train/test.parquet"]
    c.retriever = retriever(retriever_name)
    # Rows in flight as a memory budget (python -m llds_jax.aot.slots configs/qwen7b_v4.py --largest_gib 24.97,
    # docs/tpu.md "Slots as a memory budget"): 256 rows per host admitted by the pages they hold, steps of up to 4096
    # tokens; the pool 10,752 pages (9.19 GiB per chip; 256 x 64 + 1 at every slot's worst case would not fit: a
    # sequence short of a page is preempted and re-encoded), what --mode=compile leaves to the weight reshard beside
    # it at >= 10% headroom (slots' 11,352 left it 8.7%).
    c.rollout.max_batch_size = 256
    c.rollout.num_pages = 10752
    c.rollout.continuous_batching = True  # a freed row takes the next conversation (the `continuous` policy)
    c.rollout.page_size = 64            # the paged KV cache in pages of 64 slots
    c.rollout.max_step_tokens = 4096    # step programs at 256 to 4096 tokens (10 with evaluation's; docs/tpu.md)
    # The attention kernel's tiles (python -m llds_jax.aot.tiles configs/qwen7b_v4.py, docs/tpu.md): kv blocks of 16
    # pages (1,024 slots) x q blocks of 32 tokens in the ragged forwards, 8 pages x 8 queries in decode.
    c.rollout.kv_pages_per_block, c.rollout.queries_per_block = 16, 32
    c.rollout.decode_kv_pages_per_block, c.rollout.decode_queries_per_block = 8, 8
    c.rollout.decode_chunk = 8          # samples per call: observations wait for calls of 1024 tokens (docs/tpu.md)
    c.rollout.params_dtype = "bfloat16"  # each host's rollout copy of the params: half of the float32 one
    c.rollout.tensor_parallel = -1      # the rollout copy split over a host's 4 chips: no weight gathers in decode
    c.model.mlp_chunks = 4              # the MLP 4736 features at a time: the update's temporaries 8.15 -> 7.07 GiB
    return c
