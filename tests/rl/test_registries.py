"""Every name -> implementation choice of the objective is one `llds_jax.registry.Registry`: the run config's value
is checked against it (naming the key), picks the implementation, and a new implementation is one decorated
function."""
import jax.numpy as jnp
import numpy as np
import pytest

from llds_jax import checks, config
from llds_jax.bounds import ConfigError
from llds_jax.registry import Registry
from llds_jax.rl.advantages import ADVANTAGES
from llds_jax.config.sections import ObjectiveConfig
from llds_jax.rl.llds import ANSWER_WEIGHTINGS, GATES
from llds_jax.rl.losses import KL_ESTIMATORS, kl_penalty_bt
from llds_jax.rl.terms import AGGREGATIONS, LOSS_TERMS
from tests.configs import load

REGISTRIES = {
    "objective.llds.variant": (LOSS_TERMS, {"llds", "policy", "entropy", "kl"}),
    "objective.advantages": (ADVANTAGES, {"grpo", "tree_grpo"}),
    "objective.llds.gate": (GATES, {"action", "response", "token"}),
    "objective.llds.answer_weighting": (ANSWER_WEIGHTINGS, {"none", "fixed", "adaptive", "adaptive_paper"}),
    "objective.kl_estimator": (KL_ESTIMATORS, {"k1", "abs", "mse", "low_var_kl"}),
    "objective.aggregation": (AGGREGATIONS, {"token-mean", "seq-mean-token-mean"}),
}


@pytest.mark.parametrize("key", sorted(REGISTRIES))
def test_each_choice_key_has_one_registry_holding_its_implementations(key):
    registry, names = REGISTRIES[key]
    assert registry.key == key
    assert names <= set(registry.names())  # tests may register more (test_losses registers a variant)
    assert config.value(config.default_config(), key) in registry


@pytest.mark.parametrize("key", sorted(REGISTRIES))
def test_an_unregistered_name_is_refused_naming_the_key(key):
    registry, _ = REGISTRIES[key]
    with pytest.raises(ConfigError, match=rf"^{key} must be one of .*, got 'bogus'$"):
        registry["bogus"]
    cfg = load("tiny_test")
    section, _, leaf = key.rpartition(".")
    config.value(cfg, section)[leaf] = "bogus"
    with pytest.raises(ConfigError, match=rf"^{key} must be one of .*, got 'bogus'$"):
        checks.validate(cfg, num_devices=1)  # (with the device count: no model folder needed)


def test_a_name_is_registered_once():
    registry = Registry("objective.test_choice")
    registry.register("a")(len)
    with pytest.raises(ValueError, match="objective.test_choice: 'a' is already registered"):
        registry.register("a")(max)
    assert registry.names() == ("a",) and registry["a"] is len


def test_a_new_kl_estimator_is_one_decorated_function_picked_by_name():
    @KL_ESTIMATORS.register("test_squared_abs")
    def squared_abs(diff_bt, clamp):
        return jnp.minimum(diff_bt**2, clamp)

    logp_bt = jnp.asarray([[0.0, -1.0, -3.0]])
    ref_bt = jnp.asarray([[-0.5, -1.0, 0.0]])
    np.testing.assert_allclose(np.asarray(kl_penalty_bt(logp_bt, ref_bt, "test_squared_abs", 4.0)),
                               [[0.25, 0.0, 4.0]])
    assert ObjectiveConfig(kl_estimator="test_squared_abs").kl_estimator == "test_squared_abs"
