"""How a retriever backend declares its options: one frozen dataclass per backend (`RetrieverOptions`), beside the
backend's code and registered under its name in `BACKENDS` (the values of `retriever.backend`), each option a field
declared with `option(default, BOUND, doc=...)` (`llds_jax.bounds.field`'s default, range or choices and one-line
doc, plus whether a resume may change it) or `REQUIRED`; the groups several backends share (the network backends'
request policy, `retry.RequestPolicy`; the e5 encoder's options, `dense_options.EncoderOptions`) are declared once
and composed by inheritance. Building one checks every field and names its run-config key (`retriever.index_dir`):
required, its type (an int is a valid float, a bool is no int), its range or choices (`bounds.check`), a URL's
scheme; no message quotes a value unredacted (`llds_jax.runtime.redaction`). `table` is a backend's block of the
README's config table (`python -m llds_jax.search README.md`).

The registry is filled where the backends are declared: `llds_jax.search.factory` imports them all.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any, ClassVar

from llds_jax import bounds
from llds_jax.bounds import ConfigError, Range
from llds_jax.registry import Registry
from llds_jax.runtime import redaction

BACKENDS: Registry[type["RetrieverOptions"]] = Registry("retriever.backend")
SECTION = "retriever"
ONE_PER_CORE = Range(lambda v: v >= 0, ">= 0 (0: one per core)")  # a count of threads


class _Required:
    """The default of an option a backend cannot do without."""

    def __repr__(self) -> str:
        return "required"


REQUIRED: Any = _Required()


def option(default: Any, bound: Range | None = None, *, choices: tuple | None = None, doc: str,
           operational: bool = False, url: bool = False) -> Any:
    """The declaration of a retriever option (`bounds.field`): `operational` when it says how the retriever is
    reached or how fast it answers, never what it returns (a resume may change it,
    llds_jax.train.run_config.trained_on); `url` when its value is one URL or several (`hosts`), checked for a
    scheme."""
    declared = bounds.field(default, bound, choices=choices, doc=doc)
    return dataclasses.field(default=default, metadata={**declared.metadata, "operational": operational,
                                                        "url": url})


def _accepted(annotation: Any) -> tuple[type, ...]:
    """The value types a field annotated `annotation` takes: float takes int too, a tuple takes a list."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return tuple(t for arg in typing.get_args(annotation) for t in _accepted(arg))
    if annotation is float:
        return (int, float)
    if annotation is type(None) or annotation is None:
        return (type(None),)
    if typing.get_origin(annotation) is tuple or annotation is tuple:
        return (list, tuple)
    return (annotation,)


def _shown(value: Any) -> str:
    """`repr(value)` for a message, URL user info redacted."""
    return redaction.redact(repr(value))


def _check_urls(key: str, value: str | list | tuple) -> None:
    """Raises ConfigError unless every URL of `value` (one, a list, or a comma-separated string of hosts) has a
    scheme; the message does not quote the URL (without a scheme its user info could not be found)."""
    if isinstance(value, str):
        urls = [u for u in value.split(",") if u.strip()] if key == "hosts" else [value]
    else:
        urls = list(value)
    for i, url in enumerate(urls):
        if not isinstance(url, str) or not redaction.SCHEME.match(url.strip()):
            which = f"entry {i + 1} of " if len(urls) > 1 else ""
            raise ConfigError(f"{SECTION}.{key}: {which}the value needs a scheme (http:// or https://),"
                              f" e.g. http://127.0.0.1:9200")


@dataclasses.dataclass(frozen=True)
class Options(bounds.Section):
    """Retriever options (a backend's, or a group several backends take): building one checks each field."""

    SECTION = SECTION
    BACKEND: ClassVar[str] = ""  # a backend's name; "" for a group

    def __post_init__(self):
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            key, value = f"{SECTION}.{f.name}", getattr(self, f.name)
            if value is REQUIRED:
                raise ConfigError(f"{key} is required for backend {self.BACKEND!r}")
            types = _accepted(hints[f.name])
            if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
                names = " or ".join(t.__name__ for t in dict.fromkeys(types))
                raise ConfigError(f"{key} must be {names}, got {_shown(value)}")
            if f.metadata.get("url"):
                _check_urls(f.name, value)
        try:
            super().__post_init__()  # ranges and choices
        except ConfigError as e:
            raise ConfigError(redaction.redact(str(e))) from None


@dataclasses.dataclass(frozen=True)
class RetrieverOptions(Options):
    """A backend's options: `BACKEND` its registered name, `make` its retriever."""

    def make(self) -> Any:
        """The retriever these options describe (`llds_jax.search.types.Retriever`)."""
        raise NotImplementedError

    def as_dict(self) -> dict[str, Any]:
        """{"backend": BACKEND, option: value, ...}, in declaration order."""
        return {"backend": self.BACKEND, **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}}


def register(cls: type[RetrieverOptions]) -> type[RetrieverOptions]:
    """Class decorator: registers a backend's options under its `BACKEND` name."""
    return BACKENDS.register(cls.BACKEND)(cls)


def _as_dict(cfg: Any) -> dict:
    if hasattr(cfg, "given"):  # the typed section, llds_jax.config.sections.RetrieverConfig
        return cfg.given()
    if isinstance(cfg, Mapping):
        return dict(cfg)
    raise TypeError(f"retriever config must be a mapping, got {type(cfg).__name__}")


def resolve(cfg: Any) -> RetrieverOptions:
    """The options of the backend `cfg` names (the typed `retriever` section, or a mapping: `retriever.backend`,
    default "bm25", and that backend's options), defaults filled in; ConfigError naming the offending key."""
    given = _as_dict(cfg)
    cls = BACKENDS[given.pop("backend", "bm25")]
    names = [f.name for f in dataclasses.fields(cls)]
    for key in given:
        if key not in names:
            raise ConfigError(f"{SECTION}.{key} is not an option of backend {cls.BACKEND!r} (options: "
                              f"{', '.join(names)})")
    return cls(**given)


def operational_keys() -> frozenset[str]:
    """The options of every backend that a resume may change (declared `operational`)."""
    return frozenset(f.name for cls in map(BACKENDS.__getitem__, BACKENDS.names())
                     for f in dataclasses.fields(cls) if f.metadata.get("operational"))


def _type_words(annotation: Any) -> str:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return " or ".join(map(_type_words, typing.get_args(annotation)))
    if annotation is type(None):
        return "None"
    return "list of str" if typing.get_origin(annotation) is tuple else annotation.__name__


def table(cls: type[RetrieverOptions]) -> str:
    """The markdown table of a backend's options: key, type, default ("required"), allowed values, whether a
    resume may change it, doc."""
    hints = typing.get_type_hints(cls)
    rows = ["| key | type | default | allowed | on resume | what it is |", "|---|---|---|---|---|---|"]
    for f in sorted(dataclasses.fields(cls), key=lambda f: f.default is not REQUIRED):  # required ones first
        default = '""' if f.default == "" else f.default
        rule = f.metadata.get("bound", f.metadata.get("choices"))
        rule = " / ".join(map(str, rule)) if isinstance(rule, tuple) else (rule.words if rule else "")
        resume = "may change" if f.metadata.get("operational") else ""
        rows.append(f"| `{SECTION}.{f.name}` | {_type_words(hints[f.name])} | {default} | {rule} | {resume} | "
                    f"{f.metadata['doc']} |")
    return "\n".join(rows)


TABLES_START = "<!-- retriever options: generated by `python -m llds_jax.search README.md` -->"
TABLES_END = "<!-- end of retriever options -->"


def tables() -> str:
    """One block per registered backend: its name, its docstring's first line, `table`."""
    blocks = []
    for name in BACKENDS.names():
        cls = BACKENDS[name]
        blocks.append(f"`retriever.backend = \"{name}\"`: {cls.__doc__.strip().splitlines()[0]}\n\n{table(cls)}")
    return "\n\n".join(blocks)


def with_tables(text: str) -> str:
    """`text` (the README) with the part between TABLES_START and TABLES_END replaced by `tables()`."""
    start, end = text.index(TABLES_START) + len(TABLES_START), text.index(TABLES_END)
    return f"{text[:start]}\n{tables()}\n{text[end:]}"
