"""Tokenizers: optional, only for text prompts and for ``rollout.decode_responses``.

The toolkit works on token ids end to end; a tokenizer is needed only to encode text prompts and to
decode responses when asked. ``workload.tokenizer`` is one of:

- ``null``: no tokenizer (the default; prompts must be token ids, responses stay undecoded);
- a path to a ``tokenizer.json`` (or a directory holding one), loaded with the HF ``tokenizers``
  library, which is optional (``pip install tokenizers``);
- a Hydra ``_target_`` of any class with ``encode(text) -> list[int]`` and ``decode(ids) -> str``,
  e.g. the built-in :class:`ByteTokenizer`.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from hydra.utils import instantiate

from toolkit.core.errors import ToolkitError
from toolkit.model.tiny import ensure_tiny_tokenizer


@runtime_checkable
class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes shifted by ``offset`` (ids ``offset .. offset + 255``): no files, no library.

    For tests and demos. Ids outside that range (a simulator emits any id of its vocabulary) decode
    as ``<id>`` so every id sequence decodes deterministically.
    """

    def __init__(self, offset: int = 5) -> None:
        if offset < 0:
            raise ValueError(f"offset must be >= 0, got {offset}")
        self.offset = offset

    def encode(self, text: str) -> list[int]:
        return [b + self.offset for b in text.encode()]

    def decode(self, ids: Sequence[int]) -> str:
        out: list[str] = []
        run = bytearray()
        for i in ids:
            b = i - self.offset
            if 0 <= b < 256:
                run.append(b)
                continue
            if run:
                out.append(run.decode(errors="replace"))
                run.clear()
            out.append(f"<{i}>")
        if run:
            out.append(run.decode(errors="replace"))
        return "".join(out)


class HFTokenizer:
    """A ``tokenizer.json`` loaded with the HF ``tokenizers`` library; no special tokens added or skipped,
    so decoding a sample's tokens gives back exactly what the model saw."""

    def __init__(self, path: str | Path) -> None:
        try:
            from tokenizers import Tokenizer as _HF
        except ImportError:
            raise ToolkitError(f"tokenizer {path}: the `tokenizers` library is not installed "
                               "(pip install tokenizers), or use a Hydra `_target_` tokenizer") from None
        p = Path(path)
        self.path = p / "tokenizer.json" if p.is_dir() else p
        self._tok = _HF.from_file(str(self.path))

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)


def load_tokenizer(spec: Any) -> Tokenizer | None:
    """The tokenizer ``spec`` names (see the module docstring); None for None."""
    if spec is None:
        return None
    if isinstance(spec, str | Path):
        return HFTokenizer(spec)
    if isinstance(spec, dict) or hasattr(spec, "keys"):
        return load_tokenizer(instantiate(spec))
    if isinstance(spec, Tokenizer):
        return spec
    raise ToolkitError(f"not a tokenizer: {spec!r} (need a tokenizer.json path, a `_target_`, "
                       "or an object with encode(text) and decode(ids))")


def tokenizer_problem(spec: Any) -> str | None:
    """Why ``spec`` cannot give a tokenizer, checked without loading it; None if it looks usable."""
    if spec is None:
        return None
    if isinstance(spec, str | Path):
        p = Path(spec)
        if p.is_dir():
            p = p / "tokenizer.json"
        if not p.is_file():
            return "a path to a tokenizer.json (or a directory holding one) that exists"
        if importlib.util.find_spec("tokenizers") is None:
            return "a tokenizer.json path needs the `tokenizers` library (pip install tokenizers)"
        return None
    if isinstance(spec, dict):
        target = spec.get("_target_")
        if not isinstance(target, str) or "." not in target:
            return "a Hydra `_target_` dict naming a class with encode() and decode()"
        module, _, name = target.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as exc:
            return f"an importable `_target_` ({exc})"
        if not (callable(getattr(cls, "encode", None)) and callable(getattr(cls, "decode", None))):
            return f"{target} has no encode() and decode()"
        return None
    if isinstance(spec, Tokenizer):
        return None  # already instantiated (Hydra instantiates a nested `_target_` before passing it on)
    return "null, a tokenizer.json path, or a Hydra `_target_` dict"


def resolve_chat_tokenizer(spec: Any, cache_dir: str = "~/.cache/rollout-toolkit") -> Path:
    """The directory a ``workload.tokenizer`` names for chat: a model/tokenizer directory, or ``tiny``
    (the built-in test model's tokenizer, built into ``cache_dir`` once)."""
    if spec == "tiny":
        return ensure_tiny_tokenizer(cache_dir)
    return Path(str(spec)).expanduser()


def chat_tokenizer_dir(cfg: Any) -> Path:
    """The agent workload's tokenizer directory (``workload.tokenizer``; ``tiny`` is built into the
    engine's ``cache_dir``, or the default cache for engines without one)."""
    return resolve_chat_tokenizer(cfg.workload.tokenizer, getattr(cfg.engine, "cache_dir", "~/.cache/rollout-toolkit"))


def chat_tokenizer_problem(spec: Any) -> str | None:
    """Why ``spec`` cannot be the agent workload's tokenizer, checked without loading it."""
    if spec == "tiny":
        return None
    if not isinstance(spec, str | Path):
        return "a model or tokenizer directory with a chat template (tokenizer_config.json), or tiny"
    p = Path(str(spec)).expanduser()
    if not (p / "tokenizer_config.json").is_file():
        return f"a directory holding tokenizer_config.json (and the tokenizer files); {p} has none"
    has_template = (p / "chat_template.jinja").is_file() or (p / "chat_template.json").is_file()
    if not has_template:
        try:
            has_template = bool(json.loads((p / "tokenizer_config.json").read_text()).get("chat_template"))
        except (OSError, ValueError) as exc:
            return f"a readable tokenizer_config.json ({exc})"
    if not has_template:
        return f"a tokenizer with a chat template: {p} has no chat_template in tokenizer_config.json"
    return None
