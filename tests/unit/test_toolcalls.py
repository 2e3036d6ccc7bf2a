"""Tool-call parsers (``hermes``, ``none``), the forced-call JSON Schema and its parser."""

from __future__ import annotations

import json
import re

import pytest

from toolkit.core.errors import ToolkitError
from toolkit.gateway.toolcalls import PARSERS, get_parser, parse_constrained_call, tool_call_schema
from toolkit.gateway.types import GatewayError

ID = re.compile(r"call_[0-9a-f]{24}")


def block(name: str, arguments: object) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def test_hermes_one_call() -> None:
    content, calls = get_parser("hermes").parse(block("get_weather", {"city": "Zürich"}))
    assert content == ""
    [call] = calls
    assert ID.fullmatch(call.id) and call.name == "get_weather"
    assert call.arguments == '{"city": "Zürich"}'  # ensure_ascii=False
    assert json.loads(call.arguments) == {"city": "Zürich"}


def test_hermes_two_calls_in_order_with_distinct_ids() -> None:
    text = block("a", {"x": 1}) + "\n" + block("b", {})
    content, calls = get_parser("hermes").parse(text)
    assert content == ""
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("a", {"x": 1}), ("b", {})]
    assert calls[0].id != calls[1].id


def test_hermes_content_around_calls_is_kept_and_stripped() -> None:
    text = "  Let me check.\n" + block("f", {"q": "x"}) + "\nthen more\n" + block("g", {}) + "\n\n"
    content, calls = get_parser("hermes").parse(text)
    assert [c.name for c in calls] == ["f", "g"]
    assert content.startswith("Let me check.") and content.endswith("then more")
    assert "<tool_call>" not in content


def test_hermes_text_without_calls() -> None:
    assert get_parser("hermes").parse("  just text \n") == ("just text", [])


@pytest.mark.parametrize("bad", [
    "<tool_call>\n{not json}\n</tool_call>",
    "<tool_call>\n{\"arguments\": {}}\n</tool_call>",                   # no name
    "<tool_call>\n{\"name\": 3, \"arguments\": {}}\n</tool_call>",      # name not a string
    "<tool_call>\n{\"name\": \"f\", \"arguments\": [1]}\n</tool_call>",  # arguments not an object
    "<tool_call>\n{\"name\": \"f\", \"arguments\": \"[1]\"}\n</tool_call>",
    "<tool_call>\n{\"name\": \"f\", \"arguments\": \"{oops\"}\n</tool_call>",
    "<tool_call>\n{\"name\": \"f\", \"argu",                          # cut off
    "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": " + "[" * 3000 + "]" * 3000 + "}}\n</tool_call>",  # past json's depth
])
def test_hermes_bad_blocks_stay_in_the_content(bad: str) -> None:
    text = "before " + bad + " " + block("ok", {"k": True})
    content, calls = get_parser("hermes").parse(text)
    assert [c.name for c in calls] == ["ok"]
    assert content == ("before " + bad).strip()


def test_hermes_arguments_as_json_text() -> None:
    _, [call] = get_parser("hermes").parse(block("f", json.dumps({"a": [1, 2], "b": "é"})))
    assert call.arguments == '{"a": [1, 2], "b": "é"}'


def test_hermes_unclosed_last_block_with_complete_json() -> None:
    content, [call] = get_parser("hermes").parse('ok <tool_call>\n{"name": "f", "arguments": {"n": 1}}\n')
    assert (content, call.name, call.arguments) == ("ok", "f", '{"n": 1}')


def test_none_parser_never_parses() -> None:
    text = block("f", {})
    assert get_parser("none").parse("  " + text) == (text, [])


def test_unknown_parser_names_the_valid_ones() -> None:
    assert set(PARSERS) == {"hermes", "none"}
    with pytest.raises(ToolkitError, match="unknown tool-call parser 'qwen9'.*hermes, none"):
        get_parser("qwen9")


def test_constrained_bare_json() -> None:
    call = parse_constrained_call(' {"name": "f", "arguments": {"x": "ü"}} ')
    assert call is not None and ID.fullmatch(call.id)
    assert (call.name, call.arguments) == ("f", '{"x": "ü"}')
    as_text = parse_constrained_call(json.dumps({"name": "f", "arguments": '{"x": 1}'}))
    assert as_text is not None and as_text.arguments == '{"x": 1}'
    for bad in ['{"name": "f", "argum', '{"name": "f"}', "[]", "", '{"name": "f", "arguments": 1}']:
        assert parse_constrained_call(bad) is None


TOOLS = [
    {"name": "get_weather", "description": "d", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]}},
    {"type": "function", "function": {"name": "now"}},  # OpenAI's nesting, no parameters
]


def test_schema_for_a_named_tool() -> None:
    assert tool_call_schema(TOOLS, "get_weather") == {
        "type": "object",
        "properties": {"name": {"type": "string", "enum": ["get_weather"]},
                       "arguments": TOOLS[0]["parameters"]},
        "required": ["name", "arguments"], "additionalProperties": False}
    assert tool_call_schema(TOOLS, "now")["properties"]["arguments"] == {"type": "object"}


def test_schema_for_required_is_any_of_all_tools() -> None:
    schema = tool_call_schema(TOOLS, None)
    assert [s["properties"]["name"]["enum"] for s in schema["anyOf"]] == [["get_weather"], ["now"]]
    assert schema["anyOf"][0] == tool_call_schema(TOOLS, "get_weather")


def test_schema_errors_are_400s() -> None:
    with pytest.raises(GatewayError, match="'nope'.*'get_weather', 'now'") as e:
        tool_call_schema(TOOLS, "nope")
    assert e.value.status == 400 and e.value.param == "tool_choice"
    with pytest.raises(GatewayError):
        tool_call_schema([], None)


def test_schema_accepts_what_it_describes() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = tool_call_schema(TOOLS, None)
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "Oslo"}}, schema)
    jsonschema.validate({"name": "now", "arguments": {}}, schema)
    for bad in [{"name": "get_weather", "arguments": {}}, {"name": "other", "arguments": {}},
                {"name": "now", "arguments": {}, "extra": 1}, {"name": "now"}]:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_an_answer_asked_for_one_tool_call_carries_the_first_the_model_wrote() -> None:
    """``parallel_tool_calls: false``: the harness echoes one call, so the session's line goes on (its
    tokens stay as generated); by default every call the model wrote."""
    from types import SimpleNamespace

    from toolkit.core.protocol import Result
    from toolkit.gateway.server import Gateway
    from toolkit.gateway.types import ChatRequest

    text = block("a", {"x": 1}) + block("b", {"y": 2})
    gw = SimpleNamespace(chat=SimpleNamespace(content_text=lambda ids: text), parser=get_parser("hermes"))
    res = Result("r", output_token_ids=[5, 6], logprobs=[-0.1, -0.2], finish_reason="stop")
    tools = [{"name": "a", "description": "", "parameters": {}}, {"name": "b", "description": "", "parameters": {}}]
    both = Gateway._choice(gw, 0, res, ChatRequest(messages=[], tools=tools), False)  # type: ignore[arg-type]
    one = Gateway._choice(gw, 0, res, ChatRequest(messages=[], tools=tools, parallel_tool_calls=False), False)  # type: ignore[arg-type]
    assert [c.name for c in both.tool_calls] == ["a", "b"] and [c.name for c in one.tool_calls] == ["a"]
    assert one.token_ids == [5, 6] and one.finish_reason == "tool_calls"
