"""One declaration per config key (issue 57): every key of the run config is a field of exactly one section class
(llds_jax.bounds.field: its default, range or choices, doc), `default_config()` is built from those declarations, a
typed view takes a key's declaration instead of repeating its default, and the README's config table is generated
from the docs."""
import ast
import dataclasses
import inspect
import os

import pytest

from llds_jax import bounds
from llds_jax.bounds import ConfigError
from llds_jax import config as config_lib
from llds_jax.apps import demo_config
from llds_jax.config import sections
from llds_jax.config.sections import ObjectiveConfig, UpdateConfig
from llds_jax.model import config as model_config
from llds_jax.rollout import config as rollout_config
from llds_jax.rollout.config import AgentConfig, PagingConfig, SamplingConfig
from llds_jax.search import factory  # noqa: F401  (registers every retriever backend's options)
from llds_jax.search import options as search_options

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The modules that hold config dataclasses: the sections and the views that take their keys.
MODULES = (sections, rollout_config, model_config, demo_config)
# Views whose default differs from the declaration's, on purpose (ModelConfig's docstring says why).
OTHER_DEFAULTS = {("ModelConfig", "dtype"), ("ModelConfig", "remat")}


def dataclasses_of(modules=MODULES) -> list[type]:
    return sorted({obj for module in modules for obj in vars(module).values()
                   if inspect.isclass(obj) and dataclasses.is_dataclass(obj) and obj.__module__ == module.__name__},
                  key=lambda cls: cls.__qualname__)


def declared_defaults(cls=config_lib.RunConfig, prefix="") -> dict[str, object]:
    """Run key -> declared default of every key the section `cls` and its nested sections declare, in order."""
    defaults = {}
    for f in bounds.declarations(cls):
        if "section" in f.metadata:
            defaults.update(declared_defaults(f.metadata["section"], f"{prefix}{f.name}."))
        else:
            defaults[f"{prefix}{f.name}"] = f.default
    return defaults


def declared_keys(cls=config_lib.RunConfig) -> list[str]:
    return list(declared_defaults(cls))


def _flat(cfg, prefix=""):
    out = []
    for key, value in cfg.items():
        out += _flat(value, f"{prefix}{key}.") if hasattr(value, "items") else [f"{prefix}{key}"]
    return out


def test_the_default_config_is_the_declared_keys():
    assert sorted(_flat(config_lib.default_config())) == sorted(declared_keys())
    cfg = config_lib.default_config()
    assert {key: config_lib.value(cfg, key) for key in declared_keys()} == declared_defaults()
    assert sorted(_flat(demo_config.section())) == sorted(declared_keys(demo_config.DemoConfig))
    assert len(declared_keys()) > 100


def test_every_key_is_declared_once_with_a_one_line_doc():
    declarations = [(bounds.key_of(cls, f), cls.__name__) for cls in dataclasses_of()
                    for f in bounds.declarations(cls) if "section" not in f.metadata]
    keys = [key for key, _ in declarations]
    assert sorted(key for key in set(keys) if keys.count(key) > 1) == []
    assert sorted(set(keys)) == sorted(declared_keys() + [f"demo.{k}" for k in declared_keys(demo_config.DemoConfig)])
    for cls in dataclasses_of():
        for f in bounds.declarations(cls):
            assert f.metadata["doc"] and "\n" not in f.metadata["doc"], (cls.__name__, f.name)


def test_a_view_takes_the_declaration_of_each_key_it_has():
    """A field named like a key of a section the class belongs to or takes keys from is that key's declaration or
    refers to it (`bounds.same`), with the declaration's default: no default is written twice."""
    declared = set(declared_keys())
    repeated, other_default = [], []
    for cls in dataclasses_of():
        owners = {bounds.key_of(cls, f).rpartition(".")[0] for f in dataclasses.fields(cls) if f.metadata}
        for f in dataclasses.fields(cls):
            if "key" in f.metadata:
                owner = config_lib.value(config_lib.default_config(), f.metadata["key"])
                if f.default != owner and (cls.__name__, f.name) not in OTHER_DEFAULTS:
                    other_default.append((cls.__name__, f.name))
            elif not f.metadata and any(f"{owner}.{f.name}" in declared for owner in owners):
                repeated.append((cls.__name__, f.name))
    assert repeated == [] and other_default == []
    assert sorted(model_config.RUN_FIELDS) == sorted(sections.ModelRunConfig.__dataclass_fields__.keys()
                                                     - {"path", "tokenizer_path", "chat_template", "preset"})


def test_a_view_built_from_the_default_config_is_the_views_default():
    run = config_lib.typed(config_lib.default_config())
    assert run.objective == ObjectiveConfig()
    assert AgentConfig.of(run.rollout) == AgentConfig()
    assert AgentConfig.of(run.rollout, run.eval) == AgentConfig(max_turns=run.eval.max_turns)
    assert SamplingConfig.of(run.rollout, stop_ids=()) == SamplingConfig()
    assert PagingConfig.of(run.rollout) == PagingConfig()
    assert dataclasses.replace(run.optim, warmup_steps=0) == UpdateConfig()
    assert run.optim.warmup_steps == 286  # 0.285 x 1005 steps, rounded down


def test_the_runs_views_take_its_other_sections_keys():
    cfg = config_lib.default_config()
    cfg.rollout.temperature, cfg.optim.warmup_ratio, cfg.train.total_steps = 0.7, 0.5, 11
    cfg.run_dir, cfg.seed, cfg.rollout.max_prompt_tokens, cfg.optim.logp_time_chunk = "r", 3, 100, 64
    run = config_lib.typed(cfg)
    assert (run.objective.temperature, run.optim.warmup_steps) == (0.7, 5)
    assert (run.sft.seed, run.sft.max_prompt_tokens, run.sft.logp_time_chunk) == (3, 100, 64)


def test_the_readme_config_table_is_generated_from_the_declarations():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    assert config_lib.with_table(readme) == readme, "regenerate it: python -m llds_jax.config README.md"
    assert "| `rollout.max_turns` | 3 | >= 0 | turns whose search is executed" in readme


def test_the_table_has_a_row_per_key_with_its_default_and_rule():
    rows = config_lib.table().splitlines()[2:]
    assert [row.split(" | ")[0].strip("| `") for row in rows] == declared_keys()
    assert "| `objective.llds.lam` | 0.2 | >= 0 | " in config_lib.table()
    assert "| `model.chat_template` | base | base / instruct / \"\" | " in config_lib.table()


@pytest.mark.parametrize("cls", [c for c in dataclasses_of() if getattr(c, "SECTION", None) is not None],
                         ids=lambda c: c.__name__)
def test_each_sections_defaults_pass_its_checks(cls):
    getattr(cls, "of", cls)()  # a section at its defaults builds (its bounds and rules hold); RunConfig through `of`


def test_the_run_config_sets_its_run_owned_fields_when_built_and_refuses_sections_that_disagree():
    run = sections.RunConfig.of(rollout=sections.RolloutConfig(temperature=0.7), seed=3)
    assert (run.objective.temperature, run.sft.seed, run.optim.warmup_steps) == (0.7, 3, 286)  # floor(0.285 x 1005)
    assert run.replaced(train=sections.TrainConfig(total_steps=100)).optim.warmup_steps == 28
    with pytest.raises(ConfigError, match="objective: its run-owned fields"):
        sections.RunConfig(rollout=sections.RolloutConfig(temperature=0.7), optim=run.optim, sft=run.sft)


def test_the_readme_has_a_block_per_retriever_backend_generated_from_its_options():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    assert search_options.with_tables(readme) == readme, "regenerate it: python -m llds_jax.search README.md"
    for name in search_options.BACKENDS.names():
        assert f'`retriever.backend = "{name}"`' in readme
        for f in dataclasses.fields(search_options.BACKENDS[name]):
            assert f"| `retriever.{f.name}` |" in readme
    assert "| `retriever.index_dir` | str | required |  |  | the folder of " in readme
    assert "| `retriever.max_response_bytes` | int | 67108864 | >= 1 | may change | " in readme


def all_declared_defaults() -> dict[str, object]:
    """Run key -> declared default of every key: the run config's, the demo's and every retriever backend's
    options (their required ones have none)."""
    defaults = declared_defaults()
    defaults.update({f"demo.{k}": v for k, v in declared_defaults(demo_config.DemoConfig).items()})
    for name in search_options.BACKENDS.names():
        defaults.update({f"retriever.{f.name}": f.default for f in dataclasses.fields(search_options.BACKENDS[name])
                         if f.default is not search_options.REQUIRED})
    return defaults


# Function parameters named like a key whose default equals the key's, that are not the key (a reason each).
NOT_THE_KEY = {
    ("llds_jax/launch.py", "topology"): "the --topology flag, \"\": none given (then mesh.topology holds)",
    ("llds_jax/model/tokenizer.py", "vocab_size"): "a trained tokenizer's size, not the demo policy's vocabulary",
    ("llds_jax/model/hf_io.py", "preset"): "\"\": load the checkpoint without checking it against a preset",
    ("llds_jax/rl/logprobs.py", "temperature"): "1.0: the logits as they are (no division)",
    ("llds_jax/search/synthetic.py", "seed"): "a test corpus's and encoder's generator seed",
    ("llds_jax/search/synthetic.py", "num_layers"): "a random test BERT's depth, not the demo policy's",
    ("llds_jax/search/synthetic.py", "num_heads"): "a random test BERT's heads, not the demo policy's",
    ("llds_jax/data/synthetic.py", "seed"): "the world generator's seed (the demo passes the run's)",
    ("llds_jax/data/synthetic.py", "num_people"): "the world generator's size (the demo passes demo.num_people)",
    ("llds_jax/data/khop.py", "seed"): "the k-hop world generator's seed (the demo passes the run's)",
    ("llds_jax/data/khop.py", "num_people"): "the k-hop world generator's size (the demo passes demo.num_people)",
}


def _literal(node: ast.AST) -> tuple[bool, object]:
    """(True, value) of an expression of constants alone (`64 << 20`, `-1`, `(1, 2)`), else (False, None)."""
    if all(isinstance(n, (ast.Constant, ast.BinOp, ast.UnaryOp, ast.Tuple, ast.operator, ast.unaryop, ast.Load))
           for n in ast.walk(node)):
        return True, eval(compile(ast.Expression(node), "<default>", "eval"))  # constants only
    return False, None


def _declaration_sources() -> set[str]:
    """Names of module constants a declaration takes as its default (`field(NAME, ...)`): the value's one place."""
    names = set()
    for module in (sections, demo_config):
        for node in ast.walk(ast.parse(inspect.getsource(module))):
            if (isinstance(node, ast.Call) and getattr(node.func, "id", "") == "field" and node.args
                    and isinstance(node.args[0], ast.Name)):
                names.add(node.args[0].id)
    return names


def repeated_defaults(root: str, defaults: dict[str, object]) -> list[str]:
    """`path:line name = value (key)` for each module constant and function parameter default under `root` written
    as a literal equal (same type) to a declared key's default under a name tied to the key: a parameter named as
    the key's last part (`max_staleness`), a constant named so with or without `DEFAULT_` or after its module
    (`storage.DEFAULT_TIMEOUT_S`: `train.storage_timeout_s`); the constants a declaration takes and NOT_THE_KEY
    left out. A default taken from the declaration (`RolloutConfig.max_prompt_tokens`) is no literal."""
    by_name: dict[str, list[str]] = {}
    for key in defaults:
        by_name.setdefault(key.rpartition(".")[2], []).append(key)
    sources, found = _declaration_sources(), []
    for folder, _, files in os.walk(os.path.join(root, "llds_jax")):
        for file in sorted(files):
            if not file.endswith(".py"):
                continue
            path = os.path.join(folder, file)
            where = os.path.relpath(path, root).replace(os.sep, "/")
            tree = ast.parse(open(path, encoding="utf-8").read())
            named = []  # (name, the key names it is tied to, default, line)
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    args = node.args.posonlyargs + node.args.args
                    pairs = list(zip(args[len(args) - len(node.args.defaults):], node.args.defaults))
                    pairs += [(a, d) for a, d in zip(node.args.kwonlyargs, node.args.kw_defaults) if d is not None]
                    named += [(a.arg, [a.arg], d, node.lineno) for a, d in pairs
                              if (where, a.arg) not in NOT_THE_KEY]
            for node in tree.body:
                if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                        and node.targets[0].id not in sources):
                    bare = node.targets[0].id.lower().lstrip("_").removeprefix("default_")
                    named.append((node.targets[0].id, [bare, f"{file[:-3]}_{bare}"], node.value, node.lineno))
            for name, ties, default, line in named:
                is_literal, value = _literal(default)
                for key in (k for tie in ties for k in by_name.get(tie, ())):
                    if is_literal and type(value) is type(defaults[key]) and value == defaults[key]:
                        found.append(f"{where}:{line} {name} = {value!r} ({key})")
    return found


def test_the_scan_finds_a_repeated_default_and_leaves_a_taken_one(tmp_path):
    package = tmp_path / "llds_jax"
    package.mkdir()
    (package / "storage.py").write_text("DEFAULT_TIMEOUT_S = 120.0\nOTHER = 120.0\n")
    (package / "prompts.py").write_text("LIMIT = 2048\nDEFAULT_MAX_PROMPT_TOKENS = 2048\n"
                                        "def cut(text, max_prompt_tokens: int = 2048, k=3): ...\n"
                                        "def run(max_staleness=RolloutConfig.max_staleness, max_turns=3.0): ...\n"
                                        "def fetch(*, max_response_bytes=64 << 20): ...\n")
    defaults = all_declared_defaults()
    assert sorted(repeated_defaults(str(tmp_path), defaults)) == [
        "llds_jax/prompts.py:2 DEFAULT_MAX_PROMPT_TOKENS = 2048 (rollout.max_prompt_tokens)",
        "llds_jax/prompts.py:3 max_prompt_tokens = 2048 (rollout.max_prompt_tokens)",
        "llds_jax/prompts.py:5 max_response_bytes = 67108864 (retriever.max_response_bytes)",
        "llds_jax/storage.py:1 DEFAULT_TIMEOUT_S = 120.0 (train.storage_timeout_s)"]


def test_no_module_constant_or_function_default_repeats_a_declared_default():
    """A key's default is written once, in its declaration: code that needs it takes it from there
    (`RolloutConfig.max_prompt_tokens`) or from the caller (issue 68: protocol.py's DEFAULT_MAX_PROMPT_TOKENS,
    storage.py's DEFAULT_TIMEOUT_S and rollout_schedule.py's max_staleness=1 repeated theirs)."""
    assert repeated_defaults(ROOT, all_declared_defaults()) == []
