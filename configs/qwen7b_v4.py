"""Qwen2.5-7B-Base, GRPO + LLDS (lambda 0.2, action gate), the paper's setup, on a TPU v4-32 slice (16 chips,
32 GiB HBM each, 4 hosts), retrieval through Elasticsearch over wiki-18 (docs/retrieval.md).

Memory per chip, compiled for v4:2x2x4 (`--mode=compile`, docs/tpu.md): the largest program is the rollout's
observation extend, 20.76 GiB of 30.75 (32% headroom; 25.17 GiB with model.attention=xla); the update 18.79 GiB
(23.88). Each host samples on its own 4 chips, so sessions hold 16 sequences (32 did not fit with the dense
attention; not measured again with the blockwise one). Those figures hold a float32 host-local copy of the
params; with `rollout.params_dtype = "bfloat16"` (below) the extend takes 15.29 GiB and the largest program is the
update, 18.79 GiB (38.9% headroom; docs/tpu.md, "Rollout weights in bfloat16").
"""
from llds_jax.config import default_config


def get_config():
    c = default_config()
    c.run_dir = "gs://YOUR_BUCKET/runs/qwen7b_base_llds"
    c.model.path = "gs://YOUR_BUCKET/models/Qwen2.5-7B"
    c.model.chat_template = "base"
    c.model.preset = "qwen2.5-7b"
    c.mesh.topology = "v4:2x2x4"
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, -1, 1
    c.data.train_files = ["gs://YOUR_BUCKET/data/nq_hotpotqa_train/train.parquet"]
    c.data.eval_files = ["gs://YOUR_BUCKET/data/nq_hotpotqa_train/test.parquet"]
    c.retriever = c.retriever.__class__({"backend": "elasticsearch", "hosts": "https://YOUR_ES_HOST:9200",
                                         "index": "wiki18"})
    c.rollout.max_batch_size = 16       # sessions of 16 rows: 32 do not fit a host's 4 chips (docs/tpu.md)
    c.rollout.params_dtype = "bfloat16"  # each host's rollout copy of the params: half of the float32 one
    return c
