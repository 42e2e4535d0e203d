"""The demo world with the update schedule of the paper's code scaled down (docs/method.md, "Updates per
batch"): 10 optimizer updates per rollout batch, each mini-batch several whole GRPO groups, and a linear learning-
rate warmup over 28.5% of the steps. Same world, warm start (shared runs/demo_world) and seed as configs/demo_cpu.py.

    python -m llds_jax.launch --config=configs/demo_cpu_paper.py
    python -m llds_jax.apps.demo_study --settings paper_shaped  # the study's "paper_shaped" setting

The paper: 512 prompts x 5 samples = 2560 trajectories, mini-batches of 256 (10 updates, 51.2 groups each), micro-
batches of 16, lr 0 -> 1e-6 over 28.5% of 1005 steps, then constant. Scaled to the demo, 10 updates of whole groups
need a rollout batch of 10 x (groups per mini-batch) x (group size). 20 prompts x 4 samples = 80 trajectories (1.25x
the demo's 64: the rollout, which dominates a CPU step, costs about 1.25x) gives mini-batches of 8 = 2 groups each.
The alternatives cost more or keep one group per update: 16 x 5 = 80 with mini-batches of 8 splits groups across
updates (1.6 groups each, as the paper's 51.2 do); 10 x 8 = 80 has one group per update (the stress setting's
shape); 3 groups of 4 need 120 trajectories (1.9x). Groups of 4 (the paper: 5, the demo: 8) leave more groups with
all rewards equal (zero advantage). The peak learning rate is the demo's 2e-4 (reached after floor(0.285 x
total_steps) steps: 5 of 20), micro-batches of 8 (one update's whole mini-batch).
"""
from configs import demo_cpu as base


def get_config():
    c = base.get_config()
    c.run_dir = "runs/demo_cpu_paper"
    c.data.prompts_per_step = 20
    c.data.samples_per_prompt = 4
    c.optim.mini_batch_size = 8         # 10 updates per rollout batch of 80, 2 groups of 4 each
    c.optim.micro_batch_size = 8
    c.optim.learning_rate = 2e-4
    c.optim.warmup_ratio = 0.285        # docs/method.md: lr = base * step / warmup_steps over 28.5% of the steps
    return c
