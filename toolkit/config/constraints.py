"""What a config field allows, declared where the field is, and the one walker that checks it.

A field declares its constraint in its ``dataclasses.field`` metadata: :func:`bounded` numbers,
:func:`matching` text, :func:`nonempty` mappings, :func:`overrides` of another object's fields; a
closed set of names is a :class:`Choice` type (OmegaConf checks it at composition). ``None`` passes
where the field's type admits it. :func:`field_errors` walks a config and lists every field that breaks
its constraint, named by its path, with its value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import types
import typing
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from omegaconf import OmegaConf, ValidationError

from toolkit.core.errors import FieldError


class Choice(str, Enum):
    """A closed set of names: YAML and overrides stay plain strings, and a member compares, hashes and
    prints as its string. Name each member as its value: OmegaConf reads a string as a member's name."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    def __repr__(self) -> str:
        return repr(self.value)

    @classmethod
    def values(cls) -> list[str]:
        return [str(m.value) for m in cls]


@dataclass(frozen=True)
class Bounds:
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    finite: bool = True
    """Refuse infinities too (NaN fails every bound anyway): every number a run multiplies, rounds or
    waits on is finite; a field that means "none" by a value takes ``null``."""
    note: str = ""
    """Words after the bound, e.g. ``(seconds)``."""
    null: str = ""
    """Words after ``or null``: what null means, e.g. ``for no flip``."""

    def holds(self, v: float) -> bool:
        return ((self.ge is None or v >= self.ge) and (self.gt is None or v > self.gt)
                and (self.le is None or v <= self.le) and (self.lt is None or v < self.lt)
                and (not self.finite or math.isfinite(v)))

    def words(self, integer: bool) -> str:
        low = (f"[{self.ge!r}" if self.ge is not None else f"({self.gt!r}" if self.gt is not None else None)
        high = (f"{self.le!r}]" if self.le is not None else f"{self.lt!r})" if self.lt is not None else None)
        if low is not None and high is not None:
            fraction = not integer and float(low[1:]) >= 0 and float(high[:-1]) <= 1
            kind = "an integer in" if integer else "a fraction in" if fraction else "in"
            text = f"{kind} {low}, {high}"
        else:
            text = " ".join(s for s in (
                f">= {self.ge!r}" if self.ge is not None else "", f"> {self.gt!r}" if self.gt is not None else "",
                f"<= {self.le!r}" if self.le is not None else "", f"< {self.lt!r}" if self.lt is not None else "") if s)
            text = f"an integer {text}" if integer else f"finite, {text}" if self.finite and high is None else text
        return f"{text} {self.note}" if self.note else text


def bounded(default: Any, *, ge: float | None = None, gt: float | None = None, le: float | None = None,
            lt: float | None = None, finite: bool = True, note: str = "", null: str = "") -> Any:
    """A number field with bounds: ``ge`` >=, ``gt`` >, ``le`` <=, ``lt`` <."""
    return field(default=default, metadata={"bounds": Bounds(ge, gt, le, lt, finite, note, null)})


def matching(default: Any, pattern: str, allowed: str) -> Any:
    """A text field that ``re.search(pattern)`` must find something in, ``allowed`` saying what it takes."""
    return field(default=default, metadata={"pattern": pattern, "allowed": allowed})


def nonempty(allowed: str) -> Any:
    """A mapping field (empty by default) that must name at least one entry."""
    return field(default_factory=dict, metadata={"nonempty": True, "allowed": allowed})


def overrides(of: str, keyed: bool = False, **kw: Any) -> Any:
    """A mapping of overrides of the fields of the object at path ``of`` (from the config's root); with
    ``keyed``, a mapping of such mappings (by group). Each key must be a field of that object, and each
    value is checked as that field would be."""
    return field(default_factory=dict, metadata={"overrides": of, "keyed": keyed, **kw})


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _members(hint: Any) -> tuple[Any, ...]:
    """The types of a union (``X | None``), or the type itself."""
    union = isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
    return typing.get_args(hint) if union else (hint,)


def _nullable(hint: Any) -> bool:
    return hint is Any or type(None) in _members(hint)


def _choice(hint: Any) -> type[Choice] | None:
    return next((t for t in _members(hint) if isinstance(t, type) and issubclass(t, Choice)), None)


def _integer(hint: Any) -> bool:
    return int in _members(hint)


def allowed(f: dataclasses.Field, hint: Any, value: Any) -> str | None:
    """What field ``f`` (of type ``hint``) allows, if ``value`` is not that; None when it is."""
    meta = f.metadata
    null = _nullable(hint)
    if value is None and null:
        return None
    or_null = ", or null" if null else ""
    if (bounds := meta.get("bounds")) is not None:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and bounds.holds(value)
        words = bounds.words(_integer(hint))
        return None if ok else f"{words}{or_null}{' ' + bounds.null if null and bounds.null else ''}"
    if (pattern := meta.get("pattern")) is not None:
        ok = isinstance(value, str) and re.search(pattern, value) is not None
        return None if ok else f"{meta['allowed']}{or_null}"
    if meta.get("nonempty"):
        return None if value else meta["allowed"]
    if (choice := _choice(hint)) is not None:
        return None if value in choice.values() else f"one of {choice.values()}{or_null}"
    return None


def field_errors(obj: Any, path: str = "", root: Any = None, only: set[str] | None = None) -> list[FieldError]:
    """Every field of the dataclass ``obj`` (at ``path``), and of the dataclasses it holds (directly or in a
    mapping), that breaks its declared constraint; ``only`` limits ``obj``'s own fields to those names."""
    root = obj if root is None else root
    errors: list[FieldError] = []
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        if only is not None and f.name not in only:
            continue
        value = getattr(obj, f.name)
        name = f"{path}.{f.name}" if path else f.name
        if "overrides" in f.metadata:
            errors += _override_errors(root, name, value, f.metadata)
            continue
        why = allowed(f, hints[f.name], value)
        if why is not None:
            errors.append(FieldError(name, dict(value) if isinstance(value, dict) else value, why))
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            errors += field_errors(value, name, root)
        elif isinstance(value, dict):
            for key, item in value.items():
                if dataclasses.is_dataclass(item) and not isinstance(item, type):
                    errors += field_errors(item, f"{name}.{key}", root)
    return errors


def resolve(root: Any, path: str) -> Any:
    for part in path.split("."):
        root = getattr(root, part, None)
    return root


def override_fields(base: Any) -> list[str]:
    """The fields a mapping of overrides of ``base`` may set (never the backend's ``type``)."""
    return sorted(f.name for f in dataclasses.fields(base) if f.name != "type")


def _override_errors(root: Any, name: str, value: dict[str, Any], meta: Any) -> list[FieldError]:
    """Overrides of the object at ``meta["overrides"]``: keys that are no field of it, and values its fields
    refuse (each override checked as the field it replaces; the fields it leaves are checked there)."""
    of = meta["overrides"]
    base = resolve(root, of)
    if not dataclasses.is_dataclass(base):
        return []
    names = override_fields(base)
    kind = f"{of} '{base.type}'" if hasattr(base, "type") else of
    errors: list[FieldError] = []
    for prefix, over in ((f"{name}.{k}", v) for k, v in value.items()) if meta["keyed"] else [(name, value)]:
        if not isinstance(over, dict):
            errors.append(FieldError(prefix, over, f"a mapping of fields of {kind}: {names}"))
            continue
        known = {k: v for k, v in over.items() if k in names}
        errors += [FieldError(f"{prefix}.{k}", v, f"a field of {kind}: {names}") for k, v in over.items() if k not in known]
        typed, bad = typed_fields(base, known, prefix)
        errors += bad + field_errors(typed, prefix, root, only=set(known) - {e.field.rpartition(".")[2] for e in bad})
    return errors


def typed_fields(base: Any, values: dict[str, Any], prefix: str) -> tuple[Any, list[FieldError]]:
    """``base`` (a config dataclass) with ``values`` set, each one that is of its field's type as OmegaConf
    checks a field (a string for an int is not); and a "must be <type>" error for each other one."""
    hints = _hints(type(base))
    node, errors = OmegaConf.structured(base), []
    for k, v in values.items():
        try:
            node = OmegaConf.merge(node, {k: v})
        except (ValidationError, ValueError):
            errors.append(FieldError(f"{prefix}.{k}", v, f"must be {_type_name(hints[k])}"))
    return OmegaConf.to_object(node), errors


def _type_name(hint: Any) -> str:
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")
