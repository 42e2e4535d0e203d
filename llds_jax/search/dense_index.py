"""The dense index folder (`python -m index_builder CORPUS --to faiss --encoder e5`) and its resumable writer.

Folder layout:
- `index.faiss`: a faiss inner-product index of the passages' e5 embeddings, row i = passage i ("Flat" by
  default, as Search-R1's `e5_Flat.index`; any faiss factory string, e.g. "HNSW64");
- `docs.jsonl` + `doc_offsets.npy`: the passages in row order (docstore.py), the row -> document map;
- `llds_index.json`: the manifest (format, encoder, dimension, faiss spec, counts).

The writer embeds nothing itself: it receives each batch's embeddings and buffers them into shards of
`shard_docs` passages under `<out_dir>.partial/shards/` (`docs_NNNNNN.jsonl`, then `emb_NNNNNN.npy` [n, D]
float32, each written to a temporary name and renamed, the embeddings last: a shard exists once both are
complete). An interrupted build leaves the partial folder; the same command resumes after its last complete shard
(`resume_docs` passages are skipped). `finish` adds the shards to the faiss index, concatenates the passages, and
renames the folder to `out_dir`. The faiss index is built in memory (for Flat: rows x D x 4 bytes, 62 GB at
wiki-18's 21M x 768), as Search-R1's builder does.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Sequence

import faiss
import numpy as np

from llds_jax.errors import InputError
from llds_jax.search.docstore import DOCS_FILE, OFFSETS_FILE, line_offsets

INDEX_NAME = "index.faiss"
DOCS_NAME = DOCS_FILE
MANIFEST_FILE = "llds_index.json"
BUILD_FILE = "build.json"  # the partial folder's build settings, compared on resume
FORMAT = "llds-dense-v1"
_SHARDS = "shards"


class BuildSettingsError(ValueError):
    """A partial build made with other settings, or a faiss spec faiss does not know."""


def index_file(index_dir: str) -> str:
    """The faiss file of an index folder; raises naming the folder when it is not a complete dense index."""
    manifest = os.path.join(index_dir, MANIFEST_FILE)
    if not os.path.isfile(manifest):
        raise FileNotFoundError(f"{index_dir}: not a dense index folder ({MANIFEST_FILE} missing; build one with"
                                " `python -m index_builder CORPUS --to faiss --encoder e5 ...`)")
    with open(manifest, encoding="utf-8") as f:
        found = json.load(f).get("format")
    if found != FORMAT:
        raise InputError(f"{manifest}: format {found!r}, this code reads {FORMAT!r}")
    return os.path.join(index_dir, INDEX_NAME)


@dataclasses.dataclass(frozen=True)
class DenseIndexStats:
    """Counts of a finished index; `bytes_on_disk` is the folder size in bytes."""

    num_docs: int
    bytes_on_disk: int


def _shard_name(kind: str, number: int, ext: str) -> str:
    return f"{kind}_{number:06d}.{ext}"


class DenseIndexWriter:
    """Writes (or resumes) the dense index folder `out_dir` in shards of `shard_docs` passages.

    `settings` (encoder, max_length, dtype, corpus, ...) must equal those of a partial build to resume it;
    `dim` is the embedding size and `faiss_spec` the faiss factory string of the index.
    """

    def __init__(self, out_dir: str, *, dim: int, faiss_spec: str, shard_docs: int, settings: dict):
        if os.path.exists(out_dir):
            raise FileExistsError(f"{out_dir} already exists (pass --overwrite to replace it)")
        if shard_docs < 1:
            raise BuildSettingsError(f"--shard-docs must be >= 1, got {shard_docs}")
        self.out_dir, self.partial = out_dir, out_dir + ".partial"
        self.dim, self.faiss_spec, self.shard_docs = dim, faiss_spec, shard_docs
        self._check_spec()
        build = {"format": FORMAT, "dim": dim, "faiss": faiss_spec, "shard_docs": shard_docs, **settings}
        shards = os.path.join(self.partial, _SHARDS)
        build_path = os.path.join(self.partial, BUILD_FILE)
        if os.path.isfile(build_path):
            with open(build_path, encoding="utf-8") as f:
                before = json.load(f)
            changed = sorted(k for k in set(before) | set(build) if before.get(k) != build.get(k))
            if changed:
                what = "; ".join(f"{k}: {before.get(k)!r} then, {build.get(k)!r} now" for k in changed)
                raise BuildSettingsError(f"{self.partial} is a build with other settings ({what}); re-run it with"
                                         " the same settings to resume, or remove it")
        else:
            os.makedirs(shards, exist_ok=True)
            with open(build_path, "w", encoding="utf-8") as f:
                json.dump(build, f, indent=2)
        self._shards = shards
        self.done_shards = 0
        while os.path.exists(os.path.join(shards, _shard_name("emb", self.done_shards, "npy"))):
            self.done_shards += 1
        self.resume_docs = self.done_shards * shard_docs
        self._ids: list[str] = []
        self._contents: list[str] = []
        self._emb: list[np.ndarray] = []

    def _check_spec(self) -> None:
        try:
            faiss.index_factory(self.dim, self.faiss_spec, faiss.METRIC_INNER_PRODUCT)
        except RuntimeError:
            raise BuildSettingsError(f"--faiss-index {self.faiss_spec!r} is not a faiss index factory string"
                             " (e.g. Flat, HNSW64)") from None

    def add(self, ids: Sequence[str], contents: Sequence[str], emb_nd: np.ndarray) -> None:
        """Appends a batch of passages with their embeddings [n, D]; writes every shard that fills up."""
        if emb_nd.shape != (len(ids), self.dim):
            raise ValueError(f"embeddings of shape {emb_nd.shape} for {len(ids)} passages of dimension {self.dim}")
        self._ids.extend(ids)
        self._contents.extend(contents)
        self._emb.append(np.asarray(emb_nd, np.float32))
        while len(self._ids) >= self.shard_docs:
            self._write_shard(self.shard_docs)

    def _write_shard(self, n: int) -> None:
        emb_nd = np.concatenate(self._emb)
        docs_path = os.path.join(self._shards, _shard_name("docs", self.done_shards, "jsonl"))
        emb_path = os.path.join(self._shards, _shard_name("emb", self.done_shards, "npy"))
        with open(docs_path + ".tmp", "w", encoding="utf-8") as f:
            for doc_id, text in zip(self._ids[:n], self._contents[:n]):
                f.write(json.dumps({"id": doc_id, "contents": text}, ensure_ascii=False) + "\n")
        os.replace(docs_path + ".tmp", docs_path)
        with open(emb_path + ".tmp", "wb") as f:
            np.save(f, emb_nd[:n])
        os.replace(emb_path + ".tmp", emb_path)  # last: the shard is complete
        self._ids, self._contents, self._emb = self._ids[n:], self._contents[n:], [emb_nd[n:]]
        self.done_shards += 1

    def finish(self) -> DenseIndexStats:
        """Writes the last shard, builds the faiss index and the passage store, and moves the folder into place."""
        if self._ids:
            self._write_shard(len(self._ids))
        index = faiss.index_factory(self.dim, self.faiss_spec, faiss.METRIC_INNER_PRODUCT)
        docs_path = os.path.join(self.partial, DOCS_FILE)
        with open(docs_path, "wb") as docs:
            for number in range(self.done_shards):
                index.add(np.load(os.path.join(self._shards, _shard_name("emb", number, "npy"))))
                with open(os.path.join(self._shards, _shard_name("docs", number, "jsonl")), "rb") as shard:
                    shutil.copyfileobj(shard, docs)
        np.save(os.path.join(self.partial, OFFSETS_FILE), line_offsets(docs_path))
        faiss.write_index(index, os.path.join(self.partial, INDEX_NAME))
        build_path = os.path.join(self.partial, BUILD_FILE)
        with open(build_path, encoding="utf-8") as f:
            manifest = {**json.load(f), "num_docs": int(index.ntotal)}
        with open(os.path.join(self.partial, MANIFEST_FILE), "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=2)
        shutil.rmtree(self._shards)
        os.remove(build_path)
        os.rename(self.partial, self.out_dir)
        size = sum(os.path.getsize(os.path.join(self.out_dir, name)) for name in os.listdir(self.out_dir))
        return DenseIndexStats(num_docs=int(index.ntotal), bytes_on_disk=size)
