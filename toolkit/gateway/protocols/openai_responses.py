"""OpenAI Responses (``POST /v1/responses``), the stateless subset NeMo-Gym's agents use.

Supported: ``input`` as a string (one user message) or a list of items: messages
``{"role": user|system|developer|assistant, "content": str | [input_text/output_text parts]}`` (with or
without ``"type": "message"``; output messages replayed as input are fine), ``function_call``
(``call_id``, ``name``, ``arguments``; consecutive calls join the preceding assistant message),
``function_call_output`` (``call_id``, ``output``) -> tool message, and empty ``reasoning`` items
(dropped); ``instructions`` (a leading system message); ``tools`` of type function; ``tool_choice``
(auto / none / required / ``{"type": "function", "name"}``); ``max_output_tokens``; ``temperature``
([0, 2]); ``top_p`` ((0, 1]); ``text.format`` (text / json_object / json_schema); ``stream``;
``include: ["message.output_text.logprobs"]`` (sampled-token logprobs); ``parallel_tool_calls: false``
(an answer carries the first tool call the model wrote). Accepted and ignored: ``store``, ``truncation``, ``metadata``, ``user``, ``service_tier``, other
``include`` values, ``prompt_cache_key``, ``prompt_cache_retention``, ``safety_identifier``,
``stream_options``, ``max_tool_calls`` (it bounds built-in tools, which are not offered).
Rejected (400) unless absent or a no-op: ``previous_response_id`` and ``conversation`` (the gateway
keeps no state: send the whole conversation), ``background``, ``prompt``, ``reasoning``,
``top_logprobs`` > 0, ``text.verbosity``, ``context_management``, ``moderation``; any other field;
built-in tools, non-text content, reasoning items with content, other input item types.

The answer has one message item (unless the turn is only tool calls) then one function_call item per
call; a turn cut by the token budget is ``"status": "incomplete"`` and streams ``response.incomplete``
as its last event, as OpenAI does.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

from toolkit.gateway.protocols.base import (
    TOOLKIT_FIELDS,
    Fields,
    Protocol,
    bad,
    check_tools,
    function_tool,
    is_noop,
    json_format,
    link_tool_names,
    openai_tool_choice,
    prefixed,
    show,
    sse,
    text_parts,
    token_logprobs,
)
from toolkit.gateway.protocols.openai_chat import openai_error_body
from toolkit.gateway.types import ChatRequest, ChatResult, GatewayError, Message

KNOWN = {"model", "input", "instructions", "tools", "tool_choice", "max_output_tokens", "temperature", "top_p",
         "text", "stream", "store", "parallel_tool_calls", "truncation", "metadata", "user", "service_tier",
         "include", "prompt_cache_key", "prompt_cache_retention", "safety_identifier", "stream_options",
         "max_tool_calls"}
REJECTED = {
    "previous_response_id": "the gateway keeps no responses: send the whole conversation in input",
    "conversation": "the gateway keeps no conversations: send the whole conversation in input",
    "background": "background responses are not supported; omit background",
    "prompt": "prompt templates are not supported; omit prompt",
    "reasoning": "reasoning options are not supported; omit reasoning",
    "top_logprobs": "only the sampled token's logprob is returned (include message.output_text.logprobs); "
                    "send top_logprobs 0",
    "context_management": "context management is not supported; omit it",
    "moderation": "moderation is not supported; omit it",
}
TEXT = ("input_text", "output_text")
LOGPROBS = "message.output_text.logprobs"


def _input(f: Fields) -> list[Message]:
    out: list[Message] = []
    instructions = f.text("instructions")
    if instructions is not None:
        out.append({"role": "system", "content": instructions})
    raw = f.get("input", required=True)
    if isinstance(raw, str):
        return [*out, {"role": "user", "content": raw}]
    if not isinstance(raw, list):
        raise bad("input", f"must be a string or an array of input items, got {show(raw)}")
    for i, item in enumerate(raw):
        it = Fields(item, f"input[{i}]")
        kind = it.text("type")
        if kind in (None, "message"):
            role = it.text("role", required=True, choices=("user", "system", "developer", "assistant"))
            content = text_parts(it.get("content"), it.param("content"), TEXT)
            out.append({"role": "system" if role == "developer" else role, "content": content})
        elif kind == "function_call":
            call = {"id": it.text("call_id", required=True), "name": it.text("name", required=True),
                    "arguments": it.text("arguments", required=True)}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "content": text_parts(it.get("output"), it.param("output"), TEXT),
                        "tool_call_id": it.text("call_id", required=True)})
        elif kind == "reasoning":
            for key in ("summary", "content", "encrypted_content"):
                if not is_noop(it.get(key)):
                    raise bad(it.param(key), "reasoning items are not supported; send them empty or drop them")
        else:
            raise bad(it.param("type"), f"{show(kind)} input items are not supported; supported: message, "
                                        "function_call, function_call_output (and empty reasoning items)")
    return link_tool_names(out)


def _tools(f: Fields) -> list[dict[str, Any]]:
    tools = []
    for i, raw in enumerate(f.array("tools") or []):
        t = Fields(raw, f"tools[{i}]")
        kind = t.text("type", required=True)
        if kind != "function":
            raise bad(t.param("type"), f"{show(kind)} tools are not supported; only type 'function' is")
        t.flag("strict")
        tools.append(function_tool(t))
    return tools


def _tool_choice(f: Fields) -> str | dict[str, str]:
    return openai_tool_choice(f, lambda c: c.text("name", required=True))


def _format(f: Fields) -> dict[str, Any] | None:
    text = f.object("text")
    if text is None:
        return None
    text.only({"format"}, {"verbosity": "verbosity is not supported; omit it"})
    return json_format(text.object("format"), lambda fmt: fmt.child("schema").data)


class Responses(Protocol):
    name = "responses"
    route = "responses"

    def parse(self, body: Any) -> ChatRequest:
        f = Fields(body)
        f.only(KNOWN | TOOLKIT_FIELDS, REJECTED)
        include = f.array("include") or []
        req = ChatRequest(
            messages=_input(f), tools=_tools(f), tool_choice=_tool_choice(f), response_format=_format(f),
            max_tokens=f.integer("max_output_tokens", 1), temperature=f.number("temperature", 0, 2),
            top_p=f.number("top_p", 0, 1, lo_open=True), logprobs=LOGPROBS in include,
            stream=bool(f.flag("stream")), model=f.text("model") or "",
            parallel_tool_calls=f.flag("parallel_tool_calls") is not False)
        check_tools(req.tools, req.tool_choice, "tools", "tool_choice")
        return req

    def respond(self, req: ChatRequest, result: ChatResult) -> dict[str, Any]:
        c = result.choices[0]
        incomplete = c.finish_reason == "length"
        output: list[dict[str, Any]] = []
        if c.content or not c.tool_calls:
            part: dict[str, Any] = {"type": "output_text", "text": c.content, "annotations": []}
            if req.logprobs:
                part["logprobs"] = token_logprobs(c)
            output.append({"type": "message", "id": prefixed("msg_", result.id), "role": "assistant",
                           "status": "incomplete" if incomplete else "completed", "content": [part]})
        for t in c.tool_calls:
            output.append({"type": "function_call", "id": prefixed("fc_", t.id), "call_id": t.id, "name": t.name,
                           "arguments": t.arguments, "status": "completed"})
        tool_choice: str | dict[str, str] = req.tool_choice
        if isinstance(tool_choice, dict):
            tool_choice = {"type": "function", "name": tool_choice["name"]}
        fmt = req.response_format or {"type": "text"}
        if fmt["type"] == "json_schema":
            fmt = {"type": "json_schema", "name": "response", "schema": fmt["schema"], "strict": False}
        return {
            "id": prefixed("resp_", result.id), "object": "response", "created_at": result.created,
            "status": "incomplete" if incomplete else "completed", "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": None, "model": result.model, "output": output,
            "tools": [{"type": "function", "name": t["name"], "description": t["description"],
                       "parameters": t["parameters"], "strict": False} for t in req.tools],
            "tool_choice": tool_choice, "parallel_tool_calls": req.parallel_tool_calls, "temperature": req.temperature,
            "top_p": req.top_p, "max_output_tokens": req.max_tokens, "previous_response_id": None,
            "text": {"format": fmt}, "truncation": "disabled", "metadata": {},
            "usage": {"input_tokens": result.prompt_tokens, "output_tokens": result.completion_tokens,
                      "total_tokens": result.prompt_tokens + result.completion_tokens,
                      "input_tokens_details": {"cached_tokens": result.cached_tokens, "cache_write_tokens": 0},
                      "output_tokens_details": {"reasoning_tokens": 0}},
        }

    def stream(self, req: ChatRequest, result: ChatResult) -> Iterator[bytes]:
        final = self.respond(req, result)
        seq = itertools.count()

        def event(kind: str, **fields: Any) -> bytes:
            return sse({"type": kind, "sequence_number": next(seq), **fields}, event=kind)

        start = {**final, "status": "in_progress", "incomplete_details": None, "output": [], "usage": None}
        yield event("response.created", response=start)
        yield event("response.in_progress", response=start)
        for index, item in enumerate(final["output"]):
            at = {"item_id": item["id"], "output_index": index}
            if item["type"] == "message":
                yield event("response.output_item.added", output_index=index,
                            item={**item, "status": "in_progress", "content": []})
                part = item["content"][0]
                logprobs = part.get("logprobs", [])
                yield event("response.content_part.added", **at, content_index=0,
                            part={"type": "output_text", "text": "", "annotations": []})
                if part["text"]:
                    yield event("response.output_text.delta", **at, content_index=0, delta=part["text"],
                                logprobs=logprobs)
                yield event("response.output_text.done", **at, content_index=0, text=part["text"],
                            logprobs=logprobs)
                yield event("response.content_part.done", **at, content_index=0, part=part)
            else:
                yield event("response.output_item.added", output_index=index,
                            item={**item, "arguments": "", "status": "in_progress"})
                if item["arguments"]:
                    yield event("response.function_call_arguments.delta", **at, delta=item["arguments"])
                yield event("response.function_call_arguments.done", **at, name=item["name"],
                            arguments=item["arguments"])
            yield event("response.output_item.done", output_index=index, item=item)
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        yield event(kind, response=final)

    def error_body(self, err: GatewayError) -> dict[str, Any]:
        return openai_error_body(err)
