"""CI and a fresh machine install the same versions: `.ci/run` and both of the README's commands install with
`constraints.txt`, which pins every package setup.py names (a fresh install once pulled a newer pytest than CI
had, and the suite failed there only)."""
import ast
import os
import re

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def read(name: str) -> str:
    with open(os.path.join(ROOT, name)) as f:
        return f.read()


def pins() -> dict[str, str]:
    """constraints.txt as {canonical name: version}; every line is `name==version`."""
    lines = [line for line in read("constraints.txt").splitlines() if line.strip() and not line.startswith("#")]
    found = {}
    for line in lines:
        requirement = Requirement(line)
        specifiers = list(requirement.specifier)
        assert len(specifiers) == 1 and specifiers[0].operator == "==", line
        found[canonicalize_name(requirement.name)] = specifiers[0].version
    return found


def setup_requirements() -> list[Requirement]:
    """Every requirement of setup.py: INSTALL_REQUIRES and each list of extras_require, read from its syntax tree."""
    tree = ast.parse(read("setup.py"))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "INSTALL_REQUIRES" for t in node.targets):
            names += ast.literal_eval(node.value)
        if isinstance(node, ast.keyword) and node.arg == "extras_require":
            names += [name for extra in ast.literal_eval(node.value).values() for name in extra]
    return [Requirement(name) for name in names]


@pytest.mark.parametrize("where", [".ci/run", "README.md", "launch/setup.sh", "docs/tpu.md"])
def test_every_install_command_uses_the_constraints(where):
    """Every command that installs the project (the indented command lines of the docs, every line of a script)."""
    lines = read(where).splitlines()
    if where.endswith(".md"):
        lines = [line for line in lines if line.startswith("    ")]
    commands = [line for line in lines if re.search(r"pip\"? install ", line)]
    assert commands and all("-c constraints.txt" in command for command in commands), commands


def test_constraints_pin_every_requirement_of_setup_py_within_its_range():
    pinned = pins()
    requirements = setup_requirements()
    assert {"pytest", "jax", "torch", "transformers"} <= {canonicalize_name(r.name) for r in requirements}
    for requirement in requirements:
        name = canonicalize_name(requirement.name)
        assert name in pinned, f"constraints.txt does not pin {requirement.name}"
        assert requirement.specifier.contains(pinned[name], prereleases=True), (requirement, pinned[name])
