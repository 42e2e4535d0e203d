"""Applications on top of the library: they import it; no module of the library imports them.

- `demo` (with its config section in `demo_config`): a self-contained run on one machine, a generated search world,
  its BM25 index, tokenizer, random policy and demonstrations. A run config joins it with `app =
  "llds_jax.apps.demo"` and a `demo` section (configs/demo_cpu.py); the launcher calls it through the hook of
  llds_jax.application.
- `demo_compare` (python -m llds_jax.apps.demo_compare): GRPO vs GRPO + LLDS on the demo.
- `demo_study` and `study/` (python -m llds_jax.apps.demo_study): the multi-seed study of the demo.
"""
