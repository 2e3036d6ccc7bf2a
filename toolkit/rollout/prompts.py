"""Prompt sources: where each session's first prompt comes from. Hydra ``_target_`` classes."""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Prompt:
    token_ids: list[int]
    metadata: dict[str, Any] = field(default_factory=dict)


class PromptSource(ABC):
    @abstractmethod
    def get(self, step: int, index: int) -> Prompt:
        """The prompt of session ``index`` of ``step``; the same arguments give the same prompt."""


class SyntheticPrompts(PromptSource):
    """Random token prompts behind a shared system prompt (so the prefix cache has something to share).

    Lengths are uniform in [min_len, max_len]; ids lie in [1, vocab_size).
    """

    def __init__(self, min_len: int = 64, max_len: int = 384, system_len: int = 32,
                 vocab_size: int = 32000, seed: int = 0) -> None:
        if not 1 <= min_len <= max_len:
            raise ValueError(f"need 1 <= min_len <= max_len, got min_len={min_len} max_len={max_len}")
        self.min_len, self.max_len, self.vocab_size, self.seed = min_len, max_len, vocab_size, seed
        rng = np.random.default_rng([seed, 0xC0FFEE])
        self.system = rng.integers(1, vocab_size, size=system_len).tolist()

    def get(self, step: int, index: int) -> Prompt:
        digest = hashlib.blake2b(f"{self.seed}/{step}/{index}".encode(), digest_size=8).digest()
        rng = np.random.default_rng(int.from_bytes(digest, "little"))
        n = int(rng.integers(self.min_len, self.max_len + 1))
        body = rng.integers(1, self.vocab_size, size=max(0, n - len(self.system))).tolist()
        return Prompt(self.system + body, {"step": step, "index": index})
