"""One source of bounds (llds_jax.bounds, issues 41 and 57): each run-config key's range or choices is declared once,
with its section's field, and a bad value gets the same message naming the run key whether the run config is
checked, the section is built or a view that takes the key is built."""
import pytest

from llds_jax import bounds, config
from llds_jax.config import ConfigError
from llds_jax.config.sections import ObjectiveConfig
from llds_jax.rollout.config import AgentConfig, PagingConfig, SamplingConfig
from tests.test_config_defaults import dataclasses_of, declared_keys

# A value out of range (or not among the choices) for every declared kind of rule.
BAD = {">= 1": 0, ">= 0": -1, "> 0": 0.0, "in (0, 1]": 1.5, "in [0, 1)": 1.0, "in [0, 1]": 1.5, "> 1": 1.0,
       "0 (off) or >= 1": 0.5, ">= 0 (0: objective.clip_ratio)": -0.1, ">= 0 (or -1: detected)": -2,
       ">= 1 (or -1: all of a host's chips, 0: the training layout)": -2}
SECTIONS = [cls for cls in dataclasses_of() if getattr(cls, "SECTION", None) is not None]


def _bad(rule):
    return "bogus" if isinstance(rule, tuple) else BAD[rule.words]


@pytest.mark.parametrize("section", SECTIONS, ids=lambda c: c.__name__)
def test_a_bad_value_names_the_run_key_in_the_section_and_in_the_run_config(section):
    checked = 0
    for f in bounds.declarations(section):
        rule = f.metadata.get("bound", f.metadata.get("choices"))
        if rule is None:
            continue
        key, bad = bounds.key_of(section, f), _bad(rule)
        message = bounds.problem(key, bad, rule)
        assert message is not None and message.startswith(f"{key} must be ")
        with pytest.raises(ConfigError) as raised:
            section(**{f.name: bad})
        assert str(raised.value) == message
        if key in declared_keys():
            changed = config.default_config()
            changed.model.path = "unused"
            parent, _, name = key.rpartition(".")
            (config.value(changed, parent) if parent else changed)[name] = bad
            with pytest.raises(ConfigError) as raised:
                config.check(changed)  # the value as the run config holds it (an int key of a float field: -1.0)
            assert str(raised.value) == bounds.problem(key, config.value(changed, key), rule)
        checked += 1
    assert checked or section.__name__ in ("RewardConfig", "RetrieverConfig", "MeshConfig") or not list(
        bounds.declared(section))


@pytest.mark.parametrize("view,name", [(AgentConfig, "max_turn_tokens"), (SamplingConfig, "top_p"),
                                       (PagingConfig, "page_size"), (ObjectiveConfig, "temperature")])
def test_a_view_names_the_run_key_it_takes(view, name):
    key, _, rule = next(d for d in bounds.declared(view) if d[1] == name)
    with pytest.raises(ConfigError) as raised:
        view(**{name: _bad(rule)})
    assert str(raised.value) == bounds.problem(key, _bad(rule), rule)
    assert key.startswith("rollout.")


def test_a_non_finite_number_is_refused_with_its_rule():
    assert bounds.problem("optim.learning_rate", float("inf"), bounds.POSITIVE) == (
        "optim.learning_rate must be finite and > 0, got inf")
    assert bounds.problem("optim.learning_rate", 1e-3, bounds.POSITIVE) is None
