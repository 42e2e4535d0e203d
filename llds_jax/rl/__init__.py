"""GRPO + LLDS: advantages, chunked log-probs, loss terms, LLD diagnostics and the train step.

Import from the defining module (`llds_jax.rl.train_step`, `llds_jax.rl.losses`, ...): this package imports nothing.
Its settings (`ObjectiveConfig`, `LLDSConfig`, `UpdateConfig`) are run-config sections: `llds_jax.config.sections`.
"""
