"""The e5 text embedder (intfloat/e5-base-v2, as Search-R1 uses it): "query: " / "passage: " prefixes, BERT, mean
pooling over the attention mask, L2 normalization; inner products of two embeddings are cosine similarities.

Texts are embedded in batches under `jax.jit` on the default device (the accelerator when there is one). Shapes are
bucketed so a few programs serve every call: texts are sorted by token count, cut into batches of at most
`batch_size`, each batch padded to the next multiple of `length_bucket` tokens (at most `max_length`) and to the
next power of two rows (at least `min_batch`): `batch_shape`. At most (max_length / length_bucket) x
(log2(batch_size / min_batch) + 1) programs are compiled per process (8 x 6 with the defaults), each once;
`reachable_shapes` lists those that calls of up to a given number of texts reach, which is what `--mode=compile`
compiles (`abstract_programs`, llds_jax/aot/compile_check.py).
"""
from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import SingleDeviceSharding

from llds_jax.errors import InputError
from llds_jax.model.bert import BertConfig, BertEncoder, load_bert
from llds_jax.model.tokenizer import load_tokenizer
from llds_jax.programs import AbstractProgram, Role
from llds_jax.search.dense_options import EncoderOptions

QUERY_PREFIX = "query: "
PASSAGE_PREFIX = "passage: "
LENGTH_BUCKET, MIN_BATCH = 32, 8  # the embedder's defaults: tokens rounded up to multiples of 32, at least 8 rows
# intfloat/e5-base-v2's config.json (Search-R1's encoder): what `--mode=compile` compiles without the folder.
E5_BASE_V2 = BertConfig(vocab_size=30522, hidden_size=768, num_layers=12, num_heads=12, intermediate_size=3072,
                        max_positions=512)


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


def batch_shape(texts: int, tokens: int, *, batch_size: int, max_length: int, length_bucket: int = LENGTH_BUCKET,
                min_batch: int = MIN_BATCH) -> tuple[int, int]:
    """(B, T): the rows and tokens a batch of `texts` texts (<= batch_size) whose longest has `tokens` tokens
    (<= max_length) is padded to."""
    return (pow2_bucket(texts, min(min_batch, batch_size), batch_size), bucket(tokens, length_bucket, max_length))


def reachable_shapes(max_texts: int, *, batch_size: int, max_length: int, length_bucket: int = LENGTH_BUCKET,
                     min_batch: int = MIN_BATCH) -> set[tuple[int, int]]:
    """Every (B, T) an embedder (its `batch_size`, `max_length`, `length_bucket`, `min_batch`) runs for calls of at
    most `max_texts` texts: a call's batches hold 1 to min(max_texts, batch_size) texts (its last batch holds the
    remainder) of any length up to max_length tokens."""
    shape = functools.partial(batch_shape, batch_size=batch_size, max_length=max_length,
                              length_bucket=length_bucket, min_batch=min_batch)
    rows = {shape(n, 1)[0] for n in range(1, min(max_texts, batch_size) + 1)}
    tokens = {shape(1, t)[1] for t in range(1, max_length + 1)}
    return {(b, t) for b in rows for t in tokens}


def check_max_length(max_length: int, cfg: BertConfig, where: str) -> None:
    """Raises InputError unless `max_length` tokens fit the encoder's positions (`where`: its folder)."""
    if max_length > cfg.max_positions:
        raise InputError(f"max_length {max_length} exceeds the encoder's {cfg.max_positions} positions"
                         f" ({where}/config.json max_position_embeddings)")


def embed_function(graphdef: nnx.GraphDef):
    """The embedding program's function (not jitted) of the encoder `graphdef`: (state, token ids [B, T] int32,
    mask [B, T] int32) -> unit vectors [B, D] float32."""

    def embed_bd(state, token_ids_bt, mask_bt):
        hidden_btd = nnx.merge(graphdef, state)(token_ids_bt, mask_bt)
        return mean_pool_normalize(hidden_btd, mask_bt)

    return embed_bd


def abstract_programs(cfg: BertConfig, device, shapes: set[tuple[int, int]]) -> list[AbstractProgram]:
    """The embedding program of an encoder of `cfg` at abstract arguments on `device` (a chip, for `--mode=compile`:
    the embedder runs on its process's default device) at each (B, T) of `shapes`, smallest first: its parameters
    in float32 (`cfg.dtype` is the compute dtype), token ids and mask [B, T] int32."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: BertEncoder(cfg)))
    on_chip = SingleDeviceSharding(device)
    state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=on_chip), state)
    embed = jax.jit(embed_function(graphdef))
    programs = []
    for rows, tokens in sorted(shapes):
        ids = jax.ShapeDtypeStruct((rows, tokens), jnp.int32, sharding=on_chip)
        text = (f"{rows} texts x {tokens} tokens, BERT {cfg.num_layers} layers x {cfg.hidden_size} in {cfg.dtype},"
                " on the host's first chip")
        programs.append(AbstractProgram(Role.QUERY_ENCODER, text, embed, (state, ids, ids),
                                        detail=f"{rows} x {tokens}"))
    return programs


class E5Embedder:
    """Embeds queries and passages with the e5 model in the HF folder `path` (local or gs://; tokenizer files and
    safetensors weights).

    `max_length` tokens per text (Search-R1: 256, longer texts are truncated), `batch_size` texts per device call,
    `dtype` the compute dtype ("float32"; "bfloat16" halves the time on accelerators, pooling stays float32).
    """

    def __init__(self, path: str, *, max_length: int = EncoderOptions.max_length,
                 batch_size: int = EncoderOptions.encoder_batch_size, dtype: str = EncoderOptions.encoder_dtype,
                 length_bucket: int = LENGTH_BUCKET, min_batch: int = MIN_BATCH):
        self.path = path
        self.model = load_bert(path, dtype)
        self.cfg = self.model.cfg
        check_max_length(max_length, self.cfg, path)
        self.tokenizer = load_tokenizer(path, fallback_chat_template=None)
        self.max_length, self.batch_size = max_length, batch_size
        self.length_bucket, self.min_batch = length_bucket, min_batch
        graphdef, self._state = nnx.split(self.model)
        self._embed_bd = jax.jit(embed_function(graphdef))
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
        B, T = batch_shape(len(ids), max(len(t) for t in ids), batch_size=self.batch_size,
                           max_length=self.max_length, length_bucket=self.length_bucket, min_batch=self.min_batch)
        token_ids_bt = np.zeros((B, T), np.int32)
        mask_bt = np.zeros((B, T), np.int32)
        for row, t in enumerate(ids):
            token_ids_bt[row, :len(t)] = t
            mask_bt[row, :len(t)] = 1
        self.shapes_compiled.add((B, T))
        return self._embed_bd(self._state, token_ids_bt, mask_bt)
