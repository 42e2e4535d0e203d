"""The collapse regime of the pre-registered study of issue 33 (docs/evidence.md): the stress setting
(configs/demo_cpu_grpo.py: 8 updates per rollout batch of 64, no warmup) at twice its learning rate, 1e-3, for 30
steps. Chosen from GRPO runs only (seeds 0 and 1, 40 steps: both collapsed, at steps 19 and 5), which the study
then leaves out of its seeds.

    python -m llds_jax.apps.demo_study --settings collapse --seeds 2-9 \\
        --arms grpo,llds,llds_low_lr,grpo_low_lr,grpo_clip_higher,grpo_tis --out runs/collapse_study
"""
from configs import demo_cpu_grpo as base


def get_config():
    c = base.get_config()
    c.run_dir = "runs/demo_cpu_collapse"
    c.optim.learning_rate = 1e-3
    c.train.total_steps = 30
    return c
