"""OpenAI Chat Completions (``POST /v1/chat/completions``), the text-and-function-tools subset.

Supported: ``messages`` (system/developer -> system, user, assistant with ``tool_calls`` of type
function, tool with ``tool_call_id``; content as a string or a list of text parts, joined with
newlines; ``name`` fields ignored), ``tools`` (type function), ``tool_choice``, ``response_format``
(text / json_object / json_schema), ``max_tokens`` / ``max_completion_tokens``, ``temperature``
([0, 2]), ``top_p`` ((0, 1]), ``n`` (1..16, also when streaming), ``seed`` (64 bits), ``logprobs`` (the
sampled token's only: ``top_logprobs`` must be 0), ``stream`` and ``stream_options.include_usage``.
``parallel_tool_calls: false`` (an answer carries the first tool call the model wrote).
Accepted and ignored: ``user``, ``metadata``, ``store``, ``service_tier``,
``prompt_cache_key``, ``prompt_cache_retention``, ``safety_identifier``, ``modalities: ["text"]``.
Rejected (400) unless absent or a no-op: ``stop``, ``logit_bias``, presence/frequency penalties,
``top_logprobs`` > 0, ``functions`` / ``function_call`` (deprecated), ``audio``, ``prediction``,
``web_search_options``, ``reasoning_effort``, ``verbosity``, ``moderation``; any other field; non-text
content parts (images, audio, files) and custom (non-function) tools.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from toolkit.core.protocol import SEED_RANGE
from toolkit.gateway.protocols.base import (
    TOOLKIT_FIELDS,
    Fields,
    Protocol,
    bad,
    check_tools,
    function_tool,
    json_format,
    link_tool_names,
    openai_tool_choice,
    show,
    sse,
    text_parts,
    token_logprobs,
)
from toolkit.gateway.types import ChatRequest, ChatResult, Choice, GatewayError, Message

KNOWN = {"model", "messages", "tools", "tool_choice", "response_format", "max_tokens", "max_completion_tokens",
         "temperature", "top_p", "n", "seed", "logprobs", "stream", "stream_options", "user", "metadata",
         "store", "parallel_tool_calls", "service_tier", "prompt_cache_key", "prompt_cache_retention",
         "safety_identifier", "modalities"}
REJECTED = {
    "stop": "stop sequences are not supported; omit stop",
    "logit_bias": "logit_bias is not supported; omit it",
    "presence_penalty": "penalties are not supported; omit presence_penalty or send 0",
    "frequency_penalty": "penalties are not supported; omit frequency_penalty or send 0",
    "top_logprobs": "only the sampled token's logprob is returned (logprobs: true); send top_logprobs 0",
    "functions": "functions is deprecated and not supported; use tools",
    "function_call": "function_call is deprecated and not supported; use tool_choice",
    "audio": "audio output is not supported; omit audio",
    "prediction": "predicted outputs are not supported; omit prediction",
    "web_search_options": "web search is not supported; omit web_search_options",
    "reasoning_effort": "reasoning effort is not supported; omit reasoning_effort",
    "verbosity": "verbosity is not supported; omit it",
    "moderation": "moderation is not supported; omit it",
}
TEXT = ("text",)

OPENAI_ERROR_TYPES = {"invalid_request": "invalid_request_error", "authentication": "authentication_error",
                      "not_found": "not_found_error", "request_too_large": "invalid_request_error",
                      "rate_limit": "rate_limit_error"}


def openai_error_body(err: GatewayError) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}`` (shared by Chat Completions and Responses)."""
    return {"error": {"message": err.message, "type": OPENAI_ERROR_TYPES.get(err.kind, "server_error"),
                      "param": err.param, "code": getattr(err, "code", None)}}


def _messages(f: Fields) -> list[Message]:
    items = f.array("messages", required=True) or []
    if not items:
        raise bad("messages", "must hold at least one message")
    out: list[Message] = []
    for i, item in enumerate(items):
        m = Fields(item, f"messages[{i}]")
        role = m.text("role", required=True, choices=("system", "developer", "user", "assistant", "tool"))
        if role == "assistant":
            for key in ("function_call", "audio"):
                if m.get(key) is not None:
                    raise bad(m.param(key), f"assistant {key} is not supported")
            msg: Message = {"role": "assistant",
                            "content": text_parts(m.get("content"), m.param("content"), TEXT, required=False) or ""}
            calls = []
            for j, raw in enumerate(m.array("tool_calls") or []):
                c = Fields(raw, m.param(f"tool_calls[{j}]"))
                c.text("type", choices=("function",))
                fn = c.child("function")
                calls.append({"id": c.text("id", required=True), "name": fn.text("name", required=True),
                              "arguments": fn.text("arguments", required=True)})
            if calls:
                msg["tool_calls"] = calls
        elif role == "tool":
            msg = {"role": "tool", "content": text_parts(m.get("content"), m.param("content"), TEXT),
                   "tool_call_id": m.text("tool_call_id", required=True)}
        else:
            msg = {"role": "system" if role == "developer" else role,
                   "content": text_parts(m.get("content"), m.param("content"), TEXT)}
        out.append(msg)
    return link_tool_names(out)


def _tools(f: Fields) -> list[dict[str, Any]]:
    tools = []
    for i, raw in enumerate(f.array("tools") or []):
        t = Fields(raw, f"tools[{i}]")
        t.text("type", required=True, choices=("function",))
        fn = t.child("function")
        tools.append(function_tool(fn))
    return tools


def _tool_choice(f: Fields) -> str | dict[str, str]:
    return openai_tool_choice(f, lambda c: c.child("function").text("name", required=True))


def _response_format(f: Fields) -> dict[str, Any] | None:
    return json_format(f.object("response_format"), lambda fmt: fmt.child("json_schema").child("schema").data)


class ChatCompletions(Protocol):
    name = "chat"
    route = "chat/completions"

    def parse(self, body: Any) -> ChatRequest:
        f = Fields(body)
        f.only(KNOWN | TOOLKIT_FIELDS, REJECTED)
        modalities = f.array("modalities")
        if modalities is not None and modalities != ["text"]:
            raise bad("modalities", f"only [\"text\"] is supported, got {show(modalities)}")
        max_tokens, max_completion = f.integer("max_tokens", 1), f.integer("max_completion_tokens", 1)
        if max_tokens is not None and max_completion is not None and max_tokens != max_completion:
            raise bad("max_completion_tokens", f"disagrees with max_tokens ({max_completion} != {max_tokens})")
        options = f.object("stream_options")
        include_usage = bool(options.flag("include_usage")) if options is not None else False
        req = ChatRequest(
            messages=_messages(f), tools=_tools(f), tool_choice=_tool_choice(f),
            response_format=_response_format(f),
            max_tokens=max_completion if max_completion is not None else max_tokens,
            temperature=f.number("temperature", 0, 2), top_p=f.number("top_p", 0, 1, lo_open=True),
            n=f.integer("n", 1, 16) or 1, seed=f.integer("seed", *SEED_RANGE), logprobs=bool(f.flag("logprobs")),
            stream=bool(f.flag("stream")), model=f.text("model") or "", include_usage=include_usage,
            parallel_tool_calls=f.flag("parallel_tool_calls") is not False)
        check_tools(req.tools, req.tool_choice, "tools", "tool_choice")
        return req

    def respond(self, req: ChatRequest, result: ChatResult) -> dict[str, Any]:
        choices = []
        for c in result.choices:
            message: dict[str, Any] = {"role": "assistant",
                                       "content": None if not c.content and c.tool_calls else c.content,
                                       "refusal": None}
            if c.tool_calls:
                message["tool_calls"] = _calls(c)
            choices.append({"index": c.index, "message": message,
                            "logprobs": _logprobs(c) if req.logprobs else None, "finish_reason": c.finish_reason})
        return {"id": result.id, "object": "chat.completion", "created": result.created, "model": result.model,
                "choices": choices, "usage": _usage(result), "system_fingerprint": None}

    def stream(self, req: ChatRequest, result: ChatResult) -> Iterator[bytes]:
        head = {"id": result.id, "object": "chat.completion.chunk", "created": result.created,
                "model": result.model, "system_fingerprint": None}
        if req.include_usage:
            head["usage"] = None

        def chunk(c: Choice, delta: dict[str, Any], finish: str | None = None,
                  logprobs: dict[str, Any] | None = None) -> bytes:
            return sse({**head, "choices": [{"index": c.index, "delta": delta, "logprobs": logprobs,
                                             "finish_reason": finish}]})

        for c in result.choices:
            logprobs = _logprobs(c) if req.logprobs else None
            yield chunk(c, {"role": "assistant", "content": ""})
            if c.content:
                yield chunk(c, {"content": c.content}, logprobs=logprobs)
                logprobs = None
            for i, call in enumerate(_calls(c)):
                first = {"index": i, "id": call["id"], "type": "function",
                         "function": {"name": call["function"]["name"], "arguments": ""}}
                yield chunk(c, {"tool_calls": [first]})
                if call["function"]["arguments"]:
                    args = {"arguments": call["function"]["arguments"]}  # the name was in the first delta
                    yield chunk(c, {"tool_calls": [{"index": i, "function": args}]})
            yield chunk(c, {}, finish=c.finish_reason, logprobs=logprobs)
        if req.include_usage:
            yield sse({**head, "choices": [], "usage": _usage(result)})
        yield b"data: [DONE]\n\n"

    def error_body(self, err: GatewayError) -> dict[str, Any]:
        return openai_error_body(err)


def _calls(c: Choice) -> list[dict[str, Any]]:
    return [{"id": t.id, "type": "function", "function": {"name": t.name, "arguments": t.arguments}}
            for t in c.tool_calls]


def _logprobs(c: Choice) -> dict[str, Any]:
    return {"content": token_logprobs(c), "refusal": None}


def _usage(result: ChatResult) -> dict[str, Any]:
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
            "total_tokens": result.prompt_tokens + result.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": result.cached_tokens}}
