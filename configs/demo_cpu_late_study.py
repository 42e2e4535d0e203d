"""The learn-then-collapse regime of issue 40's pre-registered study (docs/evidence.md): the stress setting
(configs/demo_cpu_grpo.py: 8 updates per rollout batch of 64, no warmup) at lr 5e-4 with a greedy test evaluation
every 10 steps, as the calibration's lr 5e-4 runs (configs/demo_cpu_late_collapse.py:5e-4: every seed learned, 2 of
4 collapsed, at steps 46 and 52), for 80 steps instead of 60 (the other two were still declining at 60).

    python -m llds_jax.apps.demo_study --settings late_collapse --seeds 4-11 \\
        --arms grpo,llds,llds_lam1,grpo_low_lr,grpo_clip_higher --out runs/late_study
"""
from configs import demo_cpu_late_collapse as calibration


def get_config():
    c = calibration.get_config("5e-4")
    c.run_dir = "runs/demo_cpu_late_study"
    c.train.total_steps = 80
    return c
