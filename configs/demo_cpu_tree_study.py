"""The setting of issue 42's pre-registered chain-vs-tree study (docs/tree-rollouts.md): the demo's default
(configs/demo_cpu.py: lr 2e-4, 8 prompts x 8 samples, 4 updates per step, 20 steps) with a greedy test evaluation
every 5 steps, so that exact match can be drawn against the tokens generated.

    python -m llds_jax.apps.demo_study --settings tree_study --seeds 1-8 \\
        --arms llds,llds_trees,llds_trees_wide,llds_trees_quarter --out runs/tree_study
"""
from configs import demo_cpu


def get_config():
    c = demo_cpu.get_config()
    c.run_dir = "runs/demo_cpu_tree_study"
    c.train.eval_every = 5
    return c
