"""The demo's run-config section (`demo`) and its checks: what a config file adds to join the demo, without JAX.

    c = default_config()
    c.app = demo_config.APP
    c.demo = demo_config.section()
    c.demo.enabled = True

llds_jax.apps.demo (the application module `app` names) offers these to the launcher (llds_jax.application).
"""
from __future__ import annotations

import dataclasses

import ml_collections
from ml_collections import config_dict

from llds_jax import bounds
from llds_jax import config as config_lib
from llds_jax.bounds import AT_LEAST_1, POSITIVE, UNIT_INTERVAL, field
from llds_jax.config import ConfigError

APP = "llds_jax.apps.demo"  # the run config's `app` value of the demo

# The demo's tokenizers: the real Qwen2.5 one, or a BPE trained on its generated world.
DEMO_TOKENIZERS = ("qwen2.5", "world")
# The demo's generated worlds: single- and two-hop questions (llds_jax.data.synthetic), or k-hop ones, k = 1..6,
# each needing k searches (llds_jax.data.khop; its evaluation's EM per data_source is EM by hop count, hop_k).
DEMO_WORLDS = ("two_hop", "khop")
# The demo's retrievers: BM25 over the world, or its e5 Flat index searched on the devices (backend e5_device).
DEMO_RETRIEVERS = ("bm25", "e5_device")


@dataclasses.dataclass(frozen=True)
class DemoConfig(bounds.Section):
    """The `demo` section: self-contained assets (llds_jax.apps.demo); off for real runs."""

    SECTION = "demo"

    enabled: bool = field(False, doc="build the demo's world, index, tokenizer, policy and demonstrations")
    assets_dir: str = field("", doc="where they go (\"\": <run_dir>/assets; runs may share one)")
    world: str = field("two_hop", choices=DEMO_WORLDS, doc="the generated world: single- and two-hop questions, "
                                                           "or k-hop ones (k = 1..6, EM by hop count)")
    num_people: int = field(200, AT_LEAST_1, doc="people of the generated world")
    tokenizer: str = field("qwen2.5", choices=DEMO_TOKENIZERS,
                           doc="the real Qwen2.5 tokenizer, or a BPE trained on the generated world")
    vocab_size: int = field(2048, AT_LEAST_1, doc="entries of the world tokenizer")
    search_fraction: float = field(0.3, UNIT_INTERVAL, doc="share of demonstrations that search (the rest guess)")
    hidden_size: int = field(64, AT_LEAST_1, doc="the random policy's width")
    num_layers: int = field(2, AT_LEAST_1, doc="the random policy's layers")
    num_heads: int = field(4, AT_LEAST_1, doc="the random policy's attention heads")
    num_kv_heads: int = field(2, AT_LEAST_1, doc="the random policy's key/value heads")
    intermediate_size: int = field(128, AT_LEAST_1, doc="the random policy's MLP width")
    initializer_range: float = field(0.02, POSITIVE, doc="std of the random policy's initial weights "
                                                         "(model.initializer_range)")
    retriever: str = field("bm25", choices=DEMO_RETRIEVERS, doc="BM25 over the world, or its e5 Flat index searched "
                                                                "on the devices (e5_device)")
    encoder_path: str = field("", doc="e5 folder of demo.retriever e5_device (\"\": a small random BERT, "
                                      "written into the assets)")


def per_retriever(c: ml_collections.ConfigDict, path: str) -> config_dict.FieldReference:
    """`path` for the BM25 demo, `<path>_<demo.retriever>` for another retriever, as a value ml_collections
    computes when it is read: a variant given on the command line (`--config.demo.retriever=e5_device`) gets
    folders of its own and never writes into the BM25 demo's (issue 66); a key set itself (`--config.run_dir=...`)
    keeps what it is set to."""
    return c.demo.get_ref("retriever")._apply_op(_variant_path, path)


def _variant_path(retriever: str, path: str) -> str:
    return path if retriever == "bm25" else f"{path}_{retriever}"


def section() -> ml_collections.ConfigDict:
    """The `demo` section at its defaults (llds_jax.apps.demo reads it)."""
    return config_lib.as_config_dict(DemoConfig())


def config_sections() -> dict[str, ml_collections.ConfigDict]:
    return {"demo": section()}


def check_config(cfg: ml_collections.ConfigDict) -> None:
    """The `demo` section's bounds and choices (and a k-hop world's least people); ConfigError naming the key."""
    if "demo" not in cfg:
        raise ConfigError(f"app {APP!r} needs the config section 'demo' (llds_jax.apps.demo_config.section())")
    demo = config_lib.build(DemoConfig, cfg.demo)
    if demo.world == "khop":
        from llds_jax.data.khop import MIN_PEOPLE  # the generator's modules only for its world
        if demo.num_people < MIN_PEOPLE:
            raise ConfigError(f"demo.num_people must be at least {MIN_PEOPLE} with demo.world 'khop' (a k-hop world "
                              f"draws its chains among them), got {demo.num_people}")


def provided_keys(cfg: ml_collections.ConfigDict) -> tuple[str, ...]:
    """With `demo.enabled`, the demo points model.path at its generated policy, the data files and the retriever
    (the section) at its world, and the warm start's empty file lists at its demonstrations (llds_jax.apps.demo
    `prepare`)."""
    if not cfg.demo.enabled:
        return ()
    sft = cfg.sft
    return ("model.path", "data.train_files", "data.eval_files", "retriever",
            *(("sft.data_files",) if sft.enabled and not sft.data_files else ()),
            *(("sft.curriculum_files",) if sft.enabled and sft.curriculum_steps and not sft.curriculum_files else ()))


def paths(cfg: ml_collections.ConfigDict) -> dict[str, str]:
    return {"demo.assets_dir": cfg.demo.assets_dir}
