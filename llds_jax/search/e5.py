"""The e5 text embedder (intfloat/e5-base-v2, as Search-R1 uses it): "query: " / "passage: " prefixes, BERT, mean
pooling over the attention mask, L2 normalization; inner products of two embeddings are cosine similarities.

Texts are embedded in batches under `jax.jit` on the default device (the accelerator when there is one). Shapes are
bucketed so a few programs serve every call: texts are sorted by token count, cut into batches of at most
`batch_size`, each batch padded to the next multiple of `length_bucket` tokens (at most `max_length`) and to the
next power of two rows (at least `min_batch`). At most (max_length / length_bucket) x log2(batch_size / min_batch)
+ 1 programs are compiled per process (8 x 6 with the defaults), each once.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from llds_jax.errors import InputError
from llds_jax.model.bert import load_bert
from llds_jax.model.tokenizer import load_tokenizer

QUERY_PREFIX = "query: "
PASSAGE_PREFIX = "passage: "


def mean_pool_normalize(hidden_btd: jax.Array, mask_bt: jax.Array) -> jax.Array:
    """Unit-length mean of the hidden states the mask keeps [B, D], in float32 (an all-zero mask row gives 0)."""
    mask = mask_bt.astype(jnp.float32)[..., None]
    summed_bd = jnp.sum(hidden_btd.astype(jnp.float32) * mask, axis=1)
    mean_bd = summed_bd / jnp.maximum(jnp.sum(mask, axis=1), 1.0)
    norm_b1 = jnp.sqrt(jnp.sum(jnp.square(mean_bd), axis=-1, keepdims=True))
    return mean_bd / jnp.maximum(norm_b1, 1e-12)  # torch.nn.functional.normalize's eps


def bucket(n: int, step: int, cap: int) -> int:
    """`n` rounded up to a multiple of `step`, at most `cap` (and at least `step`)."""
    return min(cap, max(step, -(-n // step) * step))


def pow2_bucket(n: int, least: int, cap: int) -> int:
    """The smallest power of two >= n (at least `least`), at most `cap`."""
    return min(cap, max(least, 1 << max(0, math.ceil(math.log2(max(n, 1))))))


class E5Embedder:
    """Embeds queries and passages with the e5 model in the HF folder `path` (local or gs://; tokenizer files and
    safetensors weights).

    `max_length` tokens per text (Search-R1: 256, longer texts are truncated), `batch_size` texts per device call,
    `dtype` the compute dtype ("float32"; "bfloat16" halves the time on accelerators, pooling stays float32).
    """

    def __init__(self, path: str, *, max_length: int = 256, batch_size: int = 256, dtype: str = "float32",
                 length_bucket: int = 32, min_batch: int = 8):
        self.path = path
        self.model = load_bert(path, dtype)
        self.cfg = self.model.cfg
        if max_length > self.cfg.max_positions:
            raise InputError(f"max_length {max_length} exceeds the encoder's {self.cfg.max_positions} positions"
                             f" ({path}/config.json max_position_embeddings)")
        self.tokenizer = load_tokenizer(path, fallback_chat_template=None)
        self.max_length, self.batch_size = max_length, batch_size
        self.length_bucket, self.min_batch = length_bucket, min(min_batch, batch_size)
        graphdef, state = nnx.split(self.model)

        def embed_bd(state, token_ids_bt, mask_bt):
            hidden_btd = nnx.merge(graphdef, state)(token_ids_bt, mask_bt)
            return mean_pool_normalize(hidden_btd, mask_bt)

        self._state = state
        self._embed_bd = jax.jit(embed_bd)
        self.shapes_compiled: set[tuple[int, int]] = set()

    @property
    def dim(self) -> int:
        """Embedding size D (the encoder's hidden size)."""
        return self.cfg.hidden_size

    def embed_queries(self, queries: Sequence[str]) -> np.ndarray:
        """[Q, D] float32 unit vectors of `queries` ("query: " prefixed)."""
        return self.embed([QUERY_PREFIX + q for q in queries])

    def embed_passages(self, contents: Sequence[str]) -> np.ndarray:
        """[P, D] float32 unit vectors of wiki-18 `contents` ("passage: " prefixed, title line included)."""
        return self.embed([PASSAGE_PREFIX + c for c in contents])

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text ([CLS] ... [SEP]), truncated to max_length."""
        return self.tokenizer(list(texts), truncation=True, max_length=self.max_length,
                              add_special_tokens=True)["input_ids"]

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """[len(texts), D] float32 unit vectors of the texts as given (no prefix added)."""
        out_bd = np.zeros((len(texts), self.dim), np.float32)
        if not texts:
            return out_bd
        ids = self.tokenize(texts)
        order = np.argsort([len(t) for t in ids], kind="stable")
        pending = []
        for start in range(0, len(order), self.batch_size):
            rows = order[start:start + self.batch_size]
            pending.append((rows, self._embed_batch([ids[i] for i in rows])))  # dispatched asynchronously
        for rows, emb_bd in pending:
            out_bd[rows] = np.asarray(emb_bd)[:len(rows)]
        return out_bd

    def _embed_batch(self, ids: list[list[int]]) -> jax.Array:
        """Embeddings [B', D] of one batch padded to its bucket (B' >= len(ids) rows; the first len(ids) are real)."""
        T = bucket(max(len(t) for t in ids), self.length_bucket, self.max_length)
        B = pow2_bucket(len(ids), self.min_batch, self.batch_size)
        token_ids_bt = np.zeros((B, T), np.int32)
        mask_bt = np.zeros((B, T), np.int32)
        for row, t in enumerate(ids):
            token_ids_bt[row, :len(t)] = t
            mask_bt[row, :len(t)] = 1
        self.shapes_compiled.add((B, T))
        return self._embed_bd(self._state, token_ids_bt, mask_bt)
