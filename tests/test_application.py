"""The application hook (llds_jax.application): a run config's `app` key names a module on top of the library whose
config sections the schema accepts and whose checks name their keys; and no module of the library imports the
applications (llds_jax.apps), read from the source like tests/architecture/test_import_graph.py."""
import ast
import os
import types

import ml_collections
import pytest

from llds_jax import application, checks
from llds_jax import config as config_lib
from llds_jax.apps import demo_config
from tests.configs import load

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
APPS = "llds_jax.apps"


def _core_modules() -> dict[str, str]:
    """Module name -> file of every module of the library outside llds_jax/apps."""
    modules = {}
    for folder, _, files in os.walk(os.path.join(ROOT, "llds_jax")):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                module = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".").removesuffix(".__init__")
                if module != APPS and not module.startswith(APPS + "."):
                    modules[module] = path
    return modules


def _imported_names(module: str, path: str) -> set[str]:
    """Every module name an import statement of the file names, anywhere in it (relative ones resolved); with
    `from X import Y`, both X and X.Y."""
    is_package = path.endswith("__init__.py")
    names = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")[:len(module.split(".")) - node.level + is_package]
                base = ".".join(parts + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def _imports_apps(names: set[str]) -> list[str]:
    return sorted(name for name in names if name == APPS or name.startswith(APPS + "."))


def test_the_reader_sees_each_kind_of_import_of_the_apps(tmp_path):
    source = tmp_path / "m.py"
    for text, expected in [("from llds_jax.apps import demo\n", ["llds_jax.apps", "llds_jax.apps.demo"]),
                           ("def f():\n    import llds_jax.apps.study.plan\n", ["llds_jax.apps.study.plan"]),
                           ("from .apps.demo import prepare\n", ["llds_jax.apps.demo", "llds_jax.apps.demo.prepare"]),
                           ("from llds_jax import apps\n", ["llds_jax.apps"]),
                           ("from llds_jax import application\n", [])]:
        source.write_text(text)
        assert _imports_apps(_imported_names("llds_jax.launch", str(source))) == expected, text


def test_no_library_module_imports_the_applications():
    modules = _core_modules()
    assert {"llds_jax.launch", "llds_jax.config", "llds_jax.checks", "llds_jax.application"} <= set(modules)
    offenders = {module: _imports_apps(_imported_names(module, path)) for module, path in modules.items()}
    assert {module: names for module, names in offenders.items() if names} == {}


def test_the_library_schema_has_no_demo_section():
    cfg = config_lib.default_config()
    assert cfg.app == "" and "demo" not in cfg
    assert application.load(cfg) is None


def demo_run_config() -> ml_collections.ConfigDict:
    cfg = load("tiny_test")
    cfg.model.path = "/some/model"
    return cfg


@pytest.mark.parametrize("key, value, message", [
    ("num_people", 0, r"^demo\.num_people must be >= 1, got 0$"),
    ("num_kv_heads", 0, r"^demo\.num_kv_heads must be >= 1, got 0$"),
    ("initializer_range", 0.0, r"^demo\.initializer_range must be > 0, got 0\.0$"),
    ("search_fraction", 1.5, r"^demo\.search_fraction must be in \[0, 1\], got 1\.5$"),
    ("tokenizer", "gpt2", r"^demo\.tokenizer must be one of 'qwen2\.5', 'world', got 'gpt2'$"),
    ("world", "three_hop", r"^demo\.world must be one of 'two_hop', 'khop', got 'three_hop'$"),
])
def test_the_demo_checks_its_own_section_naming_the_key(key, value, message):
    cfg = demo_run_config()
    checks.validate(cfg, 1)
    cfg.demo[key] = value
    with pytest.raises(config_lib.ConfigError, match=message):
        checks.validate(cfg, 1)


def test_a_khop_demo_world_needs_20_people():
    cfg = demo_run_config()
    cfg.demo.world, cfg.demo.num_people = "khop", 20
    checks.validate(cfg, 1)
    cfg.demo.num_people = 19
    with pytest.raises(config_lib.ConfigError, match=r"^demo\.num_people must be at least 20 with demo\.world 'khop' "
                                                     r"\(a k-hop world draws its chains among them\), got 19$"):
        checks.validate(cfg, 1)


def test_the_schema_takes_the_sections_of_the_named_app_only():
    cfg = demo_run_config()
    cfg.demo.unlock()
    cfg.demo.num_persons = 3
    with pytest.raises(config_lib.ConfigError, match=r"unknown config key 'demo\.num_persons'"):
        checks.validate(cfg, 1)
    cfg = demo_run_config()
    cfg.app = ""  # the demo section without its application
    with pytest.raises(config_lib.ConfigError, match=r"unknown config key 'demo'"):
        checks.validate(cfg, 1)
    cfg = load("base")
    cfg.app = demo_config.APP  # the application without its section
    cfg.model.path = "/some/model"
    with pytest.raises(config_lib.ConfigError, match=r"app 'llds_jax\.apps\.demo' needs the config section 'demo'"):
        checks.validate(cfg, 1)


def test_config_check_alone_asks_for_the_app():
    with pytest.raises(config_lib.ConfigError, match=r"app 'llds_jax\.apps\.demo' is set: check the config with "
                                                    r"llds_jax\.checks\.validate"):
        config_lib.check(demo_run_config())


def test_model_path_is_left_to_an_app_that_provides_it():
    cfg = demo_run_config()
    cfg.model.path = ""
    checks.validate(cfg, 1)  # the demo points model.path at its generated policy
    cfg.demo.enabled = False
    with pytest.raises(config_lib.ConfigError, match=r"^model\.path must name a Hugging Face checkpoint folder$"):
        checks.validate(cfg, 1)


@pytest.mark.parametrize("name, message", [
    ("llds_jax.apps.nonexistent", r"^app 'llds_jax\.apps\.nonexistent' cannot be imported: "),
    ("llds_jax.train.report", r"^app 'llds_jax\.train\.report' is not an application module: it lacks "
                              r"config_sections, check_config, provided_keys, paths, prepare_run"),
])
def test_a_bad_app_is_named(name, message):
    cfg = load("base")
    cfg.app = name
    with pytest.raises(config_lib.ConfigError, match=message):
        checks.validate(cfg)


def test_an_app_may_not_redeclare_a_library_section():
    app = types.SimpleNamespace(__name__="my_app", config_sections=lambda: {"sft": ml_collections.ConfigDict()})
    with pytest.raises(config_lib.ConfigError, match=r"app 'my_app' declares the config section 'sft', which is the "
                                                    r"library's"):
        config_lib.schema(app)


def test_the_launcher_checks_the_buckets_of_the_apps_paths():
    from llds_jax import launch

    cfg = demo_run_config()
    cfg.demo.assets_dir = "gs://assets-bucket/world"
    assert launch.gcs_paths(cfg)["demo.assets_dir"] == "gs://assets-bucket/world"
    cfg.app = ""
    del cfg["demo"]
    assert "demo.assets_dir" not in launch.gcs_paths(cfg)
