"""The learn-then-collapse calibration of issue 40 (docs/evidence.md): the stress setting (configs/demo_cpu_grpo.py:
8 updates per rollout batch of 64, no warmup, GRPO) for 60 steps with a greedy test evaluation every 10, at the
learning rate given after the file name (default 6e-4: between the collapse study's 4e-4, which learned and did not
collapse in 30 steps, and its 1e-3, which blew up at once):

    python -m llds_jax.launch --config=configs/demo_cpu_late_collapse.py:7e-4
    python -m llds_jax.apps.demo_study --settings lr5e4=configs/demo_cpu_late_collapse.py:5e-4,... --arms grpo
"""
from configs import demo_cpu_grpo as base


def get_config(learning_rate: str = ""):
    c = base.get_config()
    c.run_dir = "runs/demo_cpu_late_collapse"
    c.optim.learning_rate = float(learning_rate) if learning_rate else 6e-4
    c.train.total_steps = 60
    c.train.eval_every = 10
    return c
