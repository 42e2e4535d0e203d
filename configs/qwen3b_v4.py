"""Qwen2.5-3B-Instruct, GRPO + LLDS (lambda 0.2, action gate) on a TPU v4-16 slice (8 chips, 2 hosts); data,
retrieval and mesh as qwen7b_v4.py.

Each host samples its sequences on its 4 chips as two tensor-parallel pairs (heads split over a pair, rows over the
pairs: split over all 4 chips, its 2 key/value heads would be held twice each): each pair computes its own half of
the layers' rows and decodes its own half of the sequences (`Transformer.batched_ragged_step`).
Memory per chip, the largest program and the estimated step time on this slice, as `--mode=compile` prints them:
docs/tpu.md ("The step at expected lengths: the paged engine", its table of every paper config).
"""
from configs import qwen7b_v4 as base


def get_config(retriever_name: str = "e5_device"):
    c = base.get_config(retriever_name)
    c.run_dir = "gs://YOUR_BUCKET/runs/qwen3b_instruct_llds"
    c.model.path = "gs://YOUR_BUCKET/models/Qwen2.5-3B-Instruct"
    c.model.chat_template = "instruct"
    c.model.preset = "qwen2.5-3b"
    c.mesh.topology = "v4:2x2x2"
    c.rollout.tensor_parallel = 2       # pairs of chips: 2 key/value heads split, not repeated (docs/tpu.md)
    c.rollout.max_batch_size = 128      # 128 rows in flight per host, 64 decoded by each pair
    c.rollout.kv_pages_per_block = 8    # kv blocks of 512 slots in the ragged forwards (python -m llds_jax.aot.tiles)
    return c
