"""The offline Qwen2.5 tokenizer, the shipped chat templates, tokenizer folders on gs://."""
import os
import shutil

import pytest

from llds_jax.model import tokenizer as tokenizer_lib
from tests.configs import load
from llds_jax.config.sections import RolloutConfig

PROMPT_TOKENS = RolloutConfig.max_prompt_tokens  # the run's default prompt cut


def test_hello_world_ids(qwen_tokenizer):
    assert qwen_tokenizer.encode("Hello, world!") == [9707, 11, 1879, 0]


def test_special_tokens_and_sizes(qwen_tokenizer, qwen_instruct_tokenizer):
    assert len(qwen_tokenizer) == 151643 + len(tokenizer_lib.QWEN25_SPECIAL_TOKENS)
    for i, tok in enumerate(tokenizer_lib.QWEN25_SPECIAL_TOKENS):
        assert qwen_tokenizer.convert_tokens_to_ids(tok) == 151643 + i
    assert qwen_tokenizer.eos_token == "<|endoftext|>"
    assert qwen_instruct_tokenizer.eos_token == "<|im_end|>"
    assert qwen_tokenizer.pad_token_id == 151643
    # Special tokens are single ids, never split into BPE pieces.
    assert qwen_tokenizer.encode("<|im_start|>user") == [151644, 872]


def test_chat_templates_ship_in_package(qwen_tokenizer, qwen_instruct_tokenizer):
    base = qwen_tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert base == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    inst = qwen_instruct_tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert inst.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.")
    assert "{%" in tokenizer_lib.chat_template("base")


def test_trained_tokenizer_round_trips_and_keeps_protocol_tags_whole(tmp_path):
    from llds_jax.data import synthetic
    from llds_jax import protocol
    from llds_jax.model.tokenizer import PROTOCOL_TAGS, load_tokenizer, train_tokenizer

    world = synthetic.make_world(num_people=30, seed=0)
    texts = synthetic.tokenizer_texts(world)
    tok = load_tokenizer(train_tokenizer(texts, str(tmp_path / "a"), vocab_size=600))
    again = load_tokenizer(train_tokenizer(texts, str(tmp_path / "b"), vocab_size=600))
    assert tok.get_vocab() == again.get_vocab()  # deterministic
    assert len(tok) <= 600
    assert tok.eos_token == tok.pad_token == "<|endoftext|>"
    for text in texts[:50] + ["unseen text: Zürich 42 — ok?"]:
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    for tag in PROTOCOL_TAGS:
        assert len(tok.encode(tag, add_special_tokens=False)) == 1, tag
    for person in world.people:  # each part of a name is one whole-word token, shared with other names
        assert tok.tokenize(" " + person.name) == ["Ġ" + part for part in person.name.split()], person.name
    turn = "<think> x </think>\n<search> a b </search>"
    assert tok.decode(tok.encode(turn), skip_special_tokens=True) == turn  # tags survive skip_special_tokens
    prompt = protocol.chat_prompt_ids(tok, world.train[0].question, PROMPT_TOKENS)
    assert tok.decode(prompt).startswith("<|im_start|>system\n")  # the shipped Qwen2.5 chat template
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(texts, str(tmp_path / "c"), vocab_size=100)


def test_gcs_folder_gives_the_local_tokenizer_and_saves_back(qwen_tokenizer_dir, qwen_tokenizer, gcs_dir, gcs_fs):
    gcs_fs.put(qwen_tokenizer_dir, f"{gcs_dir}/model", recursive=True)
    gcs_fs.pipe({f"{gcs_dir}/model/model.safetensors": b"weights", f"{gcs_dir}/model/metrics.jsonl": b"{}",
                 f"{gcs_dir}/model/model.safetensors.index.json": b"{}"})
    # Only the tokenizer's files are downloaded, never weights.
    assert tokenizer_lib.tokenizer_files(f"{gcs_dir}/model") == sorted(os.listdir(qwen_tokenizer_dir))
    text = "<|im_start|>user\nHello, world!<|im_end|><|endoftext|>"
    tok = tokenizer_lib.load_tokenizer(f"{gcs_dir}/model")
    assert tok.name_or_path == f"{gcs_dir}/model"
    tokenizer_lib.save_tokenizer(tok, f"{gcs_dir}/saved")
    for loaded in (tok, tokenizer_lib.load_tokenizer(f"{gcs_dir}/saved")):
        assert loaded.encode(text) == qwen_tokenizer.encode(text)
        assert loaded.chat_template == qwen_tokenizer.chat_template
        assert (len(loaded), loaded.eos_token_id, loaded.pad_token_id) == (151665, 151643, 151643)


def test_missing_gcs_tokenizer_folder_is_named(gcs_dir):
    with pytest.raises(FileNotFoundError, match=f"tokenizer folder not found: {gcs_dir}/nothing"):
        tokenizer_lib.load_tokenizer(f"{gcs_dir}/nothing")


def test_a_base_model_tokenizer_without_chat_template_gets_the_raw_search_r1_prompt(tmp_path):
    """As Search-R1 does: a tokenizer without a chat template (a Llama base model's) encodes the bare prompt, under
    llama3b_v4's setting and under any shipped Qwen2.5 fallback (its markers are not in this vocabulary)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from llds_jax import protocol

    question = "who wrote the book the origin of species"
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([protocol.make_prompt(question)], trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>"
                            ).save_pretrained(str(tmp_path))
    assert load("llama3b_v4").model.chat_template == ""
    for fallback in ("", "base", "instruct"):
        tok = tokenizer_lib.load_tokenizer(str(tmp_path), fallback_chat_template=fallback)
        assert not tok.chat_template, fallback
        prompt = tok.decode(protocol.chat_prompt_ids(tok, question, PROMPT_TOKENS))
        assert prompt == protocol.make_prompt(question) and "You are Qwen" not in prompt


@pytest.mark.parametrize("files, content, message", [
    (("tokenizer_config.json",), None, r"its files \(tokenizer_config\.json\) make a tokenizer that encodes text to "
                                       r"no token; a tokenizer folder holds a valid tokenizer\.json, or vocab\.json "
                                       r"and merges\.txt"),
    (("tokenizer_config.json",), "{}", r"its files \(tokenizer\.json, tokenizer_config\.json\) do not make a "
                                       r"tokenizer \(Exception: Model missing"),
])
def test_a_folder_without_a_working_tokenizer_is_named_at_load(qwen_tokenizer_dir, tmp_path, files, content,
                                                               message):
    """Before (issue 44): only tokenizer_config.json loaded a tokenizer of no vocabulary, and the run failed in its
    first rollout naming no file; a tokenizer.json of `{}` gave "error: added_tokens"."""
    folder = tmp_path / "tok"
    folder.mkdir()
    for name in files:
        shutil.copy(os.path.join(qwen_tokenizer_dir, name), folder / name)
    if content is not None:
        (folder / "tokenizer.json").write_text(content)
    with pytest.raises(ValueError, match=rf"^tokenizer folder {folder}: {message}"):
        tokenizer_lib.load_tokenizer(str(folder))
