"""The good-learning-rate calibration of issue 56 (docs/evidence.md): the late-collapse setting's stress shape
(configs/demo_cpu_late_collapse.py: 8 updates per rollout batch of 64, no warmup, a greedy test evaluation every 10
steps) at the learning rate given after the file name (default 2e-4, where GRPO trained best in issue 40's study),
for 200 steps instead of 60: does GRPO at a good learning rate decline late?

    python -m llds_jax.apps.demo_study --settings long_lr2e4=configs/demo_cpu_long_horizon.py:2e-4 \\
        --seeds 0-3 --arms grpo --out runs/long_calib
"""
from configs import demo_cpu_late_collapse as late_collapse


def get_config(learning_rate: str = "2e-4"):
    c = late_collapse.get_config(learning_rate)
    c.run_dir = "runs/demo_cpu_long_horizon"
    c.train.total_steps = 200
    return c
