"""`python -m llds_jax.config`: prints the README's config table, generated from the declarations; with a path
(`python -m llds_jax.config README.md`), rewrites the table in that file."""
import sys

from llds_jax import config

if len(sys.argv) > 1:
    with open(sys.argv[1], encoding="utf-8") as f:
        text = config.with_table(f.read())
    with open(sys.argv[1], "w", encoding="utf-8") as f:
        f.write(text)
else:
    print(config.table())
