"""qwen7b_v4.py (Qwen2.5-7B-Base, GRPO + LLDS, the paper's retriever on the chips) on a TPU v6e-16 slice (v6e:4x4,
16 chips of 32 GiB HBM, 4 hosts of 4 chips): v6e has v4's HBM per chip, so the same global batch and model need the
same 16 chips, each host sampling its 640 trajectories on its own 4 chips (the rollout copy split over them by heads
and MLP width, as on v4). Only the topology and what the chip's peaks choose differ from qwen7b_v4.py: the attention
tiles and step budget by the kernel-faithful estimate at v6e peaks (`python -m llds_jax.aot.tiles
configs/qwen7b_v6e.py`). Memory per chip and the expected step: docs/tpu.md ("qwen7b on v5p and v6e").
"""
from configs import qwen7b_v4 as base


def get_config(retriever_name: str = "e5_device"):
    c = base.get_config(retriever_name)
    c.run_dir = "gs://YOUR_BUCKET/runs/qwen7b_base_llds_v6e"
    c.mesh.topology = "v6e:4x4"
    # The slots, pool and step budget are qwen7b_v4.py's (256 rows per host, 10,752 pages: the same HBM per chip).
    # The attention tiles at this chip's peaks for that schedule (python -m llds_jax.aot.tiles configs/qwen7b_v6e.py,
    # docs/tpu.md): kv blocks of 8 pages (512 slots) x q blocks of 32 tokens in the ragged forwards (16 x 32 on v4),
    # 8 x 8 in decode.
    c.rollout.kv_pages_per_block, c.rollout.queries_per_block = 8, 32
    return c
