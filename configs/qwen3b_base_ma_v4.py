"""Qwen2.5-3B-Base with LLDS-MA (adaptive answer masking, the code's beta = 0.2 * max(V - 1, 0)): the model that
collapses to one search per question in the paper."""
from configs import qwen3b_v4 as base


def get_config(retriever_name: str = "e5_device"):
    c = base.get_config(retriever_name)
    c.run_dir = "gs://YOUR_BUCKET/runs/qwen3b_base_llds_ma"
    c.model.path = "gs://YOUR_BUCKET/models/Qwen2.5-3B"
    c.model.chat_template = "base"
    c.objective.llds.answer_weighting = "adaptive"
    return c
