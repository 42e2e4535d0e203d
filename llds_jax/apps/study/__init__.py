"""The multi-seed study of the demo (python -m llds_jax.apps.demo_study): its design (plan), the runs' scheduling
(runner), the statistics (stats), what each run shows (outcomes), the table (table), the figures (plots) and the
wall-time estimate (budget)."""
