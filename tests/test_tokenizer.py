"""The offline Qwen2.5 tokenizer and the shipped chat templates."""
from llds_jax import tokenizer as tokenizer_lib


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
