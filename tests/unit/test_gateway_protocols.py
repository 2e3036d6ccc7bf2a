"""The gateway's protocol adapters: parsing into ChatRequest, strict 400s, and the rendered answers as
the real ``openai`` and ``anthropic`` SDKs see them through a small aiohttp server."""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Awaitable, Callable
from typing import Any

import anthropic
import openai
import pydantic
import pytest
from aiohttp import web
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent

from toolkit.gateway.protocols import PROTOCOLS, Protocol
from toolkit.gateway.stream import answer
from toolkit.gateway.types import ChatRequest, ChatResult, Choice, GatewayError, ToolCall

CHAT, RESPONSES, MESSAGES = PROTOCOLS["chat"], PROTOCOLS["responses"], PROTOCOLS["messages"]

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TIME = {"type": "object", "properties": {"tz": {"type": "string"}}}
CANON_TOOLS = [{"name": "get_weather", "description": "Weather of a city", "parameters": WEATHER},
               {"name": "get_time", "description": "", "parameters": TIME}]
CALLS = [ToolCall("call_a", "get_weather", '{"city": "Paris"}'), ToolCall("call_b", "get_time", '{"tz": "CET"}')]


def result(*choices: Choice) -> ChatResult:
    return ChatResult(id="chatcmpl-1", model="served-model", created=1700000000, choices=list(choices),
                      prompt_tokens=10, completion_tokens=2, cached_tokens=4)


def choice(content: str, calls: list[ToolCall] | None = None, finish: str = "stop", index: int = 0) -> Choice:
    return Choice(index=index, content=content, tool_calls=calls or [], finish_reason=finish, token_ids=[5, 6],
                  logprobs=[-0.25, float("-inf")], tokens_text=["Hel", "lo"])


RESULTS = {"text": result(choice("Hello there")),
           "tools": result(choice("Checking.", CALLS, "tool_calls")),
           "only-tools": result(choice("", CALLS, "tool_calls")),
           "length": result(choice("partial", finish="length")),
           "two": result(choice("first"), choice("second", index=1))}


# ---------------------------------------------------------------- parsing

def test_chat_parse() -> None:
    body = {
        "model": "m",
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "name": "bob", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": None, "refusal": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"X"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            {"role": "assistant", "content": "It is sunny."},
            {"role": "user", "content": "thanks"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                                    "parameters": WEATHER}},
                  {"type": "function", "function": {"name": "get_time", "parameters": TIME, "strict": True}}],
        "tool_choice": {"type": "function", "function": {"name": "get_time"}},
        "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": TIME}},
        "max_completion_tokens": 50, "temperature": 0.5, "top_p": 0.9, "n": 2, "seed": 7, "logprobs": True,
        "top_logprobs": 0, "stream": True, "stream_options": {"include_usage": True}, "user": "u",
        "metadata": {"k": "v"}, "store": False, "parallel_tool_calls": True, "service_tier": "auto",
        "stop": None, "presence_penalty": 0, "modalities": ["text"]}
    assert CHAT.parse(body) == ChatRequest(
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a\nb"},
                  {"role": "assistant", "content": "", "tool_calls": [
                      {"id": "c1", "name": "get_weather", "arguments": '{"city":"X"}'}]},
                  {"role": "tool", "content": "sunny", "tool_call_id": "c1", "name": "get_weather"},
                  {"role": "assistant", "content": "It is sunny."}, {"role": "user", "content": "thanks"}],
        tools=CANON_TOOLS, tool_choice={"name": "get_time"},
        response_format={"type": "json_schema", "schema": TIME}, max_tokens=50, temperature=0.5, top_p=0.9,
        n=2, seed=7, logprobs=True, stream=True, model="m", include_usage=True)
    minimal = CHAT.parse({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 9,
                          "response_format": {"type": "json_object"}, "tool_choice": "none"})
    assert minimal == ChatRequest(messages=[{"role": "user", "content": "hi"}], max_tokens=9, tool_choice="none",
                                  response_format={"type": "json_object"})
    assert not CHAT.parse({**body, "parallel_tool_calls": False}).parallel_tool_calls  # one call an answer


USER = [{"role": "user", "content": "hi"}]
CHAT_TOOL = [{"type": "function", "function": {"name": "f", "parameters": {}}}]

CHAT_BAD: list[tuple[Any, str]] = [
    ([], "body"),
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "function", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                {"type": "image_url", "image_url": {"url": "u"}}]}]},
     "messages[0].content[1].type"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [*USER, {"role": "tool", "content": "x"}]}, "messages[1].tool_call_id"),
    ({"messages": [*USER, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"messages": [*USER, {"role": "assistant", "tool_calls": [{"id": "c", "type": "custom", "custom": {}}]}]},
     "messages[1].tool_calls[0].type"),
    ({"messages": USER, "stop": ["\n"]}, "stop"),
    ({"messages": USER, "stop": "END"}, "stop"),
    ({"messages": USER, "logit_bias": {"50256": -100}}, "logit_bias"),
    ({"messages": USER, "top_logprobs": 2, "logprobs": True}, "top_logprobs"),
    ({"messages": USER, "frequency_penalty": 0.5}, "frequency_penalty"),
    ({"messages": USER, "functions": [{"name": "f"}]}, "functions"),
    ({"messages": USER, "reasoning_effort": "high"}, "reasoning_effort"),
    ({"messages": USER, "modalities": ["text", "audio"]}, "modalities"),
    ({"messages": USER, "n": 17}, "n"),
    ({"messages": USER, "n": 0}, "n"),
    ({"messages": USER, "temperature": 2.5}, "temperature"),
    ({"messages": USER, "temperature": "hot"}, "temperature"),
    ({"messages": USER, "top_p": 0}, "top_p"),
    ({"messages": USER, "max_tokens": 0}, "max_tokens"),
    ({"messages": USER, "max_tokens": True}, "max_tokens"),
    ({"messages": USER, "max_tokens": 10, "max_completion_tokens": 20}, "max_completion_tokens"),
    ({"messages": USER, "seed": 1.5}, "seed"),
    ({"messages": USER, "seed": 1 << 64}, "seed"),  # past the wire's 64 bits: a 400, not a 500
    ({"messages": USER, "logprobs": "yes"}, "logprobs"),
    ({"messages": USER, "stream": "yes"}, "stream"),
    ({"messages": USER, "chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs"),
    ({"messages": USER, "tools": [{"type": "custom", "custom": {"name": "f"}}]}, "tools[0].type"),
    ({"messages": USER, "tools": [{"type": "function", "function": {"description": "no name"}}]},
     "tools[0].function.name"),
    ({"messages": USER, "tools": CHAT_TOOL + CHAT_TOOL}, "tools[1]"),
    ({"messages": USER, "tools": CHAT_TOOL, "tool_choice": "sometimes"}, "tool_choice"),
    ({"messages": USER, "tool_choice": "required"}, "tool_choice"),
    ({"messages": USER, "tools": CHAT_TOOL, "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice"),
    ({"messages": USER, "tools": CHAT_TOOL, "tool_choice": {"type": "allowed_tools", "allowed_tools": {}}},
     "tool_choice.type"),
    ({"messages": USER, "response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"name": "r"}}},
     "response_format.json_schema.schema"),
    ({"messages": USER, "response_format": {"type": "grammar"}}, "response_format.type"),
]

RESP_BAD: list[tuple[Any, str]] = [
    ({}, "input"),
    ({"input": 5}, "input"),
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": "hi", "top_logprobs": 3}, "top_logprobs"),
    ({"input": "hi", "text": {"verbosity": "low"}}, "text.verbosity"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "r"}}}, "text.format.schema"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "temperature": -1}, "temperature"),
    ({"input": "hi", "frequency_penalty": 1}, "frequency_penalty"),
    ({"input": [{"type": "reasoning", "id": "rs", "summary": [{"type": "summary_text", "text": "hmm"}]}]},
     "input[0].summary"),
    ({"input": [{"type": "reasoning", "id": "rs", "summary": [], "encrypted_content": "xyz"}]},
     "input[0].encrypted_content"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input[0].output"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "hi", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "file_search"}},
     "tool_choice.type"),
    ({"input": "hi", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function",
                                                                                   "name": "g"}}, "tool_choice"),
]

MSG = [{"role": "user", "content": "hi"}]
MESSAGES_BAD: list[tuple[Any, str]] = [
    ({"messages": MSG}, "max_tokens"),
    ({"max_tokens": 10}, "messages"),
    ({"max_tokens": 10, "messages": MSG, "top_k": 5}, "top_k"),
    ({"max_tokens": 10, "messages": MSG, "stop_sequences": ["\n\nHuman:"]}, "stop_sequences"),
    ({"max_tokens": 10, "messages": MSG, "thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking.type"),
    ({"max_tokens": 10, "messages": MSG, "temperature": 1.5}, "temperature"),
    ({"max_tokens": 10, "messages": MSG, "output_config": {"effort": "high"}}, "output_config.effort"),
    ({"max_tokens": 10, "messages": MSG, "container": "c"}, "container"),
    ({"max_tokens": 10, "messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"max_tokens": 10, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}]}]},
     "messages[0].content[0].type"),
    ({"max_tokens": 10, "messages": [*MSG, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "hmm", "signature": "s"}]}, *MSG]}, "messages[1].content[0].type"),
    ({"max_tokens": 10, "messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]}, "messages[0].content[0].type"),
    ({"max_tokens": 10, "messages": [*MSG, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": "{}"}]}, *MSG]}, "messages[1].content[0].input"),
    ({"max_tokens": 10, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image", "source": {}}]}]}]},
     "messages[0].content[0].content[0].type"),
    ({"max_tokens": 10, "messages": [*MSG, {"role": "assistant", "content": "The answer is"}]}, "messages[1]"),
    ({"max_tokens": 10, "messages": MSG, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     "tools[0].type"),
    ({"max_tokens": 10, "messages": MSG, "tools": [{"name": "f"}]}, "tools[0].input_schema"),
    ({"max_tokens": 10, "messages": MSG, "tools": [{"name": "f", "input_schema": {}}],
      "tool_choice": {"type": "tool", "name": "g"}}, "tool_choice"),
    ({"max_tokens": 10, "messages": MSG, "tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
]


@pytest.mark.parametrize(("proto", "body", "param"),
                         [(CHAT, b, p) for b, p in CHAT_BAD] + [(RESPONSES, b, p) for b, p in RESP_BAD]
                         + [(MESSAGES, b, p) for b, p in MESSAGES_BAD])
def test_bad_requests_are_400_naming_the_field(proto: Protocol, body: Any, param: str) -> None:
    with pytest.raises(GatewayError) as info:
        proto.parse(body)
    assert info.value.status == 400
    assert info.value.param == param
    assert info.value.message.startswith(param + ": ")


@pytest.mark.parametrize(("proto", "body"), [
    (CHAT, {"messages": [{"role": "user", "content": "hi"}]}),
    (RESPONSES, {"input": "hi"}),
    (MESSAGES, {"max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}),
], ids=lambda v: getattr(v, "name", ""))
def test_every_protocol_takes_the_agents_length_guess(proto: Protocol, body: dict[str, Any]) -> None:
    assert proto.request(body).expected_tokens == 0
    assert proto.request({**body, "expected_tokens": 700}).expected_tokens == 700
    for bad in (-1, "long", 2.5, 1 << 64):
        with pytest.raises(GatewayError) as info:
            proto.request({**body, "expected_tokens": bad})
        assert (info.value.status, info.value.param) == (400, "expected_tokens")


def test_responses_parse() -> None:
    body = {
        "model": "m", "instructions": "Be brief.",
        "input": [
            {"role": "user", "content": "weather?"},
            {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
             "content": [{"type": "output_text", "text": "Checking.", "annotations": [], "logprobs": []}]},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}", "id": "fc_1",
             "status": "completed"},
            {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "noon"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": None},
            {"type": "function_call", "call_id": "c3", "name": "get_time", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c3", "output": "1pm"},
            {"role": "developer", "content": [{"type": "input_text", "text": "Answer now."}]}],
        "tools": [{"type": "function", "name": "get_weather", "description": "Weather of a city",
                   "parameters": WEATHER, "strict": True},
                  {"type": "function", "name": "get_time", "parameters": TIME}],
        "tool_choice": {"type": "function", "name": "get_weather"}, "max_output_tokens": 100,
        "temperature": 0.7, "top_p": 1, "text": {"format": {"type": "json_schema", "name": "r", "schema": TIME}},
        "include": ["message.output_text.logprobs"], "store": False, "parallel_tool_calls": True,
        "truncation": "disabled", "metadata": {}, "previous_response_id": None, "reasoning": None,
        "top_logprobs": 0, "stream": False}
    tool = {"role": "tool"}
    assert RESPONSES.parse(body) == ChatRequest(
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "weather?"},
                  {"role": "assistant", "content": "Checking.", "tool_calls": [
                      {"id": "c1", "name": "get_weather", "arguments": "{}"},
                      {"id": "c2", "name": "get_time", "arguments": "{}"}]},
                  {**tool, "content": "sunny", "tool_call_id": "c1", "name": "get_weather"},
                  {**tool, "content": "noon", "tool_call_id": "c2", "name": "get_time"},
                  {"role": "assistant", "content": "", "tool_calls": [
                      {"id": "c3", "name": "get_time", "arguments": "{}"}]},
                  {**tool, "content": "1pm", "tool_call_id": "c3", "name": "get_time"},
                  {"role": "system", "content": "Answer now."}],
        tools=CANON_TOOLS, tool_choice={"name": "get_weather"},
        response_format={"type": "json_schema", "schema": TIME}, max_tokens=100, temperature=0.7, top_p=1.0,
        logprobs=True, model="m")
    assert RESPONSES.parse({"input": "hi", "stream": True, "text": {"format": {"type": "text"}}}) == ChatRequest(
        messages=[{"role": "user", "content": "hi"}], stream=True)


def test_messages_parse() -> None:
    body = {
        "model": "claude", "max_tokens": 64, "metadata": {"user_id": "u"}, "stop_sequences": [], "stream": True,
        "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "tu1", "name": "get_weather", "input": {"city": "Zürich"}},
                {"type": "tool_use", "id": "tu2", "name": "get_time", "input": {}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "tu1", "content": "sunny"},
                {"type": "tool_result", "tool_use_id": "tu2", "content": [{"type": "text", "text": "noon"}],
                 "is_error": True},
                {"type": "text", "text": "thanks"}]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "tu3", "name": "get_time", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu3"}]}],
        "tools": [{"name": "get_weather", "description": "Weather of a city", "input_schema": WEATHER},
                  {"name": "get_time", "input_schema": TIME, "cache_control": {"type": "ephemeral"}}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True}, "temperature": 0.3, "top_p": 0.8,
        "thinking": {"type": "disabled"}}
    assert MESSAGES.parse(body) == ChatRequest(
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "weather?"},
                  {"role": "assistant", "content": "Checking.", "tool_calls": [
                      {"id": "tu1", "name": "get_weather", "arguments": '{"city": "Zürich"}'},
                      {"id": "tu2", "name": "get_time", "arguments": "{}"}]},
                  {"role": "tool", "content": "sunny", "tool_call_id": "tu1", "name": "get_weather"},
                  {"role": "tool", "content": "noon", "tool_call_id": "tu2", "name": "get_time"},
                  {"role": "user", "content": "thanks"},
                  {"role": "assistant", "content": "", "tool_calls": [
                      {"id": "tu3", "name": "get_time", "arguments": "{}"}]},
                  {"role": "tool", "content": "", "tool_call_id": "tu3", "name": "get_time"}],
        tools=CANON_TOOLS, tool_choice="required", max_tokens=64, temperature=0.3, top_p=0.8, stream=True,
        model="claude", parallel_tool_calls=False)
    choices = {"auto": "auto", "none": "none", "tool": {"name": "get_time"}}
    for kind, expected in choices.items():
        req = MESSAGES.parse({**body, "tool_choice": {"type": kind, "name": "get_time"}})
        assert req.tool_choice == expected
    fmt = {"output_config": {"format": {"type": "json_schema", "schema": TIME}}}
    assert MESSAGES.parse({**body, **fmt}).response_format == {"type": "json_schema", "schema": TIME}


# ---------------------------------------------------------------- rendering, checked by the SDKs' models

def frames(proto: Protocol, req: ChatRequest, res: ChatResult) -> list[tuple[str | None, Any]]:
    """(event name, decoded data) of each SSE frame, checking each frame is complete."""
    out: list[tuple[str | None, Any]] = []
    for frame in proto.stream(req, res):
        text = frame.decode()
        assert text.endswith("\n\n") and text.count("\n\n") == 1, text
        lines = text.strip("\n").split("\n")
        event = lines[0].removeprefix("event: ") if lines[0].startswith("event: ") else None
        assert lines[-1].startswith("data: ") and len(lines) == (2 if event else 1)
        data = lines[-1].removeprefix("data: ")
        out.append((event, data if data == "[DONE]" else json.loads(data)))
    return out


@pytest.mark.parametrize("name", sorted(RESULTS))
def test_rendered_bodies_validate_against_the_sdk_models(name: str) -> None:
    res = RESULTS[name]
    for logprobs in (False, True):
        req = ChatRequest(messages=USER, tools=CANON_TOOLS, logprobs=logprobs, include_usage=True,
                          response_format={"type": "json_schema", "schema": TIME})
        ChatCompletion.model_validate(CHAT.respond(req, res))
        chunks = frames(CHAT, req, res)
        assert chunks[-1] == (None, "[DONE]")
        for _, data in chunks[:-1]:
            ChatCompletionChunk.model_validate(data)
        assert chunks[-2][1]["usage"]["total_tokens"] == 12
        first = res.choices[:1]
        Response.model_validate(RESPONSES.respond(req, result(*first)))
        events = pydantic.TypeAdapter(ResponseStreamEvent)
        for event, data in frames(RESPONSES, req, result(*first)):
            assert event == data["type"]
            events.validate_python(data)
        anthropic.types.Message.model_validate(MESSAGES.respond(req, result(*first)))
        raw = pydantic.TypeAdapter(anthropic.types.RawMessageStreamEvent)
        for event, data in frames(MESSAGES, req, result(*first)):
            assert event == data["type"]
            raw.validate_python(data)


def test_logprobs_and_fallbacks() -> None:
    req = ChatRequest(messages=USER, logprobs=True)
    lp = CHAT.respond(req, RESULTS["text"])["choices"][0]["logprobs"]["content"]
    assert lp == [{"token": "Hel", "logprob": -0.25, "bytes": [72, 101, 108], "top_logprobs": []},
                  {"token": "lo", "logprob": -9999.0, "bytes": [108, 111], "top_logprobs": []}]
    assert RESPONSES.respond(req, RESULTS["text"])["output"][0]["content"][0]["logprobs"] == lp
    only = CHAT.respond(req, RESULTS["only-tools"])["choices"][0]["message"]
    assert only["content"] is None and len(only["tool_calls"]) == 2
    assert [o["type"] for o in RESPONSES.respond(req, RESULTS["only-tools"])["output"]] == ["function_call"] * 2
    empty = RESPONSES.respond(req, result(choice("")))["output"]
    assert [(o["type"], o["content"][0]["text"]) for o in empty] == [("message", "")]
    broken = result(choice("", [ToolCall("t1", "f", "{not json"), ToolCall("t2", "g", "[1]"),
                                ToolCall("t3", "h", "")], "tool_calls"))
    body = MESSAGES.respond(req, broken)
    assert body["content"] == [{"type": "text", "text": "{not json"}, {"type": "text", "text": "[1]"},
                               {"type": "tool_use", "id": "t3", "name": "h", "input": {}}]
    assert body["stop_reason"] == "tool_use"
    body = MESSAGES.respond(req, result(choice("", [ToolCall("t1", "f", "{oops")], "tool_calls")))
    assert body["stop_reason"] == "end_turn"


@pytest.mark.parametrize(("status", "openai_type", "anthropic_type"), [
    (400, "invalid_request_error", "invalid_request_error"), (401, "authentication_error", "authentication_error"),
    (404, "not_found_error", "not_found_error"), (413, "invalid_request_error", "request_too_large"),
    (429, "rate_limit_error", "rate_limit_error"), (500, "server_error", "api_error"),
    (503, "server_error", "overloaded_error"), (504, "server_error", "api_error")])
def test_error_bodies(status: int, openai_type: str, anthropic_type: str) -> None:
    err = GatewayError(status, "it went wrong", "temperature")
    expected = {"error": {"message": "it went wrong", "type": openai_type, "param": "temperature", "code": None}}
    assert CHAT.error_body(err) == expected and RESPONSES.error_body(err) == expected
    assert MESSAGES.error_body(err) == {"type": "error",
                                        "error": {"type": anthropic_type, "message": "it went wrong"}}


# ---------------------------------------------------------------- the real SDKs against a small server

class Gateway:
    """Serves every protocol on ``/sessions/{sid}/v1/<route>``; the request's ``model`` picks the answer
    in RESULTS (an unknown model is a 404)."""

    def __init__(self) -> None:
        self.seen: list[ChatRequest] = []

    def app(self) -> web.Application:
        app = web.Application()
        for proto in PROTOCOLS.values():
            app.router.add_post(f"/sessions/{{sid}}/v1/{proto.route}", self.handler(proto))
        return app

    def handler(self, proto: Protocol) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def handle(request: web.Request) -> web.StreamResponse:
            try:
                req = proto.parse(await request.json())
                self.seen.append(req)
                if req.model not in RESULTS:
                    raise GatewayError(404, f"model {req.model!r} does not exist", "model")
                res = copy.deepcopy(RESULTS[req.model])
            except GatewayError as err:
                return web.json_response(proto.error_body(err), status=err.status)
            return await answer(request, proto, req, res)

        return handle


def serve(test: Callable[[str, Gateway], Awaitable[None]]) -> None:
    """Run ``test(base_url, gateway)`` with the server up on 127.0.0.1 (base_url ends in the session)."""
    gateway = Gateway()

    async def main() -> None:
        runner = web.AppRunner(gateway.app())
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        port = runner.addresses[0][1]
        try:
            await asyncio.wait_for(test(f"http://127.0.0.1:{port}/sessions/s1", gateway), 30)
        finally:
            await runner.cleanup()

    asyncio.run(main())


OA_TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
EXPECTED_CALLS = [("call_a", "get_weather", {"city": "Paris"}), ("call_b", "get_time", {"tz": "CET"})]
# The canonical follow-up every protocol's harness sends after the two calls: the calls, then each result.
TWO_CALLS_ANSWERED = [
    {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "call_a", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"id": "call_b", "name": "get_time", "arguments": '{"tz": "CET"}'}]},
    {"role": "tool", "content": "ok", "tool_call_id": "call_a", "name": "get_weather"},
    {"role": "tool", "content": "ok", "tool_call_id": "call_b", "name": "get_time"}]


def test_openai_chat_sdk() -> None:
    async def run(base: str, gw: Gateway) -> None:
        async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", timeout=5, max_retries=0) as client:
            user: list[Any] = [{"role": "user", "content": "weather in Paris?"}]
            out = await client.chat.completions.create(model="tools", messages=user, tools=OA_TOOLS)
            assert gw.seen[-1].tools == CANON_TOOLS
            msg = out.choices[0].message
            assert msg.content == "Checking." and out.choices[0].finish_reason == "tool_calls"
            assert [(c.id, c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls or []] \
                == EXPECTED_CALLS
            assert out.usage is not None and (out.usage.prompt_tokens, out.usage.completion_tokens,
                                              out.usage.total_tokens) == (10, 2, 12)
            assert out.usage.prompt_tokens_details and out.usage.prompt_tokens_details.cached_tokens == 4
            # the SDK's own message object goes back in the next turn, followed by the tool results
            follow = [*user, msg, *({"role": "tool", "tool_call_id": c, "content": "ok"} for c in ("call_a", "call_b"))]
            out = await client.chat.completions.create(model="text", messages=follow, tools=OA_TOOLS, logprobs=True)
            assert gw.seen[-1].messages[1:] == TWO_CALLS_ANSWERED
            assert out.choices[0].message.content == "Hello there" and out.choices[0].finish_reason == "stop"
            assert out.choices[0].logprobs and [t.token for t in out.choices[0].logprobs.content or []] == ["Hel", "lo"]

            stream = await client.chat.completions.create(model="tools", messages=user, tools=OA_TOOLS, stream=True,
                                                          stream_options={"include_usage": True})
            text, calls, finish, usage = "", {}, None, None
            async for chunk in stream:
                usage = chunk.usage or usage
                for ch in chunk.choices:
                    text += ch.delta.content or ""
                    finish = ch.finish_reason or finish
                    for d in ch.delta.tool_calls or []:
                        call = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                        call["id"] += d.id or ""
                        call["name"] += d.function and d.function.name or ""
                        call["arguments"] += d.function and d.function.arguments or ""
            assert text == "Checking." and finish == "tool_calls" and usage and usage.total_tokens == 12
            assert [(c["id"], c["name"], json.loads(c["arguments"])) for c in calls.values()] == EXPECTED_CALLS

            async with client.chat.completions.stream(model="tools", messages=user, tools=OA_TOOLS) as helper:
                final = await helper.get_final_completion()
            assert [(c.id, c.function.name, json.loads(c.function.arguments))
                    for c in final.choices[0].message.tool_calls or []] == EXPECTED_CALLS

            out = await client.chat.completions.create(model="two", messages=user, n=2)
            assert gw.seen[-1].n == 2 and [c.message.content for c in out.choices] == ["first", "second"]
            stream = await client.chat.completions.create(model="two", messages=user, n=2, stream=True)
            texts = ["", ""]
            async for chunk in stream:
                for ch in chunk.choices:
                    texts[ch.index] += ch.delta.content or ""
            assert texts == ["first", "second"]
            out = await client.chat.completions.create(model="length", messages=user, max_tokens=3)
            assert out.choices[0].finish_reason == "length" and gw.seen[-1].max_tokens == 3

            with pytest.raises(openai.BadRequestError, match="stop: stop sequences are not supported") as bad:
                await client.chat.completions.create(model="text", messages=user, stop=["\n"])
            assert bad.value.status_code == 400 and bad.value.param == "stop"
            with pytest.raises(openai.NotFoundError, match="model 'nope' does not exist"):
                await client.chat.completions.create(model="nope", messages=user)

    serve(run)


RESP_TOOLS: list[Any] = [{"type": "function", "name": "get_weather", "description": "Weather of a city",
                          "parameters": WEATHER, "strict": True},
                         {"type": "function", "name": "get_time", "parameters": TIME, "strict": False}]


def test_openai_responses_sdk() -> None:
    async def run(base: str, gw: Gateway) -> None:
        async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", timeout=5, max_retries=0) as client:
            out = await client.responses.create(model="text", input="hi", instructions="Be brief.")
            assert gw.seen[-1].messages == [{"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": "hi"}]
            assert out.output_text == "Hello there" and out.status == "completed" and out.id == "resp_chatcmpl-1"
            assert out.usage and (out.usage.input_tokens, out.usage.output_tokens, out.usage.total_tokens,
                                  out.usage.input_tokens_details.cached_tokens) == (10, 2, 12, 4)

            stream = await client.responses.create(model="text", input="hi", stream=True)
            kinds, deltas, done = [], "", None
            async for event in stream:
                kinds.append(event.type)
                if event.type == "response.output_text.delta":
                    deltas += event.delta
                if event.type == "response.completed":
                    done = event.response
            assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                             "response.content_part.added", "response.output_text.delta",
                             "response.output_text.done", "response.content_part.done",
                             "response.output_item.done", "response.completed"]
            assert deltas == "Hello there" and done is not None and done.output_text == "Hello there"

            user: list[Any] = [{"role": "user", "content": "weather in Paris?"}]
            out = await client.responses.create(model="tools", input=user, tools=RESP_TOOLS, tool_choice="required")
            assert gw.seen[-1].tools == CANON_TOOLS and gw.seen[-1].tool_choice == "required"
            calls = [o for o in out.output if o.type == "function_call"]
            assert out.output_text == "Checking."
            assert [(c.call_id, c.name, json.loads(c.arguments)) for c in calls] == EXPECTED_CALLS
            # the SDK's output items go back as input, followed by the results (as NeMo-Gym's agents do)
            follow = [*user, *out.output,
                      *({"type": "function_call_output", "call_id": c.call_id, "output": "ok"} for c in calls)]
            await client.responses.create(model="text", input=follow, tools=RESP_TOOLS)
            assert gw.seen[-1].messages[1:] == TWO_CALLS_ANSWERED

            async with client.responses.stream(model="tools", input=user, tools=RESP_TOOLS) as helper:
                final = await helper.get_final_response()
            assert final.output_text == "Checking."
            assert [(c.call_id, c.name, json.loads(c.arguments))
                    for c in final.output if c.type == "function_call"] == EXPECTED_CALLS

            out = await client.responses.create(model="length", input="hi", max_output_tokens=3)
            assert out.status == "incomplete" and out.incomplete_details
            assert out.incomplete_details.reason == "max_output_tokens" and gw.seen[-1].max_tokens == 3
            stream = await client.responses.create(model="length", input="hi", stream=True)
            last = [event async for event in stream][-1]
            assert last.type == "response.incomplete" and last.response.output_text == "partial"

            with pytest.raises(openai.BadRequestError, match="previous_response_id: the gateway keeps no responses") as bad:
                await client.responses.create(model="text", input="hi", previous_response_id="resp_1")
            assert bad.value.status_code == 400
            with pytest.raises(openai.NotFoundError, match="model 'nope' does not exist"):
                await client.responses.create(model="nope", input="hi")

    serve(run)


ANT_TOOLS: list[Any] = [{"name": "get_weather", "description": "Weather of a city", "input_schema": WEATHER},
                        {"name": "get_time", "input_schema": TIME}]


def test_anthropic_sdk() -> None:
    async def run(base: str, gw: Gateway) -> None:
        async with anthropic.AsyncAnthropic(base_url=base, api_key="x", timeout=5, max_retries=0) as client:
            user: list[Any] = [{"role": "user", "content": "weather in Paris?"}]
            out = await client.messages.create(model="tools", max_tokens=64, messages=user, tools=ANT_TOOLS,
                                               system="Be brief.")
            assert gw.seen[-1].tools == CANON_TOOLS and gw.seen[-1].messages[0] == {"role": "system",
                                                                                    "content": "Be brief."}
            assert out.stop_reason == "tool_use" and out.id == "msg_chatcmpl-1"
            assert out.content[0].type == "text" and out.content[0].text == "Checking."
            uses = [b for b in out.content if b.type == "tool_use"]
            assert [(b.id, b.name, b.input) for b in uses] == EXPECTED_CALLS
            assert (out.usage.input_tokens, out.usage.cache_read_input_tokens, out.usage.output_tokens) == (6, 4, 2)
            # the SDK's content blocks go back as the assistant turn, then the tool results
            results = [{"type": "tool_result", "tool_use_id": b.id, "content": "ok"} for b in uses]
            follow = [*user, {"role": "assistant", "content": out.content}, {"role": "user", "content": results}]
            out = await client.messages.create(model="text", max_tokens=64, messages=follow, tools=ANT_TOOLS)
            assert gw.seen[-1].messages[1:] == TWO_CALLS_ANSWERED
            assert out.stop_reason == "end_turn" and out.content[0].type == "text"

            async with client.messages.stream(model="tools", max_tokens=64, messages=user,
                                              tools=ANT_TOOLS) as stream:
                text = "".join([t async for t in stream.text_stream])
                final = await stream.get_final_message()
            assert text == "Checking." and final.stop_reason == "tool_use"
            assert [(b.id, b.name, b.input) for b in final.content if b.type == "tool_use"] == EXPECTED_CALLS
            assert final.usage.output_tokens == 2 and final.usage.input_tokens == 6

            out = await client.messages.create(model="length", max_tokens=3, messages=user)
            assert out.stop_reason == "max_tokens" and gw.seen[-1].max_tokens == 3

            with pytest.raises(anthropic.BadRequestError, match="stop_sequences: stop sequences are not") as bad:
                await client.messages.create(model="text", max_tokens=64, messages=user, stop_sequences=["\n"])
            assert bad.value.status_code == 400
            with pytest.raises(anthropic.NotFoundError, match="model 'nope' does not exist"):
                await client.messages.create(model="nope", max_tokens=64, messages=user)

    serve(run)
