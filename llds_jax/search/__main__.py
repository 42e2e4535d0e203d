"""`python -m llds_jax.search`: prints the README's blocks of the retriever backends' options, generated from their
declarations (`llds_jax.search.options`); with a path (`python -m llds_jax.search README.md`), rewrites them in that
file."""
import sys

from llds_jax.search import factory  # noqa: F401  (registers every backend's options)
from llds_jax.search import options

if len(sys.argv) > 1:
    with open(sys.argv[1], encoding="utf-8") as f:
        text = options.with_tables(f.read())
    with open(sys.argv[1], "w", encoding="utf-8") as f:
        f.write(text)
else:
    print(options.tables())
