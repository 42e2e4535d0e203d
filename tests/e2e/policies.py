"""Hand-built policies whose behaviour the end-to-end tests can predict. Import as
`from tests.e2e.policies import chain_policy`."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from flax import nnx

from llds_jax.model import ModelConfig, Transformer

SUCCESSOR_LOGIT = 30.0  # logit of a successor; every other next token has logit 0
SEARCH_PREFERENCE = 1.0  # extra logit of a search tag over an answer tag: greedy decoding always searches


def chain_policy(tokenizer, texts: Sequence[tuple[str, float]], vocab_size: int,
                 hidden_size: int = 32) -> Transformer:
    """A 1-layer Qwen2 policy whose next token depends only on the current one: attention and MLP outputs are zero,
    so the last hidden state is the normalized embedding of the current token.

    `texts` are (text, bonus) pairs. Each token of the texts has an embedding axis of its own and is followed by
    what follows its first occurrence in each text, with logit SUCCESSOR_LOGIT plus the bonus of the first such
    text; every other token (a text's last one included, unless it occurs earlier) shares one axis and is followed
    by the first token of each text. With logit 0 for every other token, sampling at temperature 1 leaves these
    chains about once in e**30 / vocab_size tokens.
    """
    other = -1  # stands for every token outside the texts
    successors: dict[int, dict[int, float]] = {}
    for text, bonus in texts:
        ids = [other, *tokenizer.encode(text, add_special_tokens=False)]
        firsts = {}
        for token, following in zip(ids, ids[1:]):
            firsts.setdefault(token, following)
        for token, following in firsts.items():
            successors.setdefault(token, {}).setdefault(following, SUCCESSOR_LOGIT + bonus)
    axes = {token: axis for axis, token in enumerate(sorted(successors))}  # `other` (-1) gets axis 0
    if len(axes) > hidden_size:
        raise ValueError(f"chain_policy: {len(axes)} axes needed, hidden_size is {hidden_size}")
    cfg = ModelConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=64, num_layers=1,
                      num_heads=4, num_kv_heads=2, head_dim=hidden_size // 4, qkv_bias=True,
                      tie_word_embeddings=False)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    model.layers.o_proj.set_value(np.zeros_like(model.layers.o_proj.get_value()))
    model.layers.down_proj.set_value(np.zeros_like(model.layers.down_proj.get_value()))
    embed = np.zeros((vocab_size, hidden_size), np.float32)
    embed[:, 0] = 1.0
    head = np.zeros((hidden_size, vocab_size), np.float32)
    for token, axis in axes.items():
        if token != other:
            embed[token] = np.eye(hidden_size, dtype=np.float32)[axis]
        for following, logit in successors[token].items():
            head[axis, following] = logit
    model.embed.set_value(embed)
    model.lm_head.set_value(head / np.sqrt(hidden_size))  # the normalized one-hot embedding is sqrt(hidden) long
    return model


def searching_policy(tokenizer, city: str) -> Transformer:
    """A chain policy (tests/e2e/policies.py) over `tokenizer`'s vocabulary whose turns are a search for `city`, the
    answer `city`, or a mix of the two tags (an invalid action): "<search>" or "<answer>", then `city`, then
    "</search>" or "</answer>", the search tags SEARCH_PREFERENCE more likely. Greedy decoding searches in every turn.
    """
    texts = ((f"<search>{city}</search>", SEARCH_PREFERENCE), (f"<answer>{city}</answer>", 0.0))
    return chain_policy(tokenizer, texts, vocab_size=len(tokenizer))
