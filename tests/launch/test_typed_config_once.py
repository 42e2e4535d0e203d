"""A launch builds its typed run config once (issue 68): the ConfigDict stays at the edge (the command line, the
application, config.json) and every component takes the `RunConfig` built from it."""
import json

from llds_jax import config as config_lib
from llds_jax import launch
from llds_jax.config.sections import RunConfig
from llds_jax.train import trainer as trainer_lib
from tests.run_fixtures import tiny_trainer_config


def test_a_launch_builds_its_run_config_once_and_the_trainer_and_config_json_take_it(tiny_assets, tmp_path,
                                                                                     monkeypatch):
    cfg = tiny_trainer_config(tiny_assets, str(tmp_path / "run"))
    cfg.app = "llds_jax.apps.demo"  # its preparation runs (the demo is off: it sets nothing)
    built, taken = [], []
    typed = config_lib.typed
    monkeypatch.setattr(config_lib, "typed", lambda c: built.append(typed(c)) or built[-1])
    init = trainer_lib.Trainer.__init__
    monkeypatch.setattr(trainer_lib.Trainer, "__init__",
                        lambda self, config, recorded, **kw: taken.append(config) or init(self, config, recorded, **kw))
    assert launch.run(cfg, "export", export_dir=str(tmp_path / "export")) == 0
    assert len(built) == 1 and isinstance(built[0], RunConfig)
    assert taken == built  # the very config the launch built (the demo set no key)
    assert (tmp_path / "export" / "model.safetensors").exists()


def test_config_json_records_the_config_as_given_with_the_keys_the_launch_set(tiny_assets, tmp_path):
    cfg = tiny_trainer_config(tiny_assets, str(tmp_path / "run"))
    run = config_lib.with_values(config_lib.typed(cfg), {"model.path": "/warm_start", "data.eval_files": ["/e"]})
    recorded = config_lib.recorded(run, cfg)
    expected = config_lib.as_json(cfg)
    expected["model"]["path"], expected["data"]["eval_files"] = "/warm_start", ["/e"]
    assert json.dumps(recorded) == json.dumps(expected)  # the same keys, values and order
    assert recorded["demo"] == expected["demo"]  # the application's section, as given
