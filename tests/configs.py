"""The run configs of configs/, loaded as the launch command loads them. Import as `from tests.configs import ...`."""
import importlib.util
import os

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


def load(name: str, *args: str):
    """`get_config(*args)` of configs/<name>.py (`--config=configs/<name>.py:ARG` passes ARG)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(CONFIGS, name + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(*args)


def launched(cfg):
    """(the typed run config, what the run folder's config.json records of it) as the launch command builds them
    from `cfg` (`checks.validate`, once, and the mesh on this process's devices; no application preparation): what
    a Trainer takes."""
    import jax

    from llds_jax import checks
    from llds_jax import config as config_lib

    run = checks.validate(cfg)
    checks.check_mesh(run, jax.device_count())
    return run, config_lib.recorded(run, cfg)
