"""Loads a script of bench/ as a module, as the bench tests call its `main` and helpers."""
import importlib.util
import pathlib
import sys
from types import ModuleType

BENCH_DIR = pathlib.Path(__file__).resolve().parents[2] / "bench"


def load_bench(name: str) -> ModuleType:
    """bench/NAME.py as the module `bench_NAME`, registered in sys.modules (dataclasses look their module up while
    the class is built)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
