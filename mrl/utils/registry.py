"""A name → object registry, so configs select algorithms and reward functions by string.

One small class serves the advantage estimators, the policy losses and the reward functions; a lookup of an
unknown name fails with the list of known names (the config error a user can act on), unless a default was set.
"""

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str, default: str | None = None) -> None:
        self.kind = kind
        self.default = default
        self._items: dict[str, T] = {}

    def register(self, *names: str) -> Callable[[T], T]:
        """Decorator: register the object under every given name (aliases share one object)."""

        def wrap(obj: T) -> T:
            for name in names:
                if name in self._items and self._items[name] is not obj:
                    raise ValueError(f"{self.kind} '{name}' is already registered")
                self._items[name] = obj
            return obj

        return wrap

    def get(self, name: str | None) -> T:
        if name is not None and name in self._items:
            return self._items[name]
        if self.default is not None:
            return self._items[self.default]
        raise KeyError(f"unknown {self.kind} '{name}'; known: {', '.join(sorted(self._items))}")

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._items))

    def names(self) -> list[str]:
        return sorted(self._items)
