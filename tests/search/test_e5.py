"""The Flax BERT encoder and the e5 embedder against transformers' PyTorch BertModel (+ e5's mean pooling)."""
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, BertModel

from llds_jax.model.bert import load_bert
from llds_jax.search.e5 import E5Embedder, bucket, pow2_bucket

TEXTS = ["who played paul walker's character in fast and furious",
         '"Zylo3 Quarn3"\nZylo3 Quarn3 is a village on the river3 banks',
         "a", "the longest " * 40]


def reference_embeddings(folder: str, texts: list[str], max_length: int) -> np.ndarray:
    """e5's recipe with transformers: tokenize (padded, truncated), BertModel, mean over the mask, L2 normalize."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = BertModel.from_pretrained(folder).eval()
    batch = tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"][..., None].float()
    mean = (hidden * mask).sum(1) / mask.sum(1)
    return torch.nn.functional.normalize(mean, dim=-1).numpy()


def test_encoder_hidden_states_match_transformers_with_padding(e5_folder):
    tokenizer = AutoTokenizer.from_pretrained(e5_folder)
    batch = tokenizer(TEXTS, padding=True, truncation=True, max_length=64, return_tensors="np")
    assert batch["attention_mask"].min() == 0  # the batch is padded
    with torch.no_grad():
        expected = BertModel.from_pretrained(e5_folder).eval()(
            **{k: torch.from_numpy(v) for k, v in batch.items()}).last_hidden_state.numpy()
    ours = np.asarray(load_bert(e5_folder)(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"]))
    keep = batch["attention_mask"].astype(bool)  # padded positions are not defined the same way (nor used)
    np.testing.assert_allclose(ours[keep], expected[keep], atol=1e-5, rtol=1e-5)
    assert np.abs(expected[keep]).max() > 0.5  # random LayerNorm scales: not trivially small states


def test_e5_embeddings_match_transformers_with_prefixes(e5_folder):
    embedder = E5Embedder(e5_folder, max_length=64, batch_size=8, length_bucket=16, min_batch=2)
    np.testing.assert_allclose(embedder.embed_queries(TEXTS), reference_embeddings(
        e5_folder, ["query: " + t for t in TEXTS], 64), atol=1e-5)
    passages = embedder.embed_passages(TEXTS)
    np.testing.assert_allclose(passages, reference_embeddings(e5_folder, ["passage: " + t for t in TEXTS], 64),
                               atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(passages, axis=1), 1.0, atol=1e-6)
    assert not np.allclose(passages, embedder.embed_queries(TEXTS), atol=1e-3)  # the prefix changes the vector


def test_batches_are_bucketed_and_order_is_kept(e5_folder):
    embedder = E5Embedder(e5_folder, max_length=64, batch_size=4, length_bucket=16, min_batch=2)
    texts = [("word " * n).strip() for n in (30, 1, 7, 2, 3, 12, 1)]
    together = embedder.embed(texts)
    one_by_one = np.concatenate([embedder.embed([t]) for t in texts])
    np.testing.assert_allclose(together, one_by_one, atol=1e-5)
    np.testing.assert_allclose(together, reference_embeddings(e5_folder, texts, 64), atol=1e-5)
    assert {b for b, _ in embedder.shapes_compiled} <= {2, 4} and {t for _, t in embedder.shapes_compiled} <= {
        16, 32, 48, 64}
    assert embedder.embed([]).shape == (0, 32)


@pytest.mark.parametrize("n, step, cap, expected", [(1, 32, 256, 32), (33, 32, 256, 64), (300, 32, 256, 256),
                                                     (200, 32, 200, 200)])
def test_length_bucket(n, step, cap, expected):
    assert bucket(n, step, cap) == expected


@pytest.mark.parametrize("n, least, cap, expected", [(1, 8, 256, 8), (9, 8, 256, 16), (256, 8, 256, 256),
                                                     (100, 8, 96, 96)])
def test_batch_bucket(n, least, cap, expected):
    assert pow2_bucket(n, least, cap) == expected


def test_missing_folder_and_wrong_model_are_named(tmp_path, e5_folder):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nothing")):
        E5Embedder(str(tmp_path / "nothing"))
    with pytest.raises(ValueError, match="max_length 512 exceeds the encoder's 128 positions"):
        E5Embedder(e5_folder, max_length=512)
