"""`python -m llds_jax.config show CONFIG.py[:ARGS] [--config.KEY=VALUE ...]` prints the resolved run config of a
config file with its overrides, secrets redacted, its library keys' values checked (the typed config), without
touching storage, credentials, the model or the data (an application's sections are printed as given; the launch
checks them).

`python -m llds_jax.config` prints the README's config table, generated from the declarations; with a path
(`python -m llds_jax.config README.md`), rewrites the table in that file."""
import sys

from llds_jax import config

if len(sys.argv) > 1 and sys.argv[1] == "show":
    from llds_jax.config.loader import show

    sys.exit(show(sys.argv[2:]))
if len(sys.argv) > 1:
    with open(sys.argv[1], encoding="utf-8") as f:
        text = config.with_table(f.read())
    with open(sys.argv[1], "w", encoding="utf-8") as f:
        f.write(text)
else:
    print(config.table())
