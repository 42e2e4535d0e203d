"""`python -m tests.reliability.without_torch LAUNCH_ARGS...` runs `llds_jax.launch LAUNCH_ARGS...` as on the base
install, where torch is absent (it comes only with the test extra): `import torch` raises ModuleNotFoundError and
`importlib.util.find_spec("torch")` (how transformers asks) finds nothing. Only the module is hidden; the launch
command is the product's own."""
import runpy
import sys

if __name__ == "__main__":
    sys.modules["torch"] = None  # what the import system reads as "no such module"
    sys.argv[0] = "llds_jax.launch"
    runpy.run_module("llds_jax.launch", run_name="__main__", alter_sys=True)
