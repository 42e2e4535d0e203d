"""Llama-3.2-3B-Base with LLDS-MA (adaptive) on a TPU v4-16 slice.

Prompt as in Search-R1: the tokenizer's own chat template when it has one, else the raw Search-R1 prompt
(`model.chat_template = ""`: never the Qwen2.5-Instruct template qwen3b_v4.py falls back to).

The rollout copy is split over each host's 4 chips by heads.
Memory per chip, the largest program and the estimated step time on this slice, as `--mode=compile` prints them:
docs/tpu.md ("The step at expected lengths: the paged engine", its table of every paper config).
"""
from configs import qwen3b_v4 as base


def get_config(retriever_name: str = "e5_device"):
    c = base.get_config(retriever_name)
    c.run_dir = "gs://YOUR_BUCKET/runs/llama3b_base_llds_ma"
    c.model.path = "gs://YOUR_BUCKET/models/Llama-3.2-3B"
    c.model.preset = "llama-3.2-3b"
    c.model.chat_template = ""
    c.rollout.tensor_parallel = -1      # all 4 chips: its 8 key/value heads split without copies
    # Rows in flight as a memory budget (python -m llds_jax.aot.slots configs/llama3b_v4.py --largest_gib 24.24,
    # docs/tpu.md): 256 per host admitted by the pages they hold, steps of up to 4096 tokens (10 rollout programs
    # with evaluation's); the pool 5,800 pages (9.91 GiB per chip: its 8 KV heads make its pages 2x Qwen2.5-3B's),
    # what --mode=compile leaves to the update beside it at >= 10% headroom (slots' 6,104 left it 8.7%).
    c.rollout.max_batch_size, c.rollout.num_pages, c.rollout.max_step_tokens = 256, 5800, 4096
    c.objective.llds.answer_weighting = "adaptive"
    return c
