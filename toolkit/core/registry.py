"""Backends by name: one :class:`Registry` beside each base class (engines in ``toolkit/engine/base.py``,
clusters in ``toolkit/cluster/base.py``). An entry names the backend's config schema and its class as
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
