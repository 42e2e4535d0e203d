"""The package's shape, read from the source: small modules (issue 41), and sessions used through their declared
interface, never probed for attributes."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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


def test_no_module_is_longer_than_600_lines_and_the_sampler_keeps_to_its_job():
    lengths = {path: text.count("\n") for path, text in _sources().items()}
    assert {path: n for path, n in lengths.items() if n > MAX_LINES} == {}
    assert lengths[os.path.join("llds_jax", "rollout", "sampler.py")] < 500


def test_no_code_probes_a_session_for_an_attribute():
    probe = re.compile(r"\b(getattr|hasattr)\(\s*session\b")
    assert [path for path, text in _sources().items() if probe.search(text)] == []
