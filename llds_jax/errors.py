"""The error type of bad input: a problem the user fixes in a file, a row, a flag or a run-config key.

`python -m llds_jax.launch` prints an `InputError` (and the project's named errors, `launch._known_errors`) as one line
and exits 2; any other exception, a `ValueError` of changed code among them, keeps its traceback. Raise it with a
message that names the problem's place (file and line, key, flag) and what was expected against what was found.
`bounds.ConfigError` is the InputError of a run-config key.

A leaf: no import of the package.
"""


class InputError(ValueError):
    """Bad input the user can fix; the message names where (file:line, key or flag), expected vs got."""
