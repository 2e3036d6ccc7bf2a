"""The engine interface a replica serves: token ids in, token ids and logprobs out."""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from toolkit.errors import ConfigError, FieldError
from toolkit.protocol import Generate, Result

# Backends by ``engine.type``; imported lazily so the sim never pays for importing vLLM.
BACKENDS = {"sim": "toolkit.engine.sim:SimEngine"}


@dataclass(frozen=True)
class EngineInfo:
    model: str
    max_model_len: int
    vocab_size: int


@dataclass
class EngineStats:
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    prefix_hits: int = 0
    prefix_queries: int = 0
    weight_version: int = 0
    generated_tokens: int = 0


class Engine(ABC):
    """One engine instance. All methods run on the replica's asyncio loop."""

    @abstractmethod
    async def start(self) -> EngineInfo:
        """Bring the engine up; return what the router needs to validate requests."""

    @abstractmethod
    async def generate(self, req: Generate) -> Result:
        """Run one request to completion (or abort); never raises for a bad request, returns a status."""

    @abstractmethod
    async def abort(self, request_id: str) -> None:
        """Stop a running or waiting request; its generate() returns ``cancelled`` with partial output."""

    @abstractmethod
    def stats(self) -> EngineStats:
        """Load and prefix-cache counters for the heartbeat."""

    @abstractmethod
    async def close(self) -> None:
        """Release the engine (processes, memory)."""


def make_engine(cfg: Any) -> Engine:
    """Build the backend named by ``cfg.type`` from its config."""
    spec = BACKENDS.get(cfg.type)
    if spec is None:
        raise ConfigError([FieldError("engine.type", cfg.type, f"one of {sorted(BACKENDS)}")])
    module, _, name = spec.partition(":")
    cls = getattr(importlib.import_module(module), name)
    engine = cls(cfg)
    assert isinstance(engine, Engine)
    return engine
