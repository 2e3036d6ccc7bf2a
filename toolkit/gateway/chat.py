"""The model's chat template and tokenizer, as the model files define them (transformers).

The gateway never re-tokenizes what the model generated: it renders only the messages that are new
since the last turn and appends their ids to the session's ids. Two facts about a template make that
exact, and both are taken from the template itself, not assumed:

- *append-only*: rendering ``messages + new`` starts with the rendering of ``messages``; the new
  messages' text is the difference;
- *the closing of an assistant turn*: what the template writes after an assistant message's content
  (``<|im_end|>\\n`` in ChatML). The engine stops on the end token, so the session's ids already
  hold part of it; :meth:`ChatTokenizer.glue` gives the rest.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from toolkit.core.errors import ToolkitError
from toolkit.gateway.types import Message, json_or

logger = logging.getLogger(__name__)

_SPACE = "\u2581"
"""SentencePiece's mark for a space in its token strings."""
_PLACEHOLDER = "\u2063TOOLKIT-ASSISTANT-CONTENT\u2063"


def _hf_message(m: Message) -> dict[str, Any]:
    """A canonical message in the shape HF chat templates take."""
    out: dict[str, Any] = {"role": m["role"], "content": m.get("content", "")}
    calls = m.get("tool_calls")
    if calls:
        out["tool_calls"] = [{"id": c["id"], "type": "function",
                              "function": {"name": c["name"], "arguments": _arguments(c["arguments"])}}
                             for c in calls]
    if m["role"] == "tool":
        out["tool_call_id"] = m.get("tool_call_id", "")
        if m.get("name"):
            out["name"] = m["name"]
    return out


def _arguments(text: str) -> Any:
    return json_or(text, text)


def _hf_tools(tools: Sequence[dict[str, Any]]) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    return [{"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                              "parameters": t.get("parameters") or {"type": "object"}}}
            for t in tools]


class ChatTokenizer:
    """A model's tokenizer and chat template (``AutoTokenizer`` over the model's own files)."""

    def __init__(self, path: str | Path) -> None:
        # transformers takes seconds to import: only in a rank that serves agents.
        from transformers import AutoTokenizer

        self.path = Path(path)
        self.tok = AutoTokenizer.from_pretrained(str(self.path))
        if not getattr(self.tok, "chat_template", None):
            raise ToolkitError(f"tokenizer {self.path} has no chat template (tokenizer_config.json "
                               "chat_template): the gateway renders messages with the model's own template")
        self.vocab_size = len(self.tok)
        self._byte_of: dict[str, int] | None = None  # token_bytes' alphabet, built on first use
        self._spaced = False  # token_bytes: a SentencePiece vocabulary (``▁`` for a space)
        self.closing = self._assistant_closing()
        self.eos_ids = self._end_ids()

    def _end_ids(self) -> set[int]:
        """Ids an engine stops a turn on: the tokenizer's end token, the generation config's (vLLM
        stops on those too: Gemma's ``<end_of_turn>``, Qwen's ``<|im_end|>`` under a base tokenizer),
        and the special token the template closes an assistant turn with."""
        ids = {self.tok.eos_token_id} if self.tok.eos_token_id is not None else set()
        gen = self.path / "generation_config.json"
        if gen.is_file():
            try:
                eos = json.loads(gen.read_text()).get("eos_token_id")
            except ValueError:
                eos = None
            ids.update(eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else [])
        first = self.encode(self.closing)[:1]
        if first and self.tok.convert_ids_to_tokens(first[0]) in self.tok.all_special_tokens:
            ids.add(first[0])
        return ids

    def render(self, messages: Sequence[Message], tools: Sequence[dict[str, Any]],
               add_generation_prompt: bool) -> str:
        return self.tok.apply_chat_template([_hf_message(m) for m in messages], tools=_hf_tools(tools),
                                            tokenize=False, add_generation_prompt=add_generation_prompt)

    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` as the template wrote it: special tokens in it are parsed, none are added."""
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def token_bytes(self, ids: Sequence[int]) -> list[bytes]:
        """Each id's own bytes (OpenAI's logprobs ``bytes``): a token that is part of a multi-byte
        character carries its raw bytes, where a decode of it alone gives U+FFFD. A byte-level BPE's
        token strings map back through GPT-2's byte alphabet; a byte-fallback token (``<0xE2>``) is its
        byte; a SentencePiece token its text with ``▁`` as the space it stands for (a decode of it alone
        drops a leading space); any other token, its decoded text."""
        from tokenizers import decoders  # with the byte map, built on first use

        if self._byte_of is None:
            from transformers.convert_slow_tokenizer import bytes_to_unicode

            backend = getattr(self.tok, "backend_tokenizer", None)
            byte_level = backend is not None and isinstance(backend.decoder, decoders.ByteLevel)
            self._byte_of = {c: b for b, c in bytes_to_unicode().items()} if byte_level else {}
            self._spaced = not byte_level and any(k.startswith(_SPACE) for k in self.tok.get_vocab())
        out = []
        for t, piece in zip(ids, self.tok.convert_ids_to_tokens(list(ids)), strict=True):
            if piece is not None and self._byte_of and all(c in self._byte_of for c in piece):
                out.append(bytes(self._byte_of[c] for c in piece))
            elif piece is not None and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                out.append(bytes([int(piece[3:5], 16)]))
            elif piece is not None and self._spaced and _SPACE in piece and t not in self.tok.all_special_ids:
                out.append(piece.replace(_SPACE, " ").encode())
            else:
                out.append(self.decode([t]).encode())
        return out

    def token_pieces(self, ids: Sequence[int]) -> tuple[list[str], list[bytes]]:
        """Each id's text and bytes (OpenAI's logprobs ``token`` and ``bytes``): the text is its bytes'
        where they are whole UTF-8 (a SentencePiece token keeps its space), else its decode (U+FFFD for
        part of a character, as OpenAI's)."""
        raw = self.token_bytes(ids)
        texts = []
        for t, b in zip(ids, raw, strict=True):
            try:
                texts.append(b.decode())
            except UnicodeDecodeError:
                texts.append(self.decode([t]))
        return texts, raw

    def content_text(self, ids: Sequence[int]) -> str:
        """The text of a generation for the harness: without the end token the engine stopped on."""
        end = len(ids)
        while end and ids[end - 1] in self.eos_ids:
            end -= 1
        return self.decode(ids[:end])

    def _assistant_closing(self) -> str:
        """What the template writes after an assistant message's content."""
        convo: list[Message] = [{"role": "user", "content": "x"}]
        head = self.render(convo, (), True)
        full = self.render([*convo, {"role": "assistant", "content": _PLACEHOLDER}], (), False)
        if not full.startswith(head) or _PLACEHOLDER not in full:
            raise ToolkitError(f"the chat template of {self.path} does not render an assistant message after "
                               "its generation prompt: the gateway cannot keep the model's ids exactly")
        return full[full.index(_PLACEHOLDER) + len(_PLACEHOLDER):]

    def continuation(self, held: Sequence[Message], new: Sequence[Message],
                     tools: Sequence[dict[str, Any]]) -> str | None:
        """The text the template writes for ``new`` (and the generation prompt) after ``held``, a
        conversation that ends with the engine's own assistant turn; None if the template does not
        write ``held`` as a prefix of it.

        One rendering, with a placeholder for that turn's content: what follows the placeholder's
        closing is the new messages' text, whatever the template does with earlier turns (some drop
        earlier reasoning, for instance), which the session never re-reads anyway."""
        if held and held[-1].get("role") == "assistant":
            text = self.render([*held[:-1], {**held[-1], "content": _PLACEHOLDER}, *new], tools, True)
            at = text.find(_PLACEHOLDER)
            end = text.find(self.closing, at + len(_PLACEHOLDER)) if at >= 0 else -1
            if end >= 0:
                return text[end + len(self.closing):]
        # No engine turn last, or a template that drops an assistant turn's content when it has tool
        # calls (Llama 3's): the new messages are what a rendering with them adds to one without.
        before = self.render(held, tools, False)
        full = self.render([*held, *new], tools, True)
        return full[len(before):] if full.startswith(before) else None

    def glue(self, generated: Sequence[int]) -> str:
        """The part of the assistant turn's closing that the generated ids do not already hold: after
        an end token the engine stopped on, what the template writes after that token (``"\\n"`` in
        ChatML); after a generation cut by its budget, the whole closing."""
        close = self.closing
        if generated and generated[-1] in self.eos_ids:
            end = self.decode(generated[-1:])
            if close.startswith(end):
                return close[len(end):]
        return close
