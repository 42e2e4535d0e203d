"""llds_jax: search-augmented RL of LLMs with GRPO + LLDS (arXiv 2512.04220), in JAX."""
