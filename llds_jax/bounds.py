"""How a run-config key is declared: once, as a field of the frozen dataclass of its section, with its default, its
range or choices and a one-line doc; and the one function that checks a value against it, with a message that names
the run key ("rollout.top_p must be in (0, 1], got 1.5").

A section class (a `Section`) names its run-config section (`SECTION`, e.g. "rollout") and declares each key with
`field(default, RANGE, doc=...)`, `field(default, choices=(...), doc=...)` or, for a nested section,
`section(cls, doc=...)`. A class that takes a key another class declares (a typed view such as
`rollout.config.SamplingConfig`, whose `temperature` is `rollout.temperature`) says so with `same(owner, name)`: the
owner's default, rule and doc, under the owner's key. A plain dataclass field (no metadata) is not a run key. The
declarations are `llds_jax.config.sections`'; `llds_jax.config` builds the run config and its table of keys from
them (tests/test_config_defaults.py walks them).

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
UNIT_INTERVAL = Range(lambda v: 0 <= v <= 1, "in [0, 1]")
MOMENTUM = Range(lambda v: 0 <= v < 1, "in [0, 1)")


class Section:
    """The base of a section class (a frozen dataclass): `SECTION` names its run-config section ("" for the top
    level), and building one checks every bounded field (`check`); a subclass with rules of its own calls this
    first."""

    SECTION = ""

    def __post_init__(self):
        check(self)


def field(default: Any, bound: Range | None = None, *, choices: Sequence[Any] | None = None, doc: str) -> Any:
    """The declaration of a run-config key: a dataclass field with its default, its range (`bound`) or its allowed
    values (`choices`), and its one-line doc."""
    metadata: dict[str, Any] = {"doc": doc}
    if bound is not None:
        metadata["bound"] = bound
    if choices is not None:
        metadata["choices"] = tuple(choices)
    return dataclasses.field(default=default, metadata=metadata)


def section(cls: type, *, doc: str) -> Any:
    """The declaration of a nested section (e.g. `objective.llds`): a field holding the section class `cls` at its
    defaults."""
    return dataclasses.field(default_factory=cls, metadata={"doc": doc, "section": cls})


def same(owner: type, name: str, **changes: Any) -> Any:
    """A field that takes the run key `owner` declares as `name` (its default, rule and doc, under the owner's key);
    `changes` may set another `default` (documented where it is used)."""
    declared = next(f for f in dataclasses.fields(owner) if f.name == name)
    metadata = {**declared.metadata, "key": key_of(owner, declared)}
    return dataclasses.field(default=changes.get("default", declared.default), metadata=metadata)


def key_of(cls: type, f: dataclasses.Field) -> str:
    """The run key of field `f` of class `cls`: the one it refers to (`same`), else `cls.SECTION.name`."""
    if "key" in f.metadata:
        return f.metadata["key"]
    return f"{cls.SECTION}.{f.name}" if cls.SECTION else f.name


def declarations(cls: type) -> Iterator[dataclasses.Field]:
    """The fields of the section class `cls` that declare a run key (`field`, `section`; not `same`, not plain)."""
    for f in dataclasses.fields(cls):
        if "doc" in f.metadata and "key" not in f.metadata:
            yield f


def declared(cls: type) -> Iterator[tuple[str, str, Range | tuple]]:
    """(run key, field name, its Range or choices) of every bounded field of `cls`, its own or taken (`same`)."""
    for f in dataclasses.fields(cls):
        rule = f.metadata.get("bound", f.metadata.get("choices"))
        if rule is not None:
            yield key_of(cls, f), f.name, rule


def problem(key: str, value: Any, rule: Range | tuple) -> str | None:
    """Why `value` is not allowed for `key` (None when it is)."""
    if isinstance(rule, tuple):
        return None if value in rule else f"{key} must be one of {', '.join(map(repr, rule))}, got {value!r}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{key} must be a number {rule.words}, got {value!r}"
    if not math.isfinite(value):  # inf passes `> 0`; the first update would make the weights NaN
        return f"{key} must be finite and {rule.words}, got {value!r}"
    return None if rule.test(value) else f"{key} must be {rule.words}, got {value!r}"


def check(instance: Any) -> None:
    """Raises ConfigError naming the run key of the first bounded field of the dataclass `instance` whose value is
    out of its range or choices, or not an integer where the field is an `int`."""
    types = {f.name: f.type for f in dataclasses.fields(instance)}
    for key, name, rule in declared(type(instance)):
        value = getattr(instance, name)
        message = problem(key, value, rule)
        if not message and types[name] in (int, "int") and not isinstance(value, int):
            message = f"{key} must be an integer {rule.words}, got {value!r}"  # a number, not an int (problem)
        if message:
            raise ConfigError(message)
