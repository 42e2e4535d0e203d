"""One source of bounds (llds_jax.bounds, issue 41): each run-config key's range or choices is declared once, by the
typed view that has the field or else in llds_jax.config, and a bad value gets the same message naming the run key
whether the run config is checked or the view is built."""
import dataclasses

import pytest

from llds_jax import bounds, config

# A value out of range (or not among the choices) for every declared kind of rule.
BAD = {">= 1": 0, ">= 0": -1, "> 0": 0.0, "in (0, 1]": 1.5, "in [0, 1)": 1.0, "> 1": 1.0,
       "0 (off) or >= 1": 0.5, ">= 0 (0: objective.clip_ratio)": -0.1, "0 (any) or a power of two": 3}


def _view_keys() -> dict[str, list[str]]:
    """Run key -> the views declaring it."""
    keys: dict[str, list[str]] = {}
    for view in config.VIEWS:
        for key, _, _ in bounds.declared(view):
            keys.setdefault(key, []).append(view.__name__)
    return keys


def test_no_key_is_bounded_in_two_places():
    in_config = [key for keys, _, _ in config._BOUNDS for key in keys] + list(config._CHOICES)
    assert len(in_config) == len(set(in_config))
    declared = _view_keys()
    run_keys = {key for key in declared if config.has(config.default_config(), key)}
    assert {key: views for key, views in declared.items() if key in run_keys and len(views) > 1} == {}
    assert sorted(run_keys & set(in_config)) == []
    assert len(run_keys) > 40  # the views hold most bounds (rollout, objective, optim, sft)


@pytest.mark.parametrize("view", config.VIEWS, ids=lambda v: v.__name__)
def test_a_bad_value_names_the_run_key_in_the_view_and_in_the_run_config(view):
    cfg = config.default_config()
    cfg.model.path, cfg.run_dir = "unused", "unused"
    checked = 0
    for key, name, rule in bounds.declared(view):
        bad = "bogus" if isinstance(rule, tuple) else BAD[rule.words]
        message = bounds.problem(key, bad, rule)
        assert message is not None and message.startswith(f"{key} must be ")
        required = {f.name: ("x",) for f in dataclasses.fields(view) if f.default is dataclasses.MISSING and
                    f.default_factory is dataclasses.MISSING}
        with pytest.raises(ValueError) as raised:
            view(**{**required, name: bad})
        assert str(raised.value) == message
        if config.has(cfg, key):
            changed = config.default_config()
            changed.model.path, changed.run_dir = "unused", "unused"
            section, _, field = key.rpartition(".")
            config.value(changed, section)[field] = bad
            with pytest.raises(config.ConfigError) as raised:
                config.check(changed)  # the value as the run config holds it (an int key of a float field: -1.0)
            assert str(raised.value) == bounds.problem(key, config.value(changed, key), rule)
            checked += 1
    assert checked


def test_a_non_finite_number_is_refused_with_its_rule():
    assert bounds.problem("optim.learning_rate", float("inf"), bounds.POSITIVE) == (
        "optim.learning_rate must be finite and > 0, got inf")
    assert bounds.problem("optim.learning_rate", 1e-3, bounds.POSITIVE) is None
