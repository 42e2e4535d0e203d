"""Vanilla GRPO (LLDS off) with everything else as qwen7b_v4.py: the baseline that collapses in the paper.

This is *not* the setting behind the paper's GRPO row (Qwen2.5-7B-Base .350 in its table): that row is copied from
Search-R1, whose GRPO runs trained with 4 search turns (a final turn follows) instead of the paper's 3, and whose
reported number is the best checkpoint before the collapse, not the end of training. The default config trains
GRPO exactly as the LLDS runs (3 turns, 1005 steps), the controlled comparison; its final EM after a collapse is
far below .350.

Variants (`--config=configs/grpo_baseline_v4.py:NAME[,NAME]`):
- a retriever name of qwen7b_v4.py (e5_device default, e5, e5_hnsw, e5_es, bm25_es, bm25);
- search_r1: the setting of the paper's GRPO row: `rollout.max_turns = 4` in training (the periodic evaluation
  every 50 steps, Search-R1's test_freq, is every paper config's: a fixed subset stratified over data sources,
  `train.eval_max_examples`). Compare the best `eval/em_mean` before the collapse with the row (`report` prints
  each run's best periodic evaluation). With 4 turns the training sequences are
  longer: its memory per chip was not measured with `--mode=compile`.
"""
from configs import qwen7b_v4 as base

SEARCH_R1 = "search_r1"


def get_config(names: str = "e5_device"):
    """The baseline; `names`: comma-separated, at most one retriever name (default e5_device) and optionally
    search_r1."""
    chosen = [name.strip() for name in names.split(",") if name.strip()]
    retrievers = [name for name in chosen if name != SEARCH_R1]
    if len(retrievers) > 1:
        raise ValueError(f"at most one retriever name, got {', '.join(retrievers)} (--config=CONFIG.py:NAME)")
    c = base.get_config(retrievers[0] if retrievers else "e5_device")
    c.run_dir = "gs://YOUR_BUCKET/runs/qwen7b_base_grpo"
    c.objective.llds.enabled = False
    if SEARCH_R1 in chosen:
        c.run_dir = "gs://YOUR_BUCKET/runs/qwen7b_base_grpo_search_r1"
        c.rollout.max_turns = 4
    return c
