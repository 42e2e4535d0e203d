"""Qwen2.5-3B-Instruct, GRPO + LLDS (lambda 0.2, action gate) on a TPU v4-16 slice (8 chips, 2 hosts).

Memory per chip with fsdp=8: (3.1B x 16 B for params, AdamW, gradients + 6 GB bf16 reference) / 8 = 7 GB;
KV cache of a 512-sequence session: 512 x 4096 x 36 layers x 2 KV heads x 128 x 2 x 2 B = 77 GB / 8 = 9.7 GB.
"""
from llds_jax.config import default_config


def get_config():
    c = default_config()
    c.run_dir = "gs://YOUR_BUCKET/runs/qwen3b_instruct_llds"
    c.model.path = "gs://YOUR_BUCKET/models/Qwen2.5-3B-Instruct"
    c.model.chat_template = "instruct"
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, -1, 1
    c.data.train_files = ["gs://YOUR_BUCKET/data/nq_hotpotqa_train/train.parquet"]
    c.data.eval_files = ["gs://YOUR_BUCKET/data/nq_hotpotqa_train/test.parquet"]
    c.retriever = c.retriever.__class__({"backend": "elasticsearch", "hosts": "https://YOUR_ES_HOST:9200",
                                         "index": "wiki18"})
    c.rollout.max_batch_size = 512
    return c
