"""Self-contained assets for a run on one machine: a generated search world, its embedded BM25 index, the offline
Qwen2.5 tokenizer and a small random Qwen2-architecture policy saved as a Hugging Face folder.

`prepare(cfg)` builds what a config's `demo` section asks for under `<run_dir>/assets` (once; later runs reuse it)
and points the config's model, data and retriever keys at it.
"""
from __future__ import annotations

import logging
import os
import shutil

import ml_collections
from flax import nnx

from index_builder.corpus import CorpusReader
from index_builder.to_bm25 import build_bm25
from llds_jax.data import synthetic
from llds_jax.model import ModelConfig, Transformer, hf_io
from llds_jax.tokenizer import write_qwen25_tokenizer

log = logging.getLogger(__name__)
QWEN25_VOCAB_ROWS = 151936  # embedding rows of Qwen2.5 checkpoints (the tokenizer has 151665 ids)


def build_assets(out_dir: str, *, num_people: int, seed: int, hidden_size: int, num_layers: int,
                 num_heads: int, num_kv_heads: int, intermediate_size: int) -> dict[str, str]:
    """Writes world files, index, tokenizer and a random model under `out_dir`; returns their paths."""
    done = os.path.join(out_dir, "COMPLETE")
    paths = {"model": os.path.join(out_dir, "model"), "index": os.path.join(out_dir, "index"),
             "train": os.path.join(out_dir, "world", "train.parquet"),
             "test": os.path.join(out_dir, "world", "test.parquet")}
    if os.path.exists(done):
        return paths
    shutil.rmtree(out_dir, ignore_errors=True)
    world = synthetic.make_world(num_people=num_people, seed=seed)
    files = synthetic.write_world(world, os.path.join(out_dir, "world"))
    build_bm25(CorpusReader(files["corpus.jsonl"]), paths["index"])
    cfg = ModelConfig(vocab_size=QWEN25_VOCAB_ROWS, hidden_size=hidden_size, intermediate_size=intermediate_size,
                      num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
                      head_dim=hidden_size // num_heads, rope_theta=1_000_000.0, qkv_bias=True,
                      tie_word_embeddings=True)
    hf_io.save_model(Transformer(cfg, rngs=nnx.Rngs(seed)), paths["model"])
    write_qwen25_tokenizer(paths["model"], "base")
    with open(done, "w") as f:
        f.write("ok\n")
    log.info("demo assets written to %s", out_dir)
    return paths


def assets_for(cfg: ml_collections.ConfigDict, out_dir: str) -> dict[str, str]:
    """`build_assets` at the sizes of `cfg.demo` and the run's seed."""
    d = cfg.demo
    return build_assets(out_dir, num_people=d.num_people, seed=cfg.seed, hidden_size=d.hidden_size,
                        num_layers=d.num_layers, num_heads=d.num_heads, num_kv_heads=d.num_kv_heads,
                        intermediate_size=d.intermediate_size)


def prepare(cfg: ml_collections.ConfigDict) -> None:
    """When `cfg.demo.enabled`: builds the assets (if missing) and points model/data/retriever at them."""
    if not cfg.demo.enabled:
        return
    paths = assets_for(cfg, os.path.join(cfg.run_dir, "assets"))
    cfg.model.path = paths["model"]
    cfg.data.train_files = [paths["train"]]
    cfg.data.eval_files = [paths["test"]]
    cfg.retriever = ml_collections.ConfigDict({"backend": "bm25", "index_dir": paths["index"]})
