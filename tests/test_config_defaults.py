"""One source of defaults: every field of a typed view that the run config also has takes the schema's default, so
code that builds a view directly (tests, benchmarks) runs what production runs."""
import dataclasses

import pytest

from llds_jax import config as config_lib
from llds_jax.rl.config import LLDSConfig, ObjectiveConfig, UpdateConfig
from llds_jax.rollout.config import AgentConfig, PagingConfig, PartialConfig, SamplingConfig
from llds_jax.sft.config import SFTConfig

# (typed view, its run-config section). ModelConfig is not among them: it is the checkpoint's architecture, and a
# run sets every one of its numerics fields from the `model` section (llds_jax.model.run_overrides).
VIEWS = ((ObjectiveConfig, "objective"), (LLDSConfig, "objective.llds"), (UpdateConfig, "optim"),
         (AgentConfig, "rollout"), (SamplingConfig, "rollout"), (PagingConfig, "rollout"), (PartialConfig, "rollout"),
         (SFTConfig, "sft"))


def _shared_defaults(view, section) -> list[tuple[str, object, object]]:
    """(field, the view's default, the schema's default) of each defaulted field the section also has."""
    schema = config_lib.value(config_lib.default_config(), section)
    return [(f.name, f.default, schema[f.name]) for f in dataclasses.fields(view)
            if f.default is not dataclasses.MISSING and f.name in schema]


@pytest.mark.parametrize("view,section", VIEWS, ids=[view.__name__ for view, _ in VIEWS])
def test_the_views_defaults_are_the_schemas(view, section):
    shared = _shared_defaults(view, section)
    assert len(shared) >= 3  # the section really is the view's
    assert [(name, mine, schema) for name, mine, schema in shared if mine != schema] == []


def test_a_view_built_from_the_default_config_is_the_views_default():
    cfg = config_lib.default_config()
    assert config_lib.objective_config(cfg) == ObjectiveConfig()
    assert config_lib.agent_config(cfg) == AgentConfig()
    assert config_lib.partial_config(cfg) == PartialConfig()
    assert config_lib.sampling_config(cfg, stop_ids=()) == SamplingConfig()
    defaults = dataclasses.replace(config_lib.update_config(cfg), warmup_steps=UpdateConfig.warmup_steps)
    assert defaults == UpdateConfig()
