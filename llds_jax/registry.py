"""One way to pick an implementation by name: a `Registry` per choice (loss terms, advantage estimators, LLDS gates,
answer weightings, KL estimators, aggregations, rewards, step hooks), filled by a decorator where each implementation
is defined. The rewards and step hooks are lists of names (`reward.functions`, `train.hooks`), which the trainer
looks up when it starts (llds_jax.train.rewards, llds_jax.train.step_hooks: `llds_jax.checks` sits below the
trainer's package).

The run config keeps names only: a choice key's field (llds_jax.config.sections) declares its default name, and
the key's registry, filled where the implementations are defined, is the list of allowed names: `checks.validate`
looks the config's name up in it before anything heavy runs, naming the key (tests/rl/test_registries.py).
Adding an implementation is one decorated function in one file.

A leaf: it imports only `bounds`, for the error that names the run-config key.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from llds_jax.bounds import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    """Name -> implementation for one run-config key.

    Args:
      key: the run-config key whose value names an implementation (e.g. "objective.llds.gate"), for errors.
    """

    def __init__(self, key: str):
        self.key = key
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator registering its function (or class) under `name`; a name is registered once."""

        def add(item: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.key}: {name!r} is already registered")
            self._items[name] = item
            return item

        return add

    def __getitem__(self, name: str) -> T:
        if name not in self._items:
            raise ConfigError(f"{self.key} must be one of {self.names()}, got {name!r}")
        return self._items[name]

    def __contains__(self, name: str) -> bool:
        return name in self._items

    def names(self) -> tuple[str, ...]:
        """The registered names, in registration order."""
        return tuple(self._items)
