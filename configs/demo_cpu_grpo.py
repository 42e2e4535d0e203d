"""GRPO without LLDS on the demo world, with settings that stress stability: twice the updates per rollout batch
(8) and 2.5x the learning rate of configs/demo_cpu.py. Same world, warm start (shared runs/demo_world) and seed.

    python -m llds_jax.apps.demo_compare     # this config with LLDS off, then on; then the comparison report
    python -m llds_jax.apps.demo_study       # the multi-seed study's "stress" setting (docs/evidence.md)
"""
from configs import demo_cpu as base


def get_config():
    c = base.get_config()
    c.run_dir = "runs/demo_cpu_grpo"
    c.objective.llds.enabled = False
    c.optim.mini_batch_size = 8         # 8 updates per rollout batch of 64
    c.optim.micro_batch_size = 8
    c.optim.learning_rate = 5e-4
    return c
