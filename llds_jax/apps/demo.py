"""Self-contained assets for a run on one machine: a generated search world (single- and two-hop questions, or
with `demo.world = "khop"` k-hop ones, k = 1..6, llds_jax.data.khop), its embedded BM25 index (and with
`demo.retriever = "e5_device"` its e5 Flat index, searched on the devices), a tokenizer,
a small random Qwen2-architecture policy saved as a Hugging Face folder, and demonstrations for its warm start.

The tokenizer is the offline Qwen2.5 one (`demo.tokenizer = "qwen2.5"`, 151,936 embedding rows as in the real
checkpoints) or a byte-level BPE trained on the world (`"world"`, `demo.vocab_size` entries): with a 64-256 wide
policy the output layer over Qwen2.5's vocabulary costs more than the rest of the model, which is what keeps a
CPU demo slow; the world's vocabulary is closed, so a BPE of under 1k entries covers it with whole-word tokens.

`prepare(cfg)` builds what a config's `demo` section asks for under `demo.assets_dir` (a local folder; default
`<run_dir>/assets`, which a gs:// run_dir cannot give; rebuilt only when the settings change) and points the
config's model, data, retriever and (with `sft.enabled` and no files of its own) sft.data_files keys at it; with
`sft.curriculum_steps`, the curriculum draws from demonstrations that search on every question.

An application on top of the library (llds_jax.application): a run config joins it with `app = "llds_jax.apps.demo"`
and a `demo` section (llds_jax.apps.demo_config, which also checks it); the launch command calls `prepare_run(cfg)`:
with `demo.enabled`, `prepare` on every process of the run, process 0 first.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
from typing import TYPE_CHECKING, Any

import ml_collections

from llds_jax.runtime import gcs, output_folder
from llds_jax.apps.demo_config import (  # noqa: F401  (the application protocol, llds_jax.application)
    DEMO_TOKENIZERS, check_config, config_sections, paths, provided_keys)
from llds_jax.config import ConfigError

if TYPE_CHECKING:
    from llds_jax.data import synthetic

# JAX, flax and the index builders are imported by the functions that build the assets, not here: the launch
# command loads this module to check a config (llds_jax.application) before anything heavy is imported.

log = logging.getLogger(__name__)
QWEN25_VOCAB_ROWS = 151936  # embedding rows of Qwen2.5 checkpoints (the tokenizer has 151665 ids)
_VOCAB_MULTIPLE = 128  # embedding rows of a trained tokenizer are padded to a multiple of this
ASSETS_VERSION = 7     # part of the recorded spec: assets built by older code are refused, never built over
E5_MAX_LENGTH = 128    # tokens per text of the demo's e5 index (the random BERT's positions)
# What build_assets writes (and COMPLETE, last); the indexes are built in a `.partial` folder first.
_BUILT_ENTRIES = ("world", "index", "index.partial", "e5_index", "e5_index.partial", "e5", "model")
_DONE = "COMPLETE"  # the spec of finished assets, as JSON
_OWN_ENTRIES = (*_BUILT_ENTRIES, _DONE, "warm_start")  # and the warm start configs/demo_cpu.py caches in the folder
# The keys of the spec in COMPLETE since the first assets version, and those later versions added.
_SPEC_KEYS = frozenset({"num_people", "tokenizer", "vocab_size", "hidden_size", "num_layers", "num_heads",
                        "num_kv_heads", "intermediate_size", "search_fraction", "seed", "top_k", "version"})
_ADDED_SPEC_KEYS = frozenset({"retriever", "encoder_path", "initializer_range", "world"})


def _search_fn(index_dir: str, k: int):
    """A blocking `search(queries) -> documents' contents per query` over the embedded index (for
    demonstrations)."""
    from llds_jax.search.factory import make_retriever

    def search(queries: list[str]) -> list[list[str]]:
        async def run():
            async with make_retriever({"backend": "bm25", "index_dir": index_dir}) as retriever:
                return await retriever.search(queries, k)
        results = asyncio.run(run())
        for query, result in zip(queries, results):
            if result.error:
                raise RuntimeError(f"demo index {index_dir}: search {query!r} failed: {result.error}")
        return [[doc.contents for doc in result.docs] for result in results]
    return search


def build_assets(out_dir: str, spec: dict) -> dict[str, str]:
    """Writes world files, index, tokenizer, a random model and demonstrations under `out_dir`; returns their paths.

    `spec` holds num_people, seed, tokenizer, vocab_size, hidden_size, num_layers, num_heads, num_kv_heads,
    intermediate_size, initializer_range, search_fraction, top_k (documents per search in the demonstrations),
    retriever, encoder_path and version. With retriever "e5_device" it also writes the world's e5 Flat index
    (index_builder's folder) embedded by `encoder_path`, or by a small random BERT of e5's layout written there
    ("e5", written with numpy) when it is "". An existing folder built from the same spec is reused; one built
    from another spec is refused (FolderNotOursError naming demo.assets_dir and the settings that differ), as is a
    folder whose contents do not prove it is the project's (llds_jax.runtime.output_folder: a COMPLETE that is not
    a demo spec, or entries the demo does not write): nothing is deleted but the entries of an unfinished build of
    its own, which is built again.
    """
    from flax import nnx

    from index_builder.corpus import CorpusReader
    from index_builder.to_bm25 import build_bm25
    from index_builder.to_faiss import build_faiss
    from llds_jax.data import synthetic
    from llds_jax.model import ModelConfig, Transformer, hf_io
    from llds_jax.model.tokenizer import load_tokenizer, train_tokenizer, write_qwen25_tokenizer
    from llds_jax.search.e5 import E5Embedder
    from llds_jax.search.synthetic import write_random_bert
    from llds_jax.sft.demonstrations import write_demonstrations
    from llds_jax.train.batching import round_up

    if spec["tokenizer"] not in DEMO_TOKENIZERS:
        raise ConfigError(f"demo.tokenizer must be one of {DEMO_TOKENIZERS}, got {spec['tokenizer']!r}")
    paths = {"model": os.path.join(out_dir, "model"), "index": os.path.join(out_dir, "index"),
             "train": os.path.join(out_dir, "world", "train.parquet"),
             "test": os.path.join(out_dir, "world", "test.parquet"),
             "demonstrations": os.path.join(out_dir, "world", "demonstrations.jsonl"),
             "search_demonstrations": os.path.join(out_dir, "world", "search_demonstrations.jsonl"),
             "e5_index": os.path.join(out_dir, "e5_index"),
             "encoder": spec["encoder_path"] or os.path.join(out_dir, "e5")}
    output_folder.claim(out_dir, "demo.assets_dir", ASSETS, spec)
    if _built_spec(out_dir) == spec:  # claim refused a folder of assets built for another spec
        return paths
    for entry in _BUILT_ENTRIES:  # an unfinished build of the project's own (the folder is claimed): built again
        shutil.rmtree(os.path.join(out_dir, entry), ignore_errors=True)
    world = _make_world(spec)
    files = synthetic.write_world(world, os.path.join(out_dir, "world"))
    build_bm25(CorpusReader(files["corpus.jsonl"]), paths["index"])
    if spec["retriever"] == "e5_device":
        if not spec["encoder_path"]:
            write_random_bert(paths["encoder"], max_positions=E5_MAX_LENGTH, seed=spec["seed"])
        build_faiss(CorpusReader(files["corpus.jsonl"]), paths["e5_index"],
                    E5Embedder(paths["encoder"], max_length=E5_MAX_LENGTH))
    search = _search_fn(paths["index"], spec["top_k"])
    records = synthetic.demonstrations(world, world.train, search, spec["search_fraction"], seed=spec["seed"])
    write_demonstrations(paths["demonstrations"], records)
    write_demonstrations(paths["search_demonstrations"],
                         synthetic.demonstrations(world, world.train, search, 1.0, seed=spec["seed"]))
    if spec["tokenizer"] == "world":
        tok_dir = train_tokenizer(synthetic.tokenizer_texts(world, records), paths["model"],
                                  vocab_size=spec["vocab_size"], phrases=synthetic.tokenizer_phrases())
        vocab_rows = round_up(len(load_tokenizer(tok_dir)), _VOCAB_MULTIPLE)
    else:
        write_qwen25_tokenizer(paths["model"], "base")
        vocab_rows = QWEN25_VOCAB_ROWS
    h = spec["hidden_size"]
    cfg = ModelConfig(vocab_size=vocab_rows, hidden_size=h, intermediate_size=spec["intermediate_size"],
                      num_layers=spec["num_layers"], num_heads=spec["num_heads"], num_kv_heads=spec["num_kv_heads"],
                      head_dim=h // spec["num_heads"], rope_theta=1_000_000.0, qkv_bias=True,
                      tie_word_embeddings=True, initializer_range=spec["initializer_range"])
    hf_io.save_model(Transformer(cfg, rngs=nnx.Rngs(spec["seed"])), paths["model"])
    with open(os.path.join(out_dir, _DONE), "w") as f:
        json.dump(spec, f)
    log.info("demo assets written to %s", out_dir)
    return paths


def _make_world(spec: dict) -> synthetic.SearchWorld:
    """The generated world of `spec`: the k-hop one with `"world": "khop"`, else the single-/two-hop one."""
    from llds_jax.data import khop, synthetic

    if spec.get("world") == "khop":
        return khop.make_khop_world(num_people=spec["num_people"], seed=spec["seed"])
    return synthetic.make_world(num_people=spec["num_people"], seed=spec["seed"])


def _built_spec(out_dir: str) -> dict | None:
    """The spec that the COMPLETE file of an assets folder records, or None when there is none (or it was cut as it
    was written, or it is not a demo spec: a user's file of that name)."""
    record = output_folder.read_json(os.path.join(out_dir, _DONE))
    if isinstance(record, dict) and _SPEC_KEYS <= record.keys() <= _SPEC_KEYS | _ADDED_SPEC_KEYS:
        return record
    return None


ASSETS = output_folder.Kind(
    "demo assets", recorded=_built_spec,
    strangers=output_folder.proven_by(lambda out_dir: _built_spec(out_dir) is not None,
                                      lambda entry: entry in _OWN_ENTRIES))


def spec_of(cfg: ml_collections.ConfigDict) -> dict:
    """What `build_assets` builds for `cfg`: the sizes of `cfg.demo`, its world when not the default two-hop one
    (whose spec is the one written before `demo.world` existed: those assets are reused), the run's seed and its
    retrieval top-k."""
    d = cfg.demo
    spec = {key: d[key] for key in ("num_people", "tokenizer", "vocab_size", "hidden_size", "num_layers",
                                    "num_heads", "num_kv_heads", "intermediate_size", "initializer_range",
                                    "search_fraction", "retriever", "encoder_path")}
    if d.world != "two_hop":
        spec["world"] = d.world
    return {**spec, "seed": cfg.seed, "top_k": cfg.rollout.retrieval_top_k, "version": ASSETS_VERSION}


def assets_for(cfg: ml_collections.ConfigDict, out_dir: str) -> dict[str, str]:
    """`build_assets` of `spec_of(cfg)`."""
    return build_assets(out_dir, spec_of(cfg))


def prepare(cfg: ml_collections.ConfigDict) -> dict[str, Any]:
    """When `cfg.demo.enabled`: builds the assets (if missing) and points model/data/retriever/sft at them, in
    `cfg`; returns the keys it set and their values (none when the demo is off)."""
    if not cfg.demo.enabled:
        return {}
    assets_dir = cfg.demo.assets_dir or os.path.join(cfg.run_dir, "assets")
    if gcs.is_gcs(assets_dir):
        raise ConfigError(f"demo.assets_dir must be a local folder (the embedded index is memory-mapped), got "
                          f"{assets_dir!r}{' from run_dir' if not cfg.demo.assets_dir else ''}: set demo.assets_dir")
    paths = assets_for(cfg, assets_dir)
    values: dict[str, Any] = {"model.path": paths["model"], "data.train_files": [paths["train"]],
                              "data.eval_files": [paths["test"]],
                              "retriever": {"backend": "bm25", "index_dir": paths["index"]}}
    if cfg.demo.retriever == "e5_device":
        values["retriever"] = {"backend": "e5_device", "index_path": paths["e5_index"],
                               "encoder_path": paths["encoder"], "max_length": E5_MAX_LENGTH}
    if cfg.sft.enabled and not cfg.sft.data_files:
        values["sft.data_files"] = [paths["demonstrations"]]
    if cfg.sft.enabled and cfg.sft.curriculum_steps and not cfg.sft.curriculum_files:
        values["sft.curriculum_files"] = [paths["search_demonstrations"]]
    for key, value in values.items():
        section, _, name = key.partition(".")
        if name:
            cfg[section][name] = value
        else:
            cfg[section] = ml_collections.ConfigDict(value)
    return values


def prepare_run(cfg: ml_collections.ConfigDict) -> dict[str, Any]:
    """`prepare(cfg)` on every process of a run, process 0 first: the others then reuse its assets from a shared
    folder (or build identical ones on their own disk) instead of writing the same files concurrently. Returns
    the keys it set and their values."""
    from llds_jax.runtime import distributed

    values = prepare(cfg) if distributed.is_main_process() else {}
    distributed.barrier("demo_assets")
    return values if distributed.is_main_process() else prepare(cfg)
