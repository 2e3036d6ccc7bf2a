"""Seeded valid instances of JSON Schemas: what the ``sim`` engine emits for a structured request.

A subset of JSON Schema: ``type`` (one or a list), ``enum``, ``const``, ``anyOf``/``oneOf`` (one branch,
merged with its siblings; a ``oneOf`` whose branches overlap may yield an instance matching several),
objects (``properties``; every ``required`` one, each optional one with p=0.5; ``additionalProperties``
is ignored: nothing beyond ``properties`` and ``required`` is emitted), arrays (``items``,
``minItems``/``maxItems``), strings (``minLength``/``maxLength``, a few ``format`` values), numbers
(``minimum``/``maximum`` and their exclusive forms), local ``$ref`` (``#``, ``#/$defs/..``,
``#/definitions/..``). Keywords that restrict validity beyond that (``pattern``, ``allOf``, ``not``,
...) raise :class:`ToolkitError` rather than yield an instance that does not match.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np

from toolkit.core.errors import ToolkitError
from toolkit.core.protocol import Structured

UNSUPPORTED = frozenset({
    "pattern", "patternProperties", "not", "allOf", "if", "then", "else", "dependentRequired",
    "dependentSchemas", "dependencies", "multipleOf", "minProperties", "maxProperties", "contains",
    "minContains", "maxContains", "prefixItems", "additionalItems", "propertyNames", "unevaluatedProperties",
    "unevaluatedItems", "$dynamicRef", "$recursiveRef",
})
TYPES = ("object", "array", "string", "integer", "number", "boolean", "null")
FORMATS = {"date-time": "2024-01-02T03:04:05Z", "date": "2024-01-02", "time": "03:04:05Z",
           "email": "user@example.com", "uuid": "12345678-1234-5678-1234-567812345678",
           "uri": "https://example.com/", "ipv4": "192.0.2.1"}
ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 "
MAX_DEPTH = 32
SHALLOW = 6
"""Beyond this depth optional properties are left out and arrays take ``minItems`` (recursive schemas end)."""


def _check(schema: Any, where: str = "#") -> None:
    """Raise on a keyword this generator cannot honour, anywhere in ``schema`` (not only where a seed goes)."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise ToolkitError(f"JSON Schema at {where}: a schema is an object or a boolean, got {schema!r}")
    bad = sorted(UNSUPPORTED & schema.keys()) + ["uniqueItems"] * bool(schema.get("uniqueItems"))
    bad += ["items (a list)"] * isinstance(schema.get("items"), list)
    if schema.get("type") == "string" and schema.get("format", "date") not in FORMATS:
        bad.append(f"format {schema['format']!r}")
    if bad:
        raise ToolkitError(f"JSON Schema at {where}: unsupported keyword(s) {', '.join(bad)} "
                           f"(the sim emits instances of a subset: see toolkit/engine/structured.py)")
    subs = [(f"{k}/{n}", v) for k in ("properties", "$defs", "definitions") for n, v in schema.get(k, {}).items()]
    subs += [(f"{k}/{i}", v) for k in ("anyOf", "oneOf") for i, v in enumerate(schema.get(k, []))]
    for path, sub in subs + ([("items", schema["items"])] if "items" in schema else []):
        _check(sub, f"{where}/{path}")


def schema_instance(schema: dict[str, Any] | bool, rng: np.random.Generator) -> Any:
    """A valid instance of ``schema`` drawn from ``rng`` (same schema and rng state, same instance)."""
    _check(schema)
    return _draw(schema, schema, rng, 0)


def _resolve(root: Any, ref: str) -> Any:
    if not ref.startswith("#"):
        raise ToolkitError(f"JSON Schema $ref {ref!r}: only local references (#/...) are supported")
    node = root
    for part in filter(None, ref[1:].split("/")):
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            raise ToolkitError(f"JSON Schema $ref {ref!r} does not resolve")
        node = node[part]
    _check(node, ref)
    return node


def _pick(rng: np.random.Generator, seq: list[Any]) -> Any:
    if not seq:
        raise ToolkitError("JSON Schema: an empty enum, anyOf, oneOf or type list has no instance")
    return seq[int(rng.integers(len(seq)))]


def _draw(s: Any, root: Any, rng: np.random.Generator, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise ToolkitError(f"JSON Schema nests (or recurses) deeper than {MAX_DEPTH} levels")
    if s is True:
        s = {}
    if s is False:
        raise ToolkitError("JSON Schema `false` has no instance")
    if "$ref" in s:
        target = _resolve(root, s["$ref"])
        rest = {k: v for k, v in s.items() if k != "$ref"}
        return _draw({**target, **rest} if isinstance(target, dict) else target, root, rng, depth + 1)
    for key in ("anyOf", "oneOf"):
        if key in s:
            branch = _pick(rng, s[key])
            rest = {k: v for k, v in s.items() if k != key}
            return _draw({**rest, **branch} if isinstance(branch, dict) else branch, root, rng, depth + 1)
    if "const" in s:
        return s["const"]
    if "enum" in s:
        return _pick(rng, list(s["enum"]))
    t = s.get("type")
    if isinstance(t, list):
        t = _pick(rng, t)
    if t is None:
        t = ("object" if "properties" in s or "required" in s else "array" if "items" in s
             else _pick(rng, ["null", "boolean", "integer", "string"]))
    if t not in TYPES:
        raise ToolkitError(f"JSON Schema type {t!r}: not one of {', '.join(TYPES)}")
    shallow = depth >= SHALLOW
    if t == "object":
        props, required = s.get("properties", {}), list(s.get("required", []))
        names = [n for n in props if n in required or (not shallow and rng.random() < 0.5)]
        names += [n for n in required if n not in props]
        return {n: _draw(props.get(n, True), root, rng, depth + 1) for n in names}
    if t == "array":
        lo, hi = int(s.get("minItems", 0)), int(s.get("maxItems", 1 << 30))
        if hi < lo:
            raise ToolkitError(f"JSON Schema array: maxItems {hi} < minItems {lo}")
        n = lo if shallow else int(rng.integers(lo, min(hi, lo + 3) + 1))
        return [_draw(s.get("items", True), root, rng, depth + 1) for _ in range(n)]
    if t == "string":
        if s.get("format") in FORMATS:
            return FORMATS[s["format"]]
        lo, hi = int(s.get("minLength", 0)), int(s.get("maxLength", 1 << 30))
        if hi < lo:
            raise ToolkitError(f"JSON Schema string: maxLength {hi} < minLength {lo}")
        n = int(rng.integers(lo, min(hi, lo + 12) + 1))
        return "".join(ALPHABET[int(i)] for i in rng.integers(len(ALPHABET), size=n))
    if t in ("integer", "number"):
        return _number(s, t == "integer", rng)
    if t == "boolean":
        return bool(rng.integers(2))
    return None


def _number(s: dict[str, Any], integer: bool, rng: np.random.Generator) -> int | float:
    inf = math.inf
    lo, hi = s.get("minimum", -inf), s.get("maximum", inf)
    xlo, xhi = s.get("exclusiveMinimum", -inf), s.get("exclusiveMaximum", inf)
    if isinstance(xlo, bool):  # draft 4: a flag on minimum
        lo, xlo = (-inf, lo) if xlo else (lo, -inf)
    if isinstance(xhi, bool):
        hi, xhi = (inf, hi) if xhi else (hi, inf)

    def ok(x: float) -> bool:
        return lo <= x <= hi and xlo < x < xhi

    a, b = max(lo, xlo), min(hi, xhi)  # open at an exclusive end; 100 wide if a side is unbounded
    if math.isinf(a) and math.isinf(b):
        a, b = 0, 100
    elif math.isinf(a):
        a = b - 100
    elif math.isinf(b):
        b = a + 100
    if integer:
        a, b = math.ceil(a), math.floor(b)
        a, b = a + (not ok(a)), b - (not ok(b))
    if a > b or not ok(a if a == b else (a + b) / 2):
        raise ToolkitError(f"JSON Schema {'integer' if integer else 'number'}: no value within its bounds {s}")
    if integer:
        return int(rng.integers(a, b + 1))
    x = float(rng.uniform(a, b))
    if b - a >= 0.1 and ok(round(x, 3)):
        x = round(x, 3)  # short numbers where the range leaves room for them
    return x if ok(x) else (a + b) / 2


def instance_text(structured: Structured, rng: np.random.Generator) -> str:
    """The text of one output satisfying ``structured``: one of its choices, or a JSON instance of its schema."""
    if bool(structured.json_schema) == bool(structured.choice):
        raise ToolkitError("sampling.structured: set exactly one of json_schema and choice")
    if structured.choice:
        return str(_pick(rng, structured.choice))
    try:
        schema = json.loads(structured.json_schema)
    except json.JSONDecodeError as exc:
        raise ToolkitError(f"sampling.structured.json_schema is not JSON: {exc}") from None
    try:
        return json.dumps(schema_instance(schema, rng))
    except (TypeError, ValueError, AttributeError, KeyError, RecursionError) as exc:  # e.g. "properties": []
        raise ToolkitError(f"sampling.structured.json_schema is not a usable schema: {type(exc).__name__}: {exc}") \
            from None
