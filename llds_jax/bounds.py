"""Each run-config key's range or choices, declared once where its typed view declares the field, and checked by one
function with a message that names the run key.

A typed view (`rollout.config.SamplingConfig`, `rl.config.UpdateConfig`, ...) names the run-config section its
fields come from (`SECTION`, e.g. "rollout") and declares a bounded field with `field(default, RANGE)` or
`field(default, choices=(...))`. Its `__post_init__` calls `check(self)`; `llds_jax.config.check` reads the same
declarations (`declared`) against the run config before any view is built (both through `problem`): "rollout.top_p must
be in (0, 1], got 1.5". Keys of no view (`train.*`, `eval.*`, `data.*`, ...) keep their bounds in
`llds_jax.config`, each in one place too (tests/test_bounds.py checks that no key is bounded twice).

A leaf (it imports only the leaf `errors`), so that every module can raise `ConfigError` without importing the schema.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from llds_jax.errors import InputError


class ConfigError(InputError):
    """A run config problem; the message names the key."""


@dataclasses.dataclass(frozen=True)
class Range:
    """What a number must be: `test(value)` and the words for it (e.g. ">= 1"). Every bounded number must also be
    finite."""

    test: Callable[[float], bool]
    words: str


AT_LEAST_1 = Range(lambda v: v >= 1, ">= 1")
NON_NEGATIVE = Range(lambda v: v >= 0, ">= 0")
POSITIVE = Range(lambda v: v > 0, "> 0")
PROBABILITY_MASS = Range(lambda v: 0 < v <= 1, "in (0, 1]")
MOMENTUM = Range(lambda v: 0 <= v < 1, "in [0, 1)")


def field(default: Any, bound: Range | None = None, *, choices: Sequence[Any] | None = None) -> Any:
    """A dataclass field with its default and its range (`bound`) or its allowed values (`choices`)."""
    metadata = {"bound": bound} if bound is not None else {"choices": tuple(choices)}
    return dataclasses.field(default=default, metadata=metadata)


def declared(view: type) -> Iterator[tuple[str, str, Range | tuple]]:
    """(run key, field name, its Range or choices) of every bounded field of the typed view class `view`."""
    for f in dataclasses.fields(view):
        rule = f.metadata.get("bound", f.metadata.get("choices"))
        if rule is not None:
            yield f"{view.SECTION}.{f.name}", f.name, rule


def problem(key: str, value: Any, rule: Range | tuple) -> str | None:
    """Why `value` is not allowed for `key` (None when it is)."""
    if isinstance(rule, tuple):
        return None if value in rule else f"{key} must be one of {', '.join(map(repr, rule))}, got {value!r}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{key} must be a number {rule.words}, got {value!r}"
    if not math.isfinite(value):  # inf passes `> 0`; the first update would make the weights NaN
        return f"{key} must be finite and {rule.words}, got {value!r}"
    return None if rule.test(value) else f"{key} must be {rule.words}, got {value!r}"


def check(view: Any) -> None:
    """Raises ConfigError naming the run key of the first bounded field of the typed view instance `view` whose
    value is out of its range or choices."""
    for key, name, rule in declared(type(view)):
        message = problem(key, getattr(view, name), rule)
        if message:
            raise ConfigError(message)
