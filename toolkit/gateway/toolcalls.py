"""Tool calls out of generated text, and the JSON Schema that constrains a forced call.

A :class:`ToolParser` turns one generated turn into ``(content, calls)``: ``content`` is the text with
the recognized calls removed, stripped of surrounding whitespace; ``calls`` are :class:`ToolCall` in the
order generated, each with a fresh id (``call_`` + 24 hex digits) and its arguments re-serialized as
JSON text (``json.dumps(obj, ensure_ascii=False)``). Parsing never raises: a block that is not a valid
call stays in the content, as generated. Parsers are chosen by name (:data:`PARSERS`, :func:`get_parser`):

- ``hermes`` (Qwen, Hermes, the tiny model's template): ``<tool_call>\\n{"name": "f", "arguments":
  {...}}\\n</tool_call>``, any number per turn; ``arguments`` is an object, or JSON text holding one.
  A last block cut off before ``</tool_call>`` still counts if its JSON is complete.
- ``none``: never finds a call.

When the gateway forces a call (``tool_choice`` ``required`` or a named function) it generates under
:func:`tool_call_schema` instead, bare JSON ``{"name": ..., "arguments": {...}}`` without tags, and
reads it back with :func:`parse_constrained_call`.
"""

from __future__ import annotations

import json
import re
import secrets
from abc import ABC, abstractmethod
from typing import Any

from toolkit.core.errors import ToolkitError
from toolkit.gateway.types import GatewayError, ToolCall, json_or


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _as_call(obj: Any) -> ToolCall | None:
    """A ToolCall from a decoded ``{"name": str, "arguments": object | JSON text of an object}``."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments")
    if isinstance(args, str):
        args = json_or(args, None)
    if not isinstance(args, dict):
        return None
    return ToolCall(id=new_call_id(), name=obj["name"], arguments=json.dumps(args, ensure_ascii=False))


def _loads(text: str) -> Any:
    return json_or(text, None)


class ToolParser(ABC):
    name: str

    @abstractmethod
    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """``(content without the calls, stripped; the calls in order)``. Never raises."""


class NoneParser(ToolParser):
    name = "none"

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        return text.strip(), []


class HermesParser(ToolParser):
    name = "hermes"
    # A closed block, or an unclosed one running to the end of the text (generation stopped early);
    # a block never spans another <tool_call>: an unclosed one does not swallow the next call.
    BLOCK = re.compile(r"<tool_call>((?:(?!<tool_call>).)*?)</tool_call>"
                       r"|<tool_call>((?:(?!<tool_call>).)*)\Z", re.DOTALL)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        if "<tool_call>" not in text:
            return text.strip(), []
        calls: list[ToolCall] = []
        kept: list[str] = []
        pos = 0
        for m in self.BLOCK.finditer(text):
            body = m.group(1) if m.group(1) is not None else m.group(2)
            call = _as_call(_loads(body.strip()))
            if call is None:
                continue  # not a call: the block stays in the content
            kept.append(text[pos:m.start()])
            pos = m.end()
            calls.append(call)
        kept.append(text[pos:])
        return "".join(kept).strip(), calls


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, NoneParser)}


def get_parser(name: str) -> ToolParser:
    """A new parser of that name; :class:`ToolkitError` naming the known ones otherwise."""
    try:
        return PARSERS[name]()
    except KeyError:
        known = ", ".join(sorted(PARSERS))
        raise ToolkitError(f"unknown tool-call parser {name!r}: one of {known}") from None


def parse_constrained_call(text: str) -> ToolCall | None:
    """The call in bare JSON generated under :func:`tool_call_schema`; None if it is not one (e.g. cut
    off by ``max_tokens``)."""
    return _as_call(_loads(text.strip()))


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    """``{"name", "description", "parameters"}`` from that shape or OpenAI's ``{"type", "function"}``."""
    inner = tool.get("function")
    return inner if isinstance(inner, dict) else tool


def _one_call_schema(fn: dict[str, Any]) -> dict[str, Any]:
    arguments = fn.get("parameters") or {"type": "object"}
    return {"type": "object",
            "properties": {"name": {"type": "string", "enum": [fn["name"]]}, "arguments": arguments},
            "required": ["name", "arguments"], "additionalProperties": False}


def tool_call_schema(tools: list[dict[str, Any]], name: str | None) -> dict[str, Any]:
    """The JSON Schema of one call of the tool ``name``, or with ``name`` None (``tool_choice:
    required``) of any one of ``tools``. A name not among the tools, or no tools, is a 400."""
    fns = [_function(t) for t in tools]
    if name is not None:
        for fn in fns:
            if fn.get("name") == name:
                return _one_call_schema(fn)
        known = ", ".join(repr(f.get("name")) for f in fns) or "none"
        raise GatewayError(400, f"tool_choice names {name!r}, not among the tools ({known})",
                           param="tool_choice")
    if not fns:
        raise GatewayError(400, "tool_choice 'required' needs at least one tool", param="tool_choice")
    return {"anyOf": [_one_call_schema(fn) for fn in fns]}
