"""What the docs point to exists (issue 58, item 15): the README cited `llds-method.md` and code docstrings
`search-r1-protocol.md`, files of no project; its module map put `protocol.py` under rollout/, where no such file is,
and missed a dozen top-level modules. The module map is docs/architecture.md's since issue 57: it names every package
and module, and every path it names exists."""
import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
MAP = "docs/architecture.md"
CODE = ("llds_jax", "index_builder")


def map_rows(text: str) -> list[tuple[str, str]]:
    """The rows of the "Module map" section of `text`: (the path of the first column, the job of the second)."""
    section = text.split("\n## Module map\n", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        row = re.fullmatch(r"\| `([^`]+)` \| (.*) \|", line)
        if row:
            rows.append((row.group(1), row.group(2).strip()))
    return rows


def code_paths() -> set[str]:
    """Every module (`llds_jax/rl/losses.py`) and package (`llds_jax/rl/`) of the code the map covers; a package
    stands for its __init__.py."""
    paths = set()
    for top in CODE:
        for path in (ROOT / top).rglob("*.py"):
            relative = path.relative_to(ROOT).as_posix()
            paths.add(relative[:-len("__init__.py")] if path.name == "__init__.py" else relative)
    return paths


def test_the_reader_of_the_map_takes_its_rows_and_nothing_else():
    text = ("intro\n## Module map\n\n| path | job |\n|---|---|\n| `llds_jax/rl/` | GRPO |\n"
            "| `llds_jax/rl/losses.py` | the loss terms |\n\n| `llds_jax/x.py` | after the section |\n")
    assert map_rows(text.replace("after the section", "in it")) == [
        ("llds_jax/rl/", "GRPO"), ("llds_jax/rl/losses.py", "the loss terms"), ("llds_jax/x.py", "in it")]
    assert map_rows(text.replace("\n\n| `llds_jax/x.py`", "\n## Next\n| `llds_jax/x.py`")) == [
        ("llds_jax/rl/", "GRPO"), ("llds_jax/rl/losses.py", "the loss terms")]


@pytest.fixture(scope="module")
def rows() -> list[tuple[str, str]]:
    return map_rows((ROOT / MAP).read_text())


def test_every_path_the_map_names_exists_once_with_a_job(rows):
    assert len(rows) > 100
    paths = [path for path, _ in rows]
    assert sorted(p for p in set(paths) if paths.count(p) > 1) == []
    assert [path for path, job in rows if not job] == []
    assert [path for path in paths if not (ROOT / path).exists()] == []


def test_every_module_and_package_is_in_the_map(rows):
    assert sorted(code_paths() - {path for path, _ in rows}) == []


# Where the docs name a file that a command writes rather than one of the project (the study's output folder).
OUTPUT_FOLDERS = ("OUT/", "runs/")
WRITTEN_BY_THE_STUDY = {"primary.md"}  # llds_jax/apps/study/primary.py writes it into the study's folder
# The dead references of issue 58, quoted as such by its probe list and by this file.
QUOTED_AS_DEAD = {(text, name) for text in ("docs/reliability.md", "tests/architecture/test_doc_references.py")
                  for name in ("llds-method.md", "search-r1-protocol.md")}


def test_every_markdown_file_the_project_names_exists():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    texts = [p for p in tracked if p.endswith((".md", ".py")) and not p.startswith("docs/evidence/")]
    dead = []
    for text in texts:
        for ref in re.findall(r"(?<![\w./-])([\w./-]*[\w-]\.md)\b", (ROOT / text).read_text(errors="replace")):
            if (ref.startswith(OUTPUT_FOLDERS) or ref in WRITTEN_BY_THE_STUDY or (text, ref) in QUOTED_AS_DEAD
                    or any((folder / ref).is_file() for folder in (ROOT, ROOT / "docs", (ROOT / text).parent))
                    or any(path == ref or path.endswith("/" + ref) for path in tracked)):
                continue
            dead.append(f"{text}: {ref}")
    assert not dead


# Files the docs name as history: each is quoted with the last commit that has it (docs/tpu.md).
REMOVED_AT = {"llds_jax/model/kv_cache.py": "a0a277f", "tests/rollout/test_sampler.py": "a0a277f",
              "tests/rollout/test_continuous.py": "a0a277f"}


def test_every_code_file_the_docs_name_exists_or_is_quoted_with_the_commit_that_has_it():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    docs = [p for p in tracked if p.endswith(".md") and not p.startswith("docs/evidence/")]
    dead = []
    for doc in docs:
        text = (ROOT / doc).read_text(errors="replace")
        for ref in set(re.findall(r"(?<![\w./-])((?:llds_jax|tests|bench|configs|launch|index_builder)/[\w./-]*\.(?:py|sh))",
                                  text)):
            if "NAME" in ref or (ROOT / ref).is_file():  # NAME: a placeholder in a command line
                continue
            if ref in REMOVED_AT and REMOVED_AT[ref] in text:
                continue
            dead.append(f"{doc}: {ref}")
    assert not dead
