"""The gateway's protocol adapters: each parses one LLM API's request into a ChatRequest and renders a
ChatResult back in that API's shape (see :class:`Protocol`)."""

from __future__ import annotations

from toolkit.gateway.protocols.anthropic import Messages
from toolkit.gateway.protocols.base import SSE_CONTENT_TYPE, Protocol
from toolkit.gateway.protocols.openai_chat import ChatCompletions
from toolkit.gateway.protocols.openai_responses import Responses

PROTOCOLS: dict[str, Protocol] = {p.name: p for p in (ChatCompletions(), Responses(), Messages())}
"""The adapters by name: ``chat`` (``/v1/chat/completions``), ``responses`` (``/v1/responses``),
``messages`` (``/v1/messages``)."""

__all__ = ["PROTOCOLS", "SSE_CONTENT_TYPE", "ChatCompletions", "Messages", "Protocol", "Responses"]
