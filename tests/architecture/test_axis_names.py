"""Physical mesh axis names live in `llds_jax.parallel` alone: every other module names array dimensions logically
(`parallel.spec("batch", None, "heads")`, `parallel.axes("vocab")`), so the mapping to the mesh is one table.

A string constant in code (docstrings excluded) equal to "fsdp" or "tensor" is a physical name anywhere in the
package; "data" is one in model/, rollout/ and rl/ (elsewhere it is also a config section or a JSON key)."""
import ast
from pathlib import Path

import jax
import pytest
from jax.sharding import PartitionSpec as P

from llds_jax import parallel

PACKAGE = Path(parallel.__file__).parent
PHYSICAL_EVERYWHERE = {"fsdp", "tensor"}
PHYSICAL_IN_MESH_CODE = {"data", "fsdp", "tensor"}
MESH_CODE = ("model", "rollout", "rl")  # subpackages whose "data" strings could only be the mesh axis


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the Constant nodes that are docstrings (module, class, function)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(
                    first.value.value, str):
                found.add(id(first.value))
    return found


def physical_names(source: str, forbidden: set[str]) -> list[tuple[int, str]]:
    """(line, name) of every string constant in code (not a docstring) whose value is in `forbidden`."""
    tree = ast.parse(source)
    docstrings = _docstrings(tree)
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in forbidden
            and id(node) not in docstrings]


def test_rule_flags_code_and_spares_docstrings():
    source = '"""Split over "fsdp"."""\ndef f(mesh):\n    """heads over "tensor"."""\n    return mesh.shape["tensor"]\n'
    assert physical_names(source, PHYSICAL_EVERYWHERE) == [(4, "tensor")]
    assert physical_names('P(None, ("data", "fsdp"))', PHYSICAL_IN_MESH_CODE) == [(1, "data"), (1, "fsdp")]
    assert physical_names('meta["data"]', PHYSICAL_EVERYWHERE) == []


def test_parallel_defines_the_mesh_axes():
    assert set(parallel.AXES) == PHYSICAL_IN_MESH_CODE


def test_logical_names_resolve_through_the_one_table():
    assert parallel.spec("layers", "batch", None, "kv_heads", None) == P(None, ("data", "fsdp"), None, "tensor", None)
    assert parallel.spec_for("layers/o_proj") == P(None, "tensor", None, "fsdp")
    assert parallel.axes("vocab") == ("fsdp", "tensor") and parallel.axes("layers") == ()
    mesh = parallel.make_mesh(data=2, fsdp=2, tensor=2)
    assert parallel.axis_size(mesh, "batch") == 4 and parallel.axis_size(mesh, "heads") == 2
    assert parallel.fitted(mesh, 6, "batch") is None and parallel.fitted(mesh, 8, "batch") == ("data", "fsdp")
    two_axes = jax.make_mesh((4, 2), ("data", "fsdp"))
    assert parallel.axes("vocab", two_axes) == ("fsdp",) and parallel.axis_size(two_axes, "vocab") == 2
    with pytest.raises(ValueError, match="not a logical axis name"):
        parallel.spec(("data", "fsdp"))  # a physical entry where a logical name belongs


@pytest.mark.parametrize("path", sorted(p for p in PACKAGE.rglob("*.py") if p != PACKAGE / "parallel.py"),
                         ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_physical_axis_names_outside_parallel(path):
    forbidden = PHYSICAL_IN_MESH_CODE if path.relative_to(PACKAGE).parts[0] in MESH_CODE else PHYSICAL_EVERYWHERE
    found = physical_names(path.read_text(), forbidden)
    assert not found, (f"{path.relative_to(PACKAGE.parent)} names mesh axes {found} (line, name): use a logical "
                       f"name of llds_jax.parallel (parallel.spec, parallel.axes, parallel.axis_size)")
