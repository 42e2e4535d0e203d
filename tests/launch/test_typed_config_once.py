"""A launch builds its typed run config once (issue 68): the ConfigDict stays at the edge (the command line, the
application, config.json) and every component takes the `RunConfig` built from it."""
import json
import os
import subprocess
import sys

import pytest

from llds_jax import config as config_lib
from llds_jax import launch
from llds_jax.config.sections import RunConfig
from llds_jax.train import trainer as trainer_lib
from tests.configs import CONFIGS
from tests.run_fixtures import tiny_trainer_config

# The launch command, with every build of the typed config counted (`config.typed`, which `config.check` calls).
COUNTING_LAUNCH = """
import atexit, sys
from absl import app
from llds_jax import config, launch
built, typed = [], config.typed
config.typed = lambda cfg: built.append(1) or typed(cfg)
atexit.register(lambda: print(f"typed config built {len(built)} time(s)", flush=True))
sys.argv[0] = "launch"
app.run(launch.main, flags_parser=launch.parse_flags)
"""


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


@pytest.mark.slow
def test_the_launch_command_builds_its_run_config_once(tiny_assets, tmp_path):
    """Through the command line: its value check before the heavy imports (`config.check`) is the build the run
    takes on (`launch.run(typed=...)`), none after it."""
    overrides = {"demo.enabled": False, "model.path": tiny_assets["model"], "data.train_files": tiny_assets["train"],
                 "data.eval_files": tiny_assets["test"], "retriever.index_dir": tiny_assets["index"],
                 "run_dir": tmp_path / "run", "mesh.fsdp": -1, "data.samples_per_prompt": 4,
                 "optim.mini_batch_size": 8, "optim.micro_batch_size": 8}
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.path.dirname(CONFIGS)}
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "-c", COUNTING_LAUNCH, f"--config={CONFIGS}/tiny_test.py",
                           *(f"--config.{key}={value}" for key, value in overrides.items()), "--mode=export",
                           f"--export_dir={tmp_path / 'export'}"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[-1] == "typed config built 1 time(s)"
