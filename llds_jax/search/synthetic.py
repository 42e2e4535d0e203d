"""Generated wiki-18 style corpora with planted answers, for tests and benchmarks (no downloads).

Filler passages draw pseudo-words (consonant-vowel syllables) from a Zipf-like distribution, so term statistics
look like prose: a few very common terms, a long tail of rare ones. Planted passage i states a fact about an
entity named by two words that occur nowhere else ("Zylo{i} Quarn{i}"); its query asks about that entity, so its
passage is the unique best BM25 match. A distractor passage per planted one mentions only the first word.
"""
from __future__ import annotations

import dataclasses
import gzip
import itertools
import json
import os
import random
from collections.abc import Iterator

import numpy as np
import safetensors.numpy

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


@dataclasses.dataclass(frozen=True)
class PlantedQuery:
    """A question whose best answer is passage `doc_id`."""

    query: str
    doc_id: str


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(rng.randint(2, 4)))


class SyntheticCorpus:
    """`n_docs` passages (ids "0".."n_docs-1"), of which 2 * `n_planted` are planted ones and their distractors.

    Passage lengths are uniform in `words_per_doc` (inclusive). The same arguments give the same corpus.
    """

    def __init__(self, n_docs: int, *, seed: int = 0, n_planted: int = 10, vocab_size: int = 20_000,
                 words_per_doc: tuple[int, int] = (40, 100)):
        if n_docs < 2 * n_planted:
            raise ValueError(f"n_docs ({n_docs}) must be >= 2 * n_planted ({2 * n_planted})")
        self.n_docs, self.seed, self.words_per_doc = n_docs, seed, words_per_doc
        rng = random.Random(seed)
        self.vocab = sorted({_word(rng) for _ in range(vocab_size)})
        rng.shuffle(self.vocab)
        self._cum_weights = list(itertools.accumulate(1.0 / (rank + 1) for rank in range(len(self.vocab))))
        slots = rng.sample(range(n_docs), 2 * n_planted)
        self._planted = {slot: i for i, slot in enumerate(slots[:n_planted])}
        self._distractors = {slot: i for i, slot in enumerate(slots[n_planted:])}
        self.planted = [PlantedQuery(f"Which river flows past the village of Zylo{i} Quarn{i}?", str(slot))
                        for slot, i in self._planted.items()]

    def _filler(self, rng: random.Random, n_words: int) -> list[str]:
        return rng.choices(self.vocab, cum_weights=self._cum_weights, k=n_words)

    def records(self) -> Iterator[dict]:
        """The passages in id order, as wiki-18 records {"id": str, "contents": '"Title"\\nbody'}."""
        rng = random.Random(self.seed + 1)
        for number in range(self.n_docs):
            title = " ".join(w.capitalize() for w in self._filler(rng, 2))
            body = self._filler(rng, rng.randint(*self.words_per_doc))
            if number in self._planted:
                i = self._planted[number]
                title = f"Zylo{i} Quarn{i}"
                body = [f"Zylo{i}", f"Quarn{i}", "is", "a", "village", "on", "the", f"river{i}", "banks"] + body
            elif number in self._distractors:
                body = body + ["near", f"Zylo{self._distractors[number]}"]
            yield {"id": str(number), "contents": f'"{title}"\n' + " ".join(body)}

    def write(self, path: str) -> str:
        """Writes the corpus as JSON lines (gzip when `path` ends in .gz); returns `path`."""
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "wt", encoding="utf-8") as f:
            for record in self.records():
                f.write(json.dumps(record) + "\n")
        return path

    def random_queries(self, n: int, *, seed: int = 1, words: tuple[int, int] = (3, 6)) -> list[str]:
        """`n` queries of filler words (drawn like passage words), for throughput measurements."""
        rng = random.Random(seed)
        return [" ".join(self._filler(rng, rng.randint(*words))) for _ in range(n)]


def wordpiece_vocab() -> list[str]:
    """A small WordPiece vocabulary that spells any lowercase ASCII text: BERT's special tokens, punctuation,
    digits, letters and the corpus's consonant-vowel syllables, each also as a `##` continuation piece."""
    pieces = list("abcdefghijklmnopqrstuvwxyz0123456789") + [c + v for c in _CONSONANTS for v in _VOWELS]
    punctuation = list("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")
    return ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *punctuation, *pieces, *("##" + p for p in pieces)]


def random_bert_tensors(*, vocab_size: int, hidden_size: int, num_layers: int, intermediate_size: int,
                        max_positions: int, seed: int, std: float) -> dict[str, np.ndarray]:
    """The float32 tensors of a random BertModel by their Hugging Face names ([out, in] for linear weights).

    Each starts at BERT's initial value (weights N(0, std^2) with the padding row of the word embeddings zero,
    biases 0, LayerNorm scales 1) and is then moved by N(0, std^2), so no parameter is trivially 1 or 0.
    """
    rng = np.random.default_rng(seed)
    D, F = hidden_size, intermediate_size
    weights = {"embeddings.word_embeddings.weight": (vocab_size, D),
               "embeddings.position_embeddings.weight": (max_positions, D),
               "embeddings.token_type_embeddings.weight": (2, D)}
    for i in range(num_layers):
        layer = f"encoder.layer.{i}."
        weights.update({f"{layer}attention.self.{name}.weight": (D, D) for name in ("query", "key", "value")})
        weights.update({f"{layer}attention.output.dense.weight": (D, D), f"{layer}intermediate.dense.weight": (F, D),
                        f"{layer}output.dense.weight": (D, F)})
    tensors = {name: rng.normal(0.0, std, shape) for name, shape in weights.items()}
    tensors["embeddings.word_embeddings.weight"][0] = 0.0  # [PAD], as BertEmbeddings initializes it
    biases = {f"{name[:-len('weight')]}bias": shape[0] for name, shape in weights.items() if ".layer." in name}
    tensors.update({name: np.zeros(size) for name, size in biases.items()})
    norms = ["embeddings.LayerNorm."] + [f"encoder.layer.{i}.{part}.LayerNorm." for i in range(num_layers)
                                         for part in ("attention.output", "output")]
    tensors.update({f"{norm}weight": np.ones(D) for norm in norms} | {f"{norm}bias": np.zeros(D) for norm in norms})
    return {name: (value + rng.normal(0.0, std, value.shape)).astype(np.float32)
            for name, value in sorted(tensors.items())}


def write_random_bert(folder: str, *, hidden_size: int = 32, num_layers: int = 2, num_heads: int = 4,
                      intermediate_size: int = 37, max_positions: int = 128, seed: int = 0, std: float = 0.2) -> str:
    """Writes a randomly initialized BERT encoder folder in e5's layout (config.json, model.safetensors and a
    `wordpiece_vocab` tokenizer, as transformers' BertModel.save_pretrained writes them) with numpy and
    safetensors, no torch (the demo's e5 retriever builds one on the base install); returns `folder`.

    The tensors are `random_bert_tensors` (deterministic from `seed`).
    """
    vocab = wordpiece_vocab()
    config = {"architectures": ["BertModel"], "model_type": "bert", "vocab_size": len(vocab),
              "hidden_size": hidden_size, "num_hidden_layers": num_layers, "num_attention_heads": num_heads,
              "intermediate_size": intermediate_size, "hidden_act": "gelu", "hidden_dropout_prob": 0.1,
              "attention_probs_dropout_prob": 0.1, "max_position_embeddings": max_positions, "type_vocab_size": 2,
              "initializer_range": std, "layer_norm_eps": 1e-12, "pad_token_id": 0, "dtype": "float32"}
    tensors = random_bert_tensors(vocab_size=len(vocab), hidden_size=hidden_size, num_layers=num_layers,
                                  intermediate_size=intermediate_size, max_positions=max_positions, seed=seed,
                                  std=std)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    safetensors.numpy.save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(folder, "vocab.txt"), "w", encoding="utf-8") as f:
        f.write("\n".join(vocab) + "\n")
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({"tokenizer_class": "BertTokenizer", "do_lower_case": True, "model_max_length": max_positions}, f)
    return folder
