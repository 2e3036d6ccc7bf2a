"""The gateway's protocol-independent request and answer, and its errors.

Every protocol (OpenAI Chat Completions, OpenAI Responses, Anthropic Messages) parses its request
body into a :class:`ChatRequest` and renders a :class:`ChatResult` back in its own shape. Between
the two, the session turns canonical messages into token ids and the router's Results back.

Canonical messages are plain dicts, the OpenAI chat shape reduced to what a chat template needs::

    {"role": "system" | "user", "content": str}
    {"role": "assistant", "content": str, "tool_calls": [{"id": str, "name": str, "arguments": str}]}
    {"role": "tool", "content": str, "tool_call_id": str, "name": str}

``arguments`` is JSON text; ``tool_calls`` is present only when non-empty; ``name`` only when known.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from toolkit.core.errors import ToolkitError

Message = dict[str, Any]


class GatewayError(ToolkitError):
    """A request the gateway answers with an error: ``status`` is the HTTP status, ``kind`` the
    protocol-neutral error type (each protocol maps it to its own error body)."""

    KINDS = {400: "invalid_request", 401: "authentication", 404: "not_found", 413: "request_too_large",
             429: "rate_limit", 500: "internal", 503: "overloaded", 504: "timeout"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        """OpenAI's error ``code`` (``context_length_exceeded``), for the harnesses that look for it."""

    @property
    def kind(self) -> str:
        return self.KINDS.get(self.status, "internal")


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str
    """JSON text of the arguments object, as generated."""


def json_or(text: str, default: Any) -> Any:
    """``text`` as JSON, or ``default`` when it is not JSON or nests too deeply to parse (a model's
    degenerate output, an agent's garbage: neither may become a 500)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return default


@dataclass
class ChatRequest:
    messages: list[Message]
    """The whole conversation so far, canonical (see the module docstring)."""
    tools: list[dict[str, Any]] = field(default_factory=list)
    """Functions the model may call: ``{"name", "description", "parameters"}`` (a JSON Schema)."""
    max_tokens: int | None = None
    """Generation budget of this turn; None = the workload's ``max_tokens``."""
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    seed: int | None = None
    logprobs: bool = False
    """Return the sampled tokens' logprobs in the answer (they are always recorded in the sample)."""
    tool_choice: str | dict[str, str] = "auto"
    """``auto`` | ``none`` | ``required`` | ``{"name": <function>}``."""
    response_format: dict[str, Any] | None = None
    """None, ``{"type": "json_object"}`` or ``{"type": "json_schema", "schema": {...}}``."""
    stream: bool = False
    model: str = ""
    include_usage: bool = False
    """OpenAI ``stream_options.include_usage``: a last chunk with the usage."""
    expected_tokens: int = 0
    """The agent's guess of this turn's length (the toolkit's ``expected_tokens`` field; 0: none):
    a tail policy starts a turn guessed long on the tail group."""
    parallel_tool_calls: bool = True
    """False (OpenAI ``parallel_tool_calls``, Anthropic ``disable_parallel_tool_use``): an answer carries
    at most the first tool call the model wrote (its tokens stay in the sample as generated)."""


@dataclass
class Choice:
    index: int
    content: str
    """Generated text without the tool calls (empty when the turn is only calls)."""
    tool_calls: list[ToolCall]
    finish_reason: str
    """``stop`` | ``length`` | ``tool_calls``."""
    token_ids: list[int]
    logprobs: list[float]
    tokens_text: list[str] = field(default_factory=list)
    """Each generated token's text (for OpenAI ``logprobs.content[].token``), filled when asked."""
    tokens_bytes: list[bytes] = field(default_factory=list)
    """Each generated token's own bytes (``logprobs.content[].bytes``), filled when asked."""


@dataclass
class ChatResult:
    id: str
    model: str
    created: int
    choices: list[Choice]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    generate_s: float = 0.0
    """Seconds the turn spent in the router and engines (the ``x-toolkit-generate-ms`` header)."""
