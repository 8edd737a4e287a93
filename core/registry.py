"""The one registry type: what a config selects by name (optimizers, models, tasks, data kinds).

The modules that define entries register them when they are imported, and a registry imports those modules itself
on its first lookup (`package`, `module`), so no list of them is kept by hand: a new optimizer, model, task or data
kind is found by where its file lies.
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
from collections.abc import Iterator
from typing import Generic, TypeVar

from core.errors import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    """Entries of one `kind` ("optimizer") keyed by the name the config `key` ("optim.name") selects them with.

    On the first lookup the registry imports every public top-level module of `package` or, with `module`, the
    `<package>.<subpackage>.<module>` of each public subpackage that has one. A name registered twice is an error;
    an unknown name is a `ConfigError` that names the key and lists the known names.
    """

    def __init__(self, kind: str, key: str, package: str, module: str | None = None) -> None:
        self.kind, self.key, self.package, self.module = kind, key, package, module
        self._entries: dict[str, T] = {}
        self._discovered = False

    def register(self, name: str, entry: T) -> T:
        if name in self._entries:
            raise ValueError(f"{self.kind} '{name}' is registered twice")
        self._entries[name] = entry
        return entry

    def get(self, name: object) -> T:
        entries = self.entries
        if name not in entries:
            raise ConfigError(f"{self.key}={name} must be one of {', '.join(sorted(entries))}")
        return entries[name]  # type: ignore[index]

    def names(self) -> list[str]:
        return sorted(self.entries)

    def __contains__(self, name: object) -> bool:
        return name in self.entries

    def __iter__(self) -> Iterator[T]:
        """The entries in name order."""
        entries = self.entries
        return iter([entries[name] for name in sorted(entries)])

    @property
    def entries(self) -> dict[str, T]:
        """Every entry by name, once the defining modules are imported (tests may add or replace entries here)."""
        if not self._discovered:
            self._discovered = True  # first: the modules imported below register, and may look entries up
            for name in self._defining_modules():
                importlib.import_module(name)
        return self._entries

    def _defining_modules(self) -> list[str]:
        package = importlib.import_module(self.package)
        found = [info for info in pkgutil.iter_modules(package.__path__) if not info.name.startswith("_")]
        if self.module is None:
            return [f"{self.package}.{info.name}" for info in found]
        return [f"{self.package}.{info.name}.{self.module}" for info in found
                if info.ispkg and importlib.util.find_spec(f"{self.package}.{info.name}.{self.module}") is not None]
