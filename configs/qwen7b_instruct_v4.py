"""Qwen2.5-7B-Instruct: as qwen7b_v4.py with lambda 0.3 (the paper's setting for this model)."""
import importlib.util
import os

_spec = importlib.util.spec_from_file_location("qwen7b_v4", os.path.join(os.path.dirname(__file__), "qwen7b_v4.py"))
_base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_base)


def get_config():
    c = _base.get_config()
    c.run_dir = "gs://YOUR_BUCKET/runs/qwen7b_instruct_llds"
    c.model.path = "gs://YOUR_BUCKET/models/Qwen2.5-7B-Instruct"
    c.model.chat_template = "instruct"
    c.objective.llds.lam = 0.3
    return c
