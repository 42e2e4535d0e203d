"""Llama-3.2-3B-Base with LLDS-MA (adaptive) on a TPU v4-16 slice.

Prompt as in Search-R1: the tokenizer's own chat template when it has one, else the raw Search-R1 prompt
(`model.chat_template = ""`: never the Qwen2.5-Instruct template qwen3b_v4.py falls back to).

Memory per chip, compiled for v4:2x2x2 (`--mode=compile`, docs/tpu.md, 2026-12-03): the largest program is the
rollout's compaction, 26.79 GiB of 30.75 (13% headroom), with sessions of 64 sequences split over each host's 4
chips by heads; the update 13.46 GiB.
"""
from configs import qwen3b_v4 as base


def get_config(retriever_name: str = "e5_device"):
    c = base.get_config(retriever_name)
    c.run_dir = "gs://YOUR_BUCKET/runs/llama3b_base_llds_ma"
    c.model.path = "gs://YOUR_BUCKET/models/Llama-3.2-3B"
    c.model.preset = "llama-3.2-3b"
    c.model.chat_template = ""
    c.rollout.tensor_parallel = -1      # all 4 chips: its 8 key/value heads split without copies
    c.rollout.max_batch_size = 64       # 64 rows in flight: 8 KV heads make its pages 2x Qwen2.5-3B's
    c.rollout.max_step_tokens = 512     # step programs at 64, 128, 256 and 512 tokens: 8 with evaluation's
    c.objective.llds.answer_weighting = "adaptive"
    return c
