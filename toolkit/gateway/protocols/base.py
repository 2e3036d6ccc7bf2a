"""What every protocol adapter provides, and the checks they share.

A :class:`Protocol` turns one LLM API's request JSON into a :class:`ChatRequest` and renders a
:class:`ChatResult` back as that API's response JSON, its SSE stream and its error body. Parsing is
strict: a field whose value would change the result but that the gateway cannot honour is a 400
naming the field (``GatewayError.param``) and what is allowed, never silently dropped. A field whose
value is JSON ``null`` counts as absent (clients that dump their request models send every field).
"""

from __future__ import annotations

import json
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any

from toolkit.core.protocol import MAX_EXPECTED_TOKENS
from toolkit.gateway.types import ChatRequest, ChatResult, Choice, GatewayError, Message

SSE_CONTENT_TYPE = "text/event-stream"
TOOLKIT_FIELDS = frozenset({"expected_tokens"})
"""Fields of the toolkit's own that every protocol takes (an SDK sends them in ``extra_body``):
``expected_tokens``, the agent's guess of the turn's length (``Generate.expected_tokens``)."""


class Protocol(ABC):
    name: str
    """Short name (``chat``, ``responses``, ``messages``): the key in ``PROTOCOLS``."""
    route: str
    """The path after ``/v1/`` this protocol is served on, e.g. ``chat/completions``."""

    @abstractmethod
    def parse(self, body: Any) -> ChatRequest:
        """The request body (decoded JSON) as a ChatRequest; GatewayError(400) if it is invalid or
        asks for something the gateway does not support. It lets :data:`TOOLKIT_FIELDS` through."""

    def request(self, body: Any) -> ChatRequest:
        """:meth:`parse`, with the toolkit's own fields read."""
        req = self.parse(body)
        req.expected_tokens = Fields(body).integer("expected_tokens", 0, MAX_EXPECTED_TOKENS) or 0
        return req

    @abstractmethod
    def respond(self, req: ChatRequest, result: ChatResult) -> dict[str, Any]:
        """The non-streaming response body."""

    @abstractmethod
    def stream(self, req: ChatRequest, result: ChatResult) -> Iterator[bytes]:
        """The streaming response: complete SSE frames, to send with ``Content-Type: text/event-stream``."""

    @abstractmethod
    def error_body(self, err: GatewayError) -> dict[str, Any]:
        """The protocol's error body for ``err`` (send it with status ``err.status``)."""


def dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def sse(data: Any, event: str | None = None) -> bytes:
    """One SSE frame: an optional ``event:`` line and one ``data:`` line of compact JSON."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {dumps(data)}\n\n".encode()


def token_logprobs(choice: Choice) -> list[dict[str, Any]]:
    """OpenAI's per-token logprobs ``[{"token", "logprob", "bytes", "top_logprobs": []}]`` of a choice
    (``tokens_text`` gives the tokens; ``-inf`` becomes -9999.0, as JSON has no infinity)."""
    out = []
    for i, logprob in enumerate(choice.logprobs):
        token = choice.tokens_text[i] if i < len(choice.tokens_text) else ""
        raw = choice.tokens_bytes[i] if i < len(choice.tokens_bytes) else token.encode()
        out.append({"token": token, "logprob": logprob if math.isfinite(logprob) else -9999.0,
                    "bytes": list(raw), "top_logprobs": []})
    return out


def show(value: Any) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def bad(param: str, message: str) -> GatewayError:
    return GatewayError(400, f"{param}: {message}", param)


def is_noop(value: Any) -> bool:
    """True for values that ask for nothing: null, false, 0, "", [], {} and objects of such values."""
    if isinstance(value, dict):
        return all(is_noop(v) for v in value.values())
    return not value


class Fields:
    """A JSON object being parsed: typed getters whose errors name the field's full path."""

    def __init__(self, value: Any, path: str = "") -> None:
        if not isinstance(value, dict):
            raise bad(path or "body", f"must be a JSON object, got {show(value)}")
        self.data: dict[str, Any] = value
        self.path = path

    def param(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def get(self, key: str, *, required: bool = False) -> Any:
        value = self.data.get(key)
        if value is None and required:
            raise bad(self.param(key), "is required")
        return value

    def text(self, key: str, *, required: bool = False, choices: Collection[str] | None = None) -> str | None:
        value = self.get(key, required=required)
        if value is None:
            return None
        if not isinstance(value, str):
            raise bad(self.param(key), f"must be a string, got {show(value)}")
        if choices is not None and value not in choices:
            raise bad(self.param(key), f"must be one of {', '.join(map(repr, choices))}, got {show(value)}")
        return value

    def number(self, key: str, lo: float, hi: float, *, lo_open: bool = False) -> float | None:
        value = self.get(key)
        if value is None:
            return None
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not ok or not (lo < value if lo_open else lo <= value) or value > hi:
            span = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
            raise bad(self.param(key), f"must be a number in {span}, got {show(value)}")
        return float(value)

    def integer(self, key: str, lo: int | None = None, hi: int | None = None) -> int | None:
        value = self.get(key)
        if value is None:
            return None
        ok = isinstance(value, int) and not isinstance(value, bool)
        if not ok or (lo is not None and value < lo) or (hi is not None and value > hi):
            span = "an integer" + (f" >= {lo}" if lo is not None else "") + (f" <= {hi}" if hi is not None else "")
            raise bad(self.param(key), f"must be {span}, got {show(value)}")
        return value

    def flag(self, key: str) -> bool | None:
        value = self.get(key)
        if value is not None and not isinstance(value, bool):
            raise bad(self.param(key), f"must be true or false, got {show(value)}")
        return value

    def array(self, key: str, *, required: bool = False) -> list[Any] | None:
        value = self.get(key, required=required)
        if value is not None and not isinstance(value, list):
            raise bad(self.param(key), f"must be an array, got {show(value)}")
        return value

    def object(self, key: str) -> Fields | None:
        value = self.get(key)
        return None if value is None else Fields(value, self.param(key))

    def child(self, key: str) -> Fields:
        """The required object field ``key``."""
        return Fields(self.get(key, required=True), self.param(key))

    def only(self, known: Collection[str], rejected: Mapping[str, str] | None = None) -> None:
        """400 for a field outside ``known`` and for a ``rejected`` field whose value is not a no-op
        (see :func:`is_noop`); ``rejected`` maps each to the message, e.g. "stop sequences are not
        supported; omit stop"."""
        rejected = rejected or {}
        for key, value in self.data.items():
            if value is None or key in known:
                continue
            if key in rejected:
                if not is_noop(value):
                    raise bad(self.param(key), f"{rejected[key]} (got {show(value)})")
                continue
            raise bad(self.param(key), f"is not supported by this gateway; supported fields: {', '.join(sorted(known))}")


def text_parts(value: Any, param: str, types: Collection[str], *, required: bool = True) -> str | None:
    """Content given as a string or as a list of text parts ``{"type": <one of types>, "text": str}``,
    joined with newlines (as vLLM joins text parts). Other part types (images, files, audio...) are a 400."""
    if value is None:
        if required:
            raise bad(param, "is required")
        return None
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad(param, f"must be a string or an array of text parts, got {show(value)}")
    texts = []
    for i, part in enumerate(value):
        f = Fields(part, f"{param}[{i}]")
        kind = f.text("type", required=True)
        if kind not in types:
            allowed = " or ".join(repr(t) for t in types)
            raise bad(f.param("type"), f"{show(kind)} content is not supported; only text parts (type {allowed}) are")
        texts.append(f.text("text", required=True) or "")
    return "\n".join(texts)


def function_tool(f: Fields, schema_key: str = "parameters") -> dict[str, Any]:
    """A canonical tool ``{"name", "description", "parameters"}`` from ``f``'s name, description and
    ``schema_key`` (a JSON Schema object; default: an object with no properties)."""
    name = f.text("name", required=True) or ""
    if not name:
        raise bad(f.param("name"), "must be a non-empty string")
    schema = f.object(schema_key)
    return {"name": name, "description": f.text("description") or "",
            "parameters": schema.data if schema is not None else {"type": "object", "properties": {}}}


def openai_tool_choice(f: Fields, name_of: Callable[[Fields], str | None]) -> str | dict[str, str]:
    """OpenAI's ``tool_choice``: a mode string, or a function object whose name ``name_of`` reads
    (Chat Completions nests it under ``function``, Responses does not)."""
    value = f.get("tool_choice")
    if value is None:
        return "auto"
    if isinstance(value, str):
        return f.text("tool_choice", choices=("auto", "none", "required")) or "auto"
    c = Fields(value, "tool_choice")
    c.text("type", required=True, choices=("function",))
    return {"name": name_of(c) or ""}


def json_format(fmt: Fields | None, schema_of: Callable[[Fields], Any]) -> dict[str, Any] | None:
    """An OpenAI output format (``text`` / ``json_object`` / ``json_schema``) as a ChatRequest's
    ``response_format``; ``schema_of`` reads the schema (where it sits differs by API)."""
    if fmt is None:
        return None
    kind = fmt.text("type", required=True, choices=("text", "json_object", "json_schema"))
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "schema": schema_of(fmt)}


def check_tools(tools: list[dict[str, Any]], tool_choice: str | dict[str, str], param: str,
                choice_param: str) -> None:
    """Tool names are unique; a required or named tool_choice has tools to choose from."""
    names = [t["name"] for t in tools]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise bad(f"{param}[{i}]", f"duplicate tool name {show(name)}")
    if isinstance(tool_choice, dict):
        if tool_choice["name"] not in names:
            raise bad(choice_param, f"names tool {show(tool_choice['name'])}, which is not in {param} "
                                    f"({', '.join(names) or 'no tools'})")
    elif tool_choice == "required" and not tools:
        raise bad(choice_param, f"{show(tool_choice)} needs at least one tool in {param}")


def link_tool_names(messages: list[Message]) -> list[Message]:
    """Give each tool message the ``name`` of the assistant tool call it answers, when known."""
    names: dict[str, str] = {}
    for m in messages:
        for call in m.get("tool_calls", ()):
            names[call["id"]] = call["name"]
        if m["role"] == "tool" and "name" not in m and m["tool_call_id"] in names:
            m["name"] = names[m["tool_call_id"]]
    return messages


def prefixed(prefix: str, ident: str) -> str:
    return ident if ident.startswith(prefix) else prefix + ident
