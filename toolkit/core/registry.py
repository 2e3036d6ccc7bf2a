"""Backends by name: one :class:`Registry` per kind (``ENGINES`` and ``CLUSTERS`` in
``toolkit/config/backends.py``). An entry names the backend's config schema and its class as
``module:attribute`` strings, imported when first used, so the registry itself imports nothing heavy
(the sim never pays for vLLM) and config code can look up schemas without import cycles.

A new backend is its module, its YAML in ``conf/<kind>/`` (``type: <name>``, defaults ``<name>_schema``)
and one line in the registry; config composition, the schema store, validation and the factory all
read the registry.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from toolkit.core.errors import ConfigError, FieldError


def _load(path: str) -> Any:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class Backend:
    schema: str
    """``module:Class`` of the backend's config dataclass."""
    impl: str
    """``module:Class`` of the backend itself."""
    check: str | None = None
    """``module:function`` of the setup checks only this backend knows, beyond what its config's fields
    declare: each returns a list of :class:`~toolkit.core.errors.FieldError` (the registry's owner says
    what it is given)."""


class Registry:
    def __init__(self, kind: str, backends: dict[str, Backend]) -> None:
        self.kind = kind
        """The config field that names a backend's type (``engine``, ``cluster``)."""
        self.backends = dict(backends)

    def names(self) -> list[str]:
        return sorted(self.backends)

    def _get(self, name: str) -> Backend:
        try:
            return self.backends[name]
        except KeyError:
            raise ConfigError([FieldError(f"{self.kind}.type", name, f"one of {self.names()}")]) from None

    def schema(self, name: str) -> type:
        """The config dataclass of backend ``name`` (a :class:`ConfigError` naming the options if none)."""
        cls = _load(self._get(name).schema)
        assert isinstance(cls, type)
        return cls

    def impl(self, name: str) -> Any:
        """The class of backend ``name``, imported now."""
        return _load(self._get(name).impl)

    def check(self, name: str) -> Any:
        """The check function of backend ``name`` (imported now), or None: for a name that is not
        registered too, which the caller reports on its own."""
        entry = self.backends.get(name)
        return _load(entry.check) if entry is not None and entry.check else None
