"""The tiny model's tokenizer and chat template (no torch, no vLLM): ChatML turns, tool calls and tool
results, special tokens as single ids, prefix-stable renderings, and random ids that do not survive
decode + encode (what the exact-token tests rely on to tell token ids from re-tokenized text)."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from toolkit.gateway.toolcalls import get_parser  # noqa: E402
from toolkit.model.tiny import SPECIAL_TOKENS, VOCAB, ensure_tiny_tokenizer  # noqa: E402

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]

MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "18C, sunny", "tool_call_id": "call_1"},
    {"role": "assistant", "content": "18C and sunny."},
    {"role": "user", "content": "And Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    path = ensure_tiny_tokenizer(tmp_path_factory.mktemp("cache"))
    assert path.name.startswith("tiny-tokenizer-v")
    assert ensure_tiny_tokenizer(path.parent) == path  # built once
    return AutoTokenizer.from_pretrained(str(path))


def render(tok: Any, messages: list[dict[str, Any]], gen: bool = False, **kw: Any) -> str:
    return tok.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=gen, **kw)


def test_vocab_and_special_ids(tok: Any) -> None:
    assert len(tok) == VOCAB
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<s>", "<|im_end|>", "<pad>")
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.encode(t, add_special_tokens=False) == [i]
    assert tok.eos_token_id == SPECIAL_TOKENS.index("<|im_end|>")
    # The tool-call tags survive decode with skip_special_tokens (what vLLM detokenizes with).
    ids = tok.encode("x<tool_call>y</tool_call><|im_end|>", add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == "x<tool_call>y</tool_call>"


def test_renders_tools_calls_and_results(tok: Any) -> None:
    text = render(tok, MESSAGES[:4], gen=True)
    assert text.startswith("<|im_start|>system\nYou are terse.\n\n")
    assert '\n<tools>\n{"name": "get_weather", "description": "Current weather in a city"' in text
    assert text.endswith(
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\nChecking.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n18C, sunny\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")
    # JSON-text arguments go in as is; no content means the call starts the turn.
    assert render(tok, MESSAGES).endswith(
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
        "</tool_call><|im_end|>\n")


def test_no_tools_no_system_and_consecutive_tool_results(tok: Any) -> None:
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "a", "arguments": {}}},
                {"type": "function", "function": {"name": "b", "arguments": {"x": 1}}}]},
            {"role": "tool", "content": "A"}, {"role": "tool", "content": "B"}]
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert text == (
        "<|im_start|>user\nhi<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": {"x": 1}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nA\n</tool_response>\n"
        "<tool_response>\nB\n</tool_response><|im_end|>\n")


def test_rendering_is_prefix_stable(tok: Any) -> None:
    for k in range(1, len(MESSAGES)):
        shorter, longer = render(tok, MESSAGES[:k]), render(tok, MESSAGES[:k + 1])
        assert longer.startswith(shorter), k
        # And as token ids: every turn ends in <|im_end|>\n, so no BPE merge crosses the boundary.
        short_ids = tok.encode(shorter, add_special_tokens=False)
        assert tok.encode(longer, add_special_tokens=False)[:len(short_ids)] == short_ids
        # The generation prompt is what the next assistant turn starts with.
        if MESSAGES[k]["role"] == "assistant":
            assert longer.startswith(render(tok, MESSAGES[:k], gen=True)), k


def test_hermes_parser_reads_back_the_rendered_calls(tok: Any) -> None:
    prompt = render(tok, MESSAGES[:2], gen=True)
    turn = render(tok, MESSAGES[:3])[len(prompt):].removesuffix("<|im_end|>\n")
    content, [call] = get_parser("hermes").parse(turn)
    assert (content, call.name, json.loads(call.arguments)) == ("Checking.", "get_weather", {"city": "Paris"})


def test_random_ids_do_not_round_trip(tok: Any) -> None:
    rnd = random.Random(0)
    failed = 0
    for _ in range(200):
        ids = [rnd.randrange(VOCAB) for _ in range(30)]
        failed += tok.encode(tok.decode(ids), add_special_tokens=False) != ids
    assert failed >= 190, failed
    # While the tokenizer's own encoding of text does.
    ids = tok.encode(render(tok, MESSAGES), add_special_tokens=False)
    assert tok.encode(tok.decode(ids), add_special_tokens=False) == ids
