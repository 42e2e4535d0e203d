"""qwen7b_v4.py (Qwen2.5-7B-Base, GRPO + LLDS, the paper's retriever on the chips, TPU v4-32) over a long horizon
(issue 69): up to 32 search turns in contexts of up to 6,144 tokens, the three most recent observations kept whole
and older ones dropped (`rollout.context_policy = "drop_observations"`: each drop starts a new segment, trained
under the context it was sampled in). Retrievers as qwen7b_v4.py (`--config=configs/qwen7b_deep_v4.py:NAME`).

Memory per chip, the largest program and the expected step with the partial-rollouts what-if, as `--mode=compile`
prints them: docs/tpu.md ("A long horizon on v4-32").
"""
from configs import qwen7b_v4 as base


def get_config(retriever_name: str = "e5_device"):
    c = base.get_config(retriever_name)
    c.run_dir = "gs://YOUR_BUCKET/runs/qwen7b_base_llds_deep"
    c.rollout.max_turns = 32
    # The update holds one row of the context cap per chip (micro-batch 16 on 16 chips): at 16,384 tokens it needs
    # 32.77 GiB of v4's 30.75, at 8,192 29.22 GiB (5% headroom); 6,144 with the MLP 8 slices at a time takes
    # 27.67 GiB, 10% headroom (docs/tpu.md, "A long horizon on v4-32").
    c.rollout.max_context_tokens = c.rollout.max_response_tokens = 6144
    c.model.mlp_chunks = 8
    c.rollout.context_policy, c.rollout.keep_observations = "drop_observations", 3
    c.optim.micro_batch_size = 16  # one training row per chip of the 16
    return c
