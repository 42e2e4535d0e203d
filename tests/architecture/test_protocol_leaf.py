"""llds_jax.protocol is a leaf: the data and sft modules build prompts and observations with it
(llds_jax.data.qa, llds_jax.data.synthetic, llds_jax.sft.demonstrations), so it may import nothing of llds_jax."""
import ast
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROTOCOL = os.path.join(ROOT, "llds_jax", "protocol.py")


def test_protocol_imports_nothing_of_llds_jax():
    tree = ast.parse(open(PROTOCOL, encoding="utf-8").read())
    imported = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    imported += [node.module or "." for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    assert not [name for name in imported if name.startswith(("llds_jax", "."))], imported


def test_importing_protocol_loads_no_other_module_of_llds_jax_and_no_jax():
    script = ("import sys, llds_jax.protocol; "
              "print(sorted(m for m in sys.modules if m.split('.')[0] in ('llds_jax', 'jax')))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "['llds_jax', 'llds_jax.protocol']"
