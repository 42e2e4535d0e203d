"""GRPO + LLDS: advantages, chunked log-probs, loss terms, LLD diagnostics and the train step.

Import from the defining module (`llds_jax.rl.train_step`, `llds_jax.rl.config`, ...): this package imports nothing,
so the jax-free `llds_jax.rl.config` loads without JAX.
"""
