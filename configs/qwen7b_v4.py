"""Qwen2.5-7B-Base, GRPO + LLDS (lambda 0.2, action gate), the paper's setup, on a TPU v4-32 slice (16 chips,
32 GiB HBM each, 4 hosts), retrieval through Elasticsearch over wiki-18 (docs/retrieval.md).

Memory per chip with fsdp=16 (params float32 master, bf16 compute):
  params 7.6B x 4 B = 30.5 GB, AdamW m + v 61 GB, gradients 30.5 GB, bf16 reference 15 GB -> 137 GB / 16 = 8.6 GB
  KV cache of one rollout session: 512 sequences x 4096 slots x 28 layers x 4 KV heads x 128 x 2 (k, v) x 2 B
    = 120 GB / 16 = 7.5 GB   (rollout.max_batch_size = 512: the 2560 trajectories run as 5 sessions)
  activations of a 16-trajectory micro-batch with remat: 16 x 4096 x 3584 x 2 B x 28 layers = 13 GB / 16 = 0.8 GB,
    plus one log-prob chunk 16 x 256 x 152064 x 4 B = 2.5 GB / 16
  -> about 18 GB of 32 GB.
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
    return c
