"""Supervised warm start (cold start) on protocol-format demonstrations, before RL."""
