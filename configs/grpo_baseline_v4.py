"""Vanilla GRPO (LLDS off) with everything else as qwen7b_v4.py: the baseline that collapses in the paper."""
from configs import qwen7b_v4 as base


def get_config(retriever_name: str = "e5"):
    c = base.get_config(retriever_name)
    c.run_dir = "gs://YOUR_BUCKET/runs/qwen7b_base_grpo"
    c.objective.llds.enabled = False
    return c
