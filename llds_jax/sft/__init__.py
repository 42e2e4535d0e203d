"""Supervised warm start (cold start) on protocol-format demonstrations, before RL."""
from llds_jax.sft.demonstrations import Demonstration, encode, read_demonstrations, write_demonstrations
from llds_jax.sft.stage import SFTConfig, warm_start

__all__ = ["Demonstration", "SFTConfig", "encode", "read_demonstrations", "warm_start", "write_demonstrations"]
