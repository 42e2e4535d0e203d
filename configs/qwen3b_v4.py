"""Qwen2.5-3B-Instruct, GRPO + LLDS (lambda 0.2, action gate) on a TPU v4-16 slice (8 chips, 2 hosts); data,
retrieval and mesh as qwen7b_v4.py.

Memory per chip with fsdp=8: (3.1B x 16 B for params, AdamW, gradients + 6 GB bf16 reference) / 8 = 7 GB;
KV cache of a 512-sequence session: 512 x 4096 x 36 layers x 2 KV heads x 128 x 2 x 2 B = 77 GB / 8 = 9.7 GB.
"""
import importlib.util
import os

_spec = importlib.util.spec_from_file_location("qwen7b_v4", os.path.join(os.path.dirname(__file__), "qwen7b_v4.py"))
_base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_base)


def get_config():
    c = _base.get_config()
    c.run_dir = "gs://YOUR_BUCKET/runs/qwen3b_instruct_llds"
    c.model.path = "gs://YOUR_BUCKET/models/Qwen2.5-3B-Instruct"
    c.model.chat_template = "instruct"
    c.model.preset = "qwen2.5-3b"
    c.mesh.topology = "v4:2x2x2"
    c.rollout.max_batch_size = 32       # 64 rows do not fit a host's 4 chips (docs/tpu.md)
    return c
