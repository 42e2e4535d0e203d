"""Run configs: each file's `get_config()` returns a whole run config (llds_jax.config.default_config() changed).

A config that builds on another imports it, e.g. `from configs import qwen7b_v4 as base`. `python -m llds_jax.launch`
makes this package importable from the config file's own folder, whatever the working directory; the tests import
it from the repo root (pytest.ini's pythonpath).
"""
