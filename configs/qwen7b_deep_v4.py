"""qwen7b_v4.py (Qwen2.5-7B-Base, GRPO + LLDS, the paper's retriever on the chips, TPU v4-32) over a long horizon
(issue 69): up to 32 search turns in contexts of up to 8,192 tokens, the three most recent observations kept whole
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
    # 16,384-token contexts do not fit v4's 32 GiB: the update of a 16K-token sequence per chip needs 32.77 GiB
    # (docs/tpu.md); 8,192 is what one chip's share of a micro-batch of 16 takes.
    c.rollout.max_context_tokens = c.rollout.max_response_tokens = 8192
    c.rollout.context_policy, c.rollout.keep_observations = "drop_observations", 3
    c.optim.micro_batch_size = 16  # one training row per chip of the 16
    return c
