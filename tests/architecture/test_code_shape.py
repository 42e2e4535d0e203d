"""The package's shape, read from the source: small modules (issue 41), sessions used through their declared
interface, never probed for attributes, no public function that only tests call, no config field that only tests
set, no date in the code, and array names whose dimension letters are docs/architecture.md's glossary (issue 57)."""
import ast
import collections
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(ROOT, "llds_jax")
MAX_LINES = 600


def _sources() -> dict[str, str]:
    """Path relative to the repository -> text, for every module of the package."""
    found = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8") as f:
                    found[os.path.relpath(path, ROOT)] = f.read()
    return found


def test_no_module_is_longer_than_600_lines_and_the_engine_keeps_to_its_job():
    lengths = {path: text.count("\n") for path, text in _sources().items()}
    assert {path: n for path, n in lengths.items() if n > MAX_LINES} == {}
    assert lengths[os.path.join("llds_jax", "rollout", "engine.py")] < 500


def test_no_code_probes_a_session_for_an_attribute():
    probe = re.compile(r"\b(getattr|hasattr)\(\s*session\b")
    assert [path for path, text in _sources().items() if probe.search(text)] == []


def test_every_public_function_is_used_outside_the_tests():
    """A public function or method of the package whose name appears nowhere else in the shipped code (the package,
    bench/, index_builder/, launch/, configs/) serves only tests: such helpers live in tests/ (issue 41). Functions
    with a decorator other than `property` (registered loss terms) are called through their registry."""
    shipped = dict(_sources())
    for folder in ("bench", "index_builder", "launch", "configs"):
        for sub, _, files in os.walk(os.path.join(ROOT, folder)):
            shipped.update({os.path.join(sub, name): open(os.path.join(sub, name), encoding="utf-8").read()
                            for name in files if name.endswith(".py")})
    words = collections.Counter(re.findall(r"\w+", "\n".join(shipped.values())))
    registered = lambda node: any(not (isinstance(d, ast.Name) and d.id == "property")  # noqa: E731
                                  for d in node.decorator_list)
    unused = [f"{path}: {node.name}" for path, text in _sources().items() for node in ast.walk(ast.parse(text))
              if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_")
              and not registered(node) and words[node.name] == 1]
    assert unused == []


def test_no_date_in_the_code():
    """Measurements and the dates they were taken on go stale in docstrings and comments: they live in docs/ (the
    tables of docs/tpu.md, docs/benchmarks.md, docs/evidence.md), which the code points to (issue 57)."""
    date = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
    sources = dict(_sources())
    configs = os.path.join(ROOT, "configs")
    for name in os.listdir(configs):
        if name.endswith(".py"):
            with open(os.path.join(configs, name), encoding="utf-8") as f:
                sources[os.path.join("configs", name)] = f.read()
    assert [path for path, text in sources.items() if date.search(text)] == []


# Suffixes without a vowel that are words or abbreviations, not dimensions.
NOT_DIMENSIONS = {"b1", "blk", "cfg", "csv", "df", "dkv", "dq", "fn", "fns", "gcs", "hbm", "hf", "hnsw", "kl", "kv", "lld", "lr",
                  "ptr", "r1", "rng", "std", "str", "tb", "ts", "vjp", "xb"}
SUFFIX = re.compile(r"\b[a-z][a-z0-9]*(?:_[a-z0-9]+)*_([a-z1]{2,6})\b")
UNREAD = set("aeiouy")  # letters the names cannot show (docs/architecture.md, "Dimension letters")


def _glossary() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """docs/architecture.md's "Dimension letters": letter -> the packages it is used in with its global meaning,
    and letter -> the packages that give it a meaning of their own."""
    with open(os.path.join(ROOT, "docs", "architecture.md"), encoding="utf-8") as f:
        section = f.read().split("## Dimension letters", 1)[1]
    letters, own = {}, collections.defaultdict(set)
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and re.fullmatch(r"[A-Z]", cells[0]):
            letters[cells[0].lower()] = {p.strip() for p in cells[2].split(",")}
        elif len(cells) == 3 and re.fullmatch(r"[A-Z]", cells[1]):
            own[cells[1].lower()].add(cells[0])
    return letters, dict(own)


def test_the_dimension_letters_of_array_names_are_the_glossarys():
    """Every letter of an array name's dimension suffix is in docs/architecture.md's glossary, used in exactly the
    packages it lists (issue 57: one meaning per letter; a letter taken up in another package is looked up there
    first), or in a package whose own table gives it a meaning there (and then in no other package under that
    meaning: the global table does not list it)."""
    letters, own = _glossary()
    used: dict[str, set[str]] = collections.defaultdict(set)
    for module, text in _sources().items():
        parts = module.split(os.sep)
        package = parts[1] if len(parts) > 2 else "top level"
        for suffix in set(SUFFIX.findall(text)):
            if re.search("[aeiouy]", suffix) or suffix in NOT_DIMENSIONS:
                continue
            used.update({letter: used[letter] | {package} for letter in suffix.replace("1", "")})
    documented = {letter: packages for letter, packages in letters.items() if letter not in UNREAD}
    for letter, packages in own.items():
        assert not packages & documented.get(letter, set()), (letter, packages)
        documented[letter] = documented.get(letter, set()) | packages
    assert dict(used) == documented


def test_every_config_field_is_set_by_the_shipped_code():
    """A field of a config dataclass (a class named ...Config) that no shipped code sets, by keyword, by name in a
    string outside the class (a key read from a file; the class's own checks name every field) or as a run-config
    key of that name (a section built from the run config, the library's or an application's), is a knob only tests turn: it goes, with what only it
    reaches (issue 57)."""
    from llds_jax.apps import demo_config
    from llds_jax.config import default_config

    def keys(section):
        return {k for k, v in section.items() for k in ([k] + (sorted(keys(v)) if hasattr(v, "items") else []))}

    shipped = dict(_sources())
    for folder in ("bench", "index_builder", "launch", "configs"):
        for sub, _, files in os.walk(os.path.join(ROOT, folder)):
            shipped.update({os.path.join(sub, name): open(os.path.join(sub, name), encoding="utf-8").read()
                            for name in files if name.endswith(".py")})
    set_names = keys(default_config()) | keys(demo_config.section())  # the library's keys and the demo's
    for text in shipped.values():
        tree = ast.parse(text)
        in_configs = {id(n) for c in ast.walk(tree) if isinstance(c, ast.ClassDef) and c.name.endswith("Config")
                      for n in ast.walk(c)}
        for node in ast.walk(tree):
            if isinstance(node, ast.keyword) and node.arg:
                set_names.add(node.arg)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in in_configs:
                set_names.add(node.value)
    unset = set()
    for path, text in _sources().items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.name.endswith("Config") and any(
                    "dataclass" in ast.unparse(d) for d in node.decorator_list):
                unset |= {f"{path.replace(os.sep, '/')}: {node.name}.{field.target.id}" for field in node.body
                          if isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name)
                          and field.target.id not in set_names}
    assert unset == set()
