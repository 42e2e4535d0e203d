"""What the docs point to exists (issue 58, item 15): the README cited `llds-method.md` and code docstrings
`search-r1-protocol.md`, files of no project; its module map put `protocol.py` under rollout/, where no such file is,
and missed a dozen top-level modules."""
import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]


def map_rows() -> list[tuple[list[str], str]]:
    """The module map's rows: the paths of the first column (`llds_jax/...`, `index_builder/`) and the second."""
    rows = []
    for line in (ROOT / "README.md").read_text().splitlines():
        cells = line.split(" | ")
        if line.startswith("| `") and len(cells) == 2 and line.endswith(" |"):
            paths = re.findall(r"`([^`]+)`", cells[0])
            if paths and all(path.startswith(("llds_jax/", "index_builder/")) for path in paths):
                rows.append((paths, cells[1]))
    return rows


def test_every_file_a_package_row_names_is_in_that_package():
    rows = map_rows()
    assert len(rows) > 10
    misplaced = []
    for paths, job in rows:
        folders = [ROOT / path for path in paths if path.endswith("/")]
        if not folders:
            continue
        for name in re.findall(r"`([\w/]+\.py)`", job):
            if not any((folder / name).is_file() for folder in folders):
                misplaced.append(f"{', '.join(paths)}: {name}")
    assert not misplaced


def test_every_top_level_module_and_package_is_in_the_map():
    named = {path.rstrip("/") for paths, _ in map_rows() for path in paths}
    library = ROOT / "llds_jax"
    modules = {f"llds_jax/{path.name}" for path in library.glob("*.py") if path.name != "__init__.py"}
    packages = {f"llds_jax/{path.name}" for path in library.iterdir() if (path / "__init__.py").is_file()}
    text = "\n".join(job for _, job in map_rows())
    # A module the map names inside another row's description (`programs.py` in the compile check's) counts.
    missing = sorted(m for m in modules | packages if m not in named and f"`{m.split('/')[-1]}`" not in text)
    assert not missing


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
