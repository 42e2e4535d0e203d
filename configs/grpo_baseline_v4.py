"""Vanilla GRPO (LLDS off) with everything else as qwen7b_v4.py: the baseline that collapses in the paper."""
import importlib.util
import os

_spec = importlib.util.spec_from_file_location("qwen7b_v4", os.path.join(os.path.dirname(__file__), "qwen7b_v4.py"))
_base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_base)


def get_config():
    c = _base.get_config()
    c.run_dir = "gs://YOUR_BUCKET/runs/qwen7b_base_grpo"
    c.objective.llds.enabled = False
    return c
