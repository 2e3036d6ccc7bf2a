"""Anthropic Messages (``POST /v1/messages``), the text-and-client-tools subset.

Supported: ``system`` (a string or text blocks); ``messages`` with content as a string or blocks:
``text``, assistant ``tool_use`` (-> tool calls whose arguments are the ``input`` as JSON text) and user
``tool_result`` (content a string or text blocks; -> tool messages, in order, before the user text of
the same message); ``tools`` (``name``, ``description``, ``input_schema``); ``tool_choice`` (auto ->
auto, any -> required, tool -> that tool, none -> none); ``max_tokens`` (required); ``temperature``
([0, 1]); ``top_p`` ((0, 1]); ``output_config.format`` (json_schema); ``stream``; ``tool_choice.disable_parallel_tool_use`` (an
answer carries the first tool call the model wrote). Accepted and ignored: ``metadata``, ``service_tier``,
``cache_control`` on blocks, ``is_error`` on tool results (the model sees the content only), ``thinking: {"type":
"disabled"}``, ``top_k`` null, ``stop_sequences`` [].
Rejected (400): ``top_k``, non-empty ``stop_sequences``, ``thinking`` (unless disabled),
``output_config.effort``, any other field; ``thinking``/``image``/``document`` and server-tool blocks,
server tools, and a final assistant message (prefill: the gateway starts a new assistant turn).

The answer uses ``choices[0]``: a text block (if any text) then one ``tool_use`` block per call whose
arguments parse as a JSON object (others become text blocks); ``stop_reason`` is ``max_tokens`` on
length, ``tool_use`` when there is a tool_use block, else ``end_turn``. ``usage.input_tokens`` excludes
the cached prompt tokens (``cache_read_input_tokens``), as Anthropic counts them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from toolkit.gateway.protocols.base import (
    TOOLKIT_FIELDS,
    Fields,
    Protocol,
    bad,
    check_tools,
    dumps,
    function_tool,
    link_tool_names,
    prefixed,
    show,
    sse,
    text_parts,
)
from toolkit.gateway.types import ChatRequest, ChatResult, GatewayError, Message, json_or

KNOWN = {"model", "messages", "system", "tools", "tool_choice", "max_tokens", "temperature", "top_p", "stream",
         "metadata", "service_tier", "thinking", "output_config"}
REJECTED = {"top_k": "top_k is not supported; omit it",
            "stop_sequences": "stop sequences are not supported; omit stop_sequences or send []"}
TEXT = ("text",)
ERROR_TYPES = {"invalid_request": "invalid_request_error", "authentication": "authentication_error",
               "not_found": "not_found_error", "request_too_large": "request_too_large",
               "rate_limit": "rate_limit_error", "overloaded": "overloaded_error"}


def _blocks(m: Fields) -> list[Fields]:
    content = m.get("content", required=True)
    if isinstance(content, str):
        return [Fields({"type": "text", "text": content}, m.param("content"))]
    if not isinstance(content, list):
        raise bad(m.param("content"), f"must be a string or an array of content blocks, got {show(content)}")
    return [Fields(b, m.param(f"content[{j}]")) for j, b in enumerate(content)]


def _messages(f: Fields) -> list[Message]:
    out: list[Message] = []
    system = f.get("system")
    if system is not None:
        out.append({"role": "system", "content": text_parts(system, "system", TEXT)})
    items = f.array("messages", required=True) or []
    if not items:
        raise bad("messages", "must hold at least one message")
    for i, item in enumerate(items):
        m = Fields(item, f"messages[{i}]")
        role = m.text("role", required=True, choices=("user", "assistant"))
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        results = 0
        for b in _blocks(m):
            kind = b.text("type", required=True)
            if kind == "text":
                texts.append(b.text("text", required=True) or "")
            elif kind == "tool_use" and role == "assistant":
                args = b.get("input", required=True)
                if not isinstance(args, dict):
                    raise bad(b.param("input"), f"must be an object, got {show(args)}")
                calls.append({"id": b.text("id", required=True), "name": b.text("name", required=True),
                              "arguments": json.dumps(args, ensure_ascii=False)})
            elif kind == "tool_result" and role == "user":
                b.flag("is_error")
                results += 1
                out.append({"role": "tool", "content": text_parts(b.get("content"), b.param("content"), TEXT,
                                                                  required=False) or "",
                            "tool_call_id": b.text("tool_use_id", required=True)})
            else:
                raise bad(b.param("type"), f"{show(kind)} blocks are not supported in {role} messages; supported: "
                                           + ("text, tool_use" if role == "assistant" else "text, tool_result"))
        if role == "assistant":
            msg: Message = {"role": "assistant", "content": "\n".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
        elif texts or not results:
            out.append({"role": "user", "content": "\n".join(texts)})
    if items and out[-1]["role"] == "assistant":
        raise bad(f"messages[{len(items) - 1}]", "a final assistant message (prefill) is not supported; "
                                                  "end with a user message")
    return link_tool_names(out)


def _tools(f: Fields) -> list[dict[str, Any]]:
    tools = []
    for i, raw in enumerate(f.array("tools") or []):
        t = Fields(raw, f"tools[{i}]")
        kind = t.text("type")
        if kind not in (None, "custom"):
            raise bad(t.param("type"), f"server tool {show(kind)} is not supported; only client tools "
                                       "({name, description, input_schema}) are")
        if t.get("input_schema") is None:
            raise bad(t.param("input_schema"), "is required")
        tools.append(function_tool(t, "input_schema"))
    return tools


def _one_call(f: Fields) -> bool:
    """``tool_choice.disable_parallel_tool_use``: at most one tool call an answer."""
    c = f.object("tool_choice")
    return bool(c is not None and c.flag("disable_parallel_tool_use"))


def _tool_choice(f: Fields) -> str | dict[str, str]:
    c = f.object("tool_choice")
    if c is None:
        return "auto"
    kind = c.text("type", required=True, choices=("auto", "any", "tool", "none"))
    if kind == "tool":
        return {"name": c.text("name", required=True) or ""}
    return "required" if kind == "any" else kind or "auto"


def _format(f: Fields) -> dict[str, Any] | None:
    config = f.object("output_config")
    if config is None:
        return None
    config.only({"format"}, {"effort": "effort is not supported; omit it"})
    fmt = config.object("format")
    if fmt is None:
        return None
    fmt.text("type", required=True, choices=("json_schema",))
    return {"type": "json_schema", "schema": fmt.child("schema").data}


class Messages(Protocol):
    name = "messages"
    route = "messages"

    def parse(self, body: Any) -> ChatRequest:
        f = Fields(body)
        f.only(KNOWN | TOOLKIT_FIELDS, REJECTED)
        thinking = f.object("thinking")
        if thinking is not None and thinking.text("type", required=True) != "disabled":
            raise bad("thinking.type", "extended thinking is not supported; omit thinking or send type 'disabled'")
        max_tokens = f.integer("max_tokens", 1)
        if max_tokens is None:
            raise bad("max_tokens", "is required (an integer >= 1)")
        req = ChatRequest(
            messages=_messages(f), tools=_tools(f), tool_choice=_tool_choice(f), response_format=_format(f),
            max_tokens=max_tokens, temperature=f.number("temperature", 0, 1),
            top_p=f.number("top_p", 0, 1, lo_open=True), stream=bool(f.flag("stream")),
            model=f.text("model") or "", parallel_tool_calls=not _one_call(f))
        check_tools(req.tools, req.tool_choice, "tools", "tool_choice")
        return req

    def respond(self, req: ChatRequest, result: ChatResult) -> dict[str, Any]:
        c = result.choices[0]
        content: list[dict[str, Any]] = [{"type": "text", "text": c.content}] if c.content else []
        for t in c.tool_calls:
            args = json_or(t.arguments, None) if t.arguments.strip() else {}
            if isinstance(args, dict):
                content.append({"type": "tool_use", "id": t.id, "name": t.name, "input": args})
            else:
                content.append({"type": "text", "text": t.arguments})
        if c.finish_reason == "length":
            stop_reason = "max_tokens"
        elif any(b["type"] == "tool_use" for b in content):
            stop_reason = "tool_use"
        else:
            stop_reason = "end_turn"
        return {"id": prefixed("msg_", result.id), "type": "message", "role": "assistant", "model": result.model,
                "content": content, "stop_reason": stop_reason, "stop_sequence": None,
                "usage": {"input_tokens": result.prompt_tokens - result.cached_tokens,
                          "output_tokens": result.completion_tokens,
                          "cache_read_input_tokens": result.cached_tokens, "cache_creation_input_tokens": 0}}

    def stream(self, req: ChatRequest, result: ChatResult) -> Iterator[bytes]:
        final = self.respond(req, result)

        def event(kind: str, **fields: Any) -> bytes:
            return sse({"type": kind, **fields}, event=kind)

        usage = final["usage"]
        yield event("message_start", message={**final, "content": [], "stop_reason": None,
                                              "usage": {**usage, "output_tokens": 0}})
        for index, block in enumerate(final["content"]):
            if block["type"] == "text":
                yield event("content_block_start", index=index, content_block={"type": "text", "text": ""})
                if block["text"]:
                    yield event("content_block_delta", index=index,
                                delta={"type": "text_delta", "text": block["text"]})
            else:
                yield event("content_block_start", index=index, content_block={**block, "input": {}})
                yield event("content_block_delta", index=index,
                            delta={"type": "input_json_delta", "partial_json": dumps(block["input"])})
            yield event("content_block_stop", index=index)
        yield event("message_delta", delta={"stop_reason": final["stop_reason"], "stop_sequence": None},
                    usage=usage)
        yield event("message_stop")

    def error_body(self, err: GatewayError) -> dict[str, Any]:
        return {"type": "error", "error": {"type": ERROR_TYPES.get(err.kind, "api_error"), "message": err.message}}
