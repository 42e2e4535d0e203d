"""Qwen2.5-7B-Instruct: as qwen7b_v4.py with lambda 0.3 (the paper's setting for this model)."""
from configs import qwen7b_v4 as base


def get_config(retriever_name: str = "e5_device"):
    c = base.get_config(retriever_name)
    c.run_dir = "gs://YOUR_BUCKET/runs/qwen7b_instruct_llds"
    c.model.path = "gs://YOUR_BUCKET/models/Qwen2.5-7B-Instruct"
    c.model.chat_template = "instruct"
    c.objective.llds.lam = 0.3
    return c
