"""qwen7b_v4.py (Qwen2.5-7B-Base, GRPO + LLDS, the paper's retriever on the chips) on a TPU v5p-16 slice
(v5p:2x2x2, 8 chips of 95 GiB HBM, 2 hosts of 4 chips): the smallest v5p slice of several hosts that holds the same
global batch and model with headroom (its 8 chips hold 760 GiB against v4-32's 512), each host sampling 1280
trajectories on its own 4 chips (the rollout copy split over them by heads and MLP width, as on v4). Only the
topology and what the chip's HBM and peaks choose differ from qwen7b_v4.py: the sequence slots, page pool, step
budget and attention tiles by the kernel-faithful estimate at v5p peaks within the chip's HBM (`python -m
llds_jax.aot.slots`, `python -m llds_jax.aot.tiles`). Memory per chip and the expected step: docs/tpu.md ("qwen7b
on v5p and v6e").
"""
from configs import qwen7b_v4 as base


def get_config(retriever_name: str = "e5_device"):
    c = base.get_config(retriever_name)
    c.run_dir = "gs://YOUR_BUCKET/runs/qwen7b_base_llds_v5p"
    c.mesh.topology = "v5p:2x2x2"
    # Rows in flight as a memory budget (python -m llds_jax.aot.slots, docs/tpu.md): 256 slots per host (1280
    # trajectories each), a pool of every slot's worst case (16,385 pages, 14 GiB per chip: no preemption on 95 GiB),
    # steps of up to 4096 tokens; tiles at v5p peaks for that schedule (python -m llds_jax.aot.tiles): kv blocks of
    # 8 pages (512 slots) x q blocks of 16 tokens in the ragged forwards (16 x 32 on v4), 8 x 8 in decode.
    c.rollout.max_batch_size, c.rollout.num_pages, c.rollout.max_step_tokens = 256, 0, 4096
    c.rollout.kv_pages_per_block, c.rollout.queries_per_block = 8, 16
    c.rollout.decode_kv_pages_per_block, c.rollout.decode_queries_per_block = 8, 8
    return c
