"""A tiny world-tokenizer demo (assets and run config) shared by the warm-start tests."""
import pytest

from llds_jax.apps import demo, demo_config
from llds_jax.config import default_config


def tiny_world_config(run_dir: str, assets_dir: str):
    c = default_config()
    c.run_dir = run_dir
    c.app = demo_config.APP
    c.demo = demo_config.section()
    c.demo.enabled = True
    c.demo.assets_dir = assets_dir
    c.demo.tokenizer = "world"
    c.demo.vocab_size = 512
    c.demo.num_people = 12
    c.demo.hidden_size = 32
    c.demo.num_layers = 1
    c.demo.intermediate_size = 64
    c.demo.search_fraction = 0.5
    c.model.dtype = "float32"
    c.model.remat = False
    c.mesh.fsdp = -1  # the 8 test devices
    c.rollout.retrieval_top_k = 1
    c.rollout.max_prompt_tokens = 256
    c.sft.enabled = True
    c.sft.steps = 3
    c.sft.batch_size = 8
    c.sft.warmup_steps = 1
    c.sft.log_every = 1
    c.optim.logp_time_chunk = 64
    return c


@pytest.fixture(scope="session")
def world_demo(tmp_path_factory):
    """(config factory(run_dir), prepared config): a tiny world with a trained tokenizer and demonstrations."""
    assets = str(tmp_path_factory.mktemp("world_assets"))

    def make(run_dir):
        cfg = tiny_world_config(str(run_dir), assets)
        demo.prepare(cfg)
        return cfg

    return make
