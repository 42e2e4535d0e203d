"""The demo's run-config section (`demo`) and its checks: what a config file adds to join the demo, without JAX.

    c = default_config()
    c.app = demo_config.APP
    c.demo = demo_config.section()
    c.demo.enabled = True

llds_jax.apps.demo (the application module `app` names) offers these to the launcher (llds_jax.application).
"""
from __future__ import annotations

import ml_collections

from llds_jax import config as config_lib
from llds_jax.config import ConfigError

APP = "llds_jax.apps.demo"  # the run config's `app` value of the demo

# The demo's tokenizers: the real Qwen2.5 one, or a BPE trained on its generated world.
DEMO_TOKENIZERS = ("qwen2.5", "world")
# The demo's retrievers: BM25 over the world, or its e5 Flat index searched on the devices (backend e5_device).
DEMO_RETRIEVERS = ("bm25", "e5_device")


def section() -> ml_collections.ConfigDict:
    """The `demo` section at its defaults (llds_jax.apps.demo reads it)."""
    d = ml_collections.ConfigDict()     # self-contained assets (llds_jax.apps.demo); off for real runs
    d.enabled = False
    d.assets_dir = ""                   # default <run_dir>/assets (runs may share one)
    d.num_people = 200
    d.tokenizer = "qwen2.5"             # or "world": a BPE trained on the generated world (llds_jax.apps.demo)
    d.vocab_size = 2048                 # entries of the world tokenizer
    d.search_fraction = 0.3             # share of demonstrations that search (the rest guess)
    d.hidden_size = 64
    d.num_layers = 2
    d.num_heads = 4
    d.num_kv_heads = 2
    d.intermediate_size = 128
    d.initializer_range = 0.02          # std of the random policy's initial weights (model.initializer_range)
    d.retriever = "bm25"                # or "e5_device": the world's e5 Flat index searched on the devices
    d.encoder_path = ""                 # e5 folder of demo.retriever e5_device; "": a small random BERT (needs torch)
    return d


def config_sections() -> dict[str, ml_collections.ConfigDict]:
    return {"demo": section()}


_BOUNDS = (
    (("demo.num_people", "demo.vocab_size", "demo.hidden_size", "demo.num_layers", "demo.num_heads",
      "demo.num_kv_heads", "demo.intermediate_size"), lambda v: v >= 1, ">= 1"),
    (("demo.initializer_range",), lambda v: v > 0, "> 0"),
    (("demo.search_fraction",), lambda v: 0 <= v <= 1, "in [0, 1]"),
)


def check_config(cfg: ml_collections.ConfigDict) -> None:
    """The `demo` section's bounds and choices; ConfigError naming the key."""
    if "demo" not in cfg:
        raise ConfigError(f"app {APP!r} needs the config section 'demo' (llds_jax.apps.demo_config.section())")
    config_lib.check_bounds(cfg, _BOUNDS)
    config_lib.check_choice(cfg, "demo.tokenizer", DEMO_TOKENIZERS)
    config_lib.check_choice(cfg, "demo.retriever", DEMO_RETRIEVERS)


def provided_keys(cfg: ml_collections.ConfigDict) -> tuple[str, ...]:
    """With `demo.enabled`, the demo points model.path at its generated policy."""
    return ("model.path",) if cfg.demo.enabled else ()


def paths(cfg: ml_collections.ConfigDict) -> dict[str, str]:
    return {"demo.assets_dir": cfg.demo.assets_dir}
