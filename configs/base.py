"""Paper defaults (docs/method.md): GRPO + LLDS, code-exact.

Every model/hardware config starts from this one and changes only what differs.
Override any key on the command line: `--config.objective.llds.lam=0.1`.
"""
from llds_jax.config import default_config


def get_config():
    return default_config()
