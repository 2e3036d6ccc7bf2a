"""Length hints: a client's guess of how long a turn will run, sent with it (``Generate.expected_tokens``).

A router that sees only ages cannot tell a long turn from a short one until it has run (docs/tail-routing.md); a turn hinted long starts on the tail group instead (``TailPolicy.start_on_tail``, with
``tail.policy=age`` or ``predict``). ``workload.length_hint`` names the predictor: a Hydra ``_target_``
of a :class:`LengthHint` (a model of your own, the lengths of a prompt in the last epoch...).

:class:`SimOracle` is the one the toolkit ships, for the sim engine only: it knows what the sim will
generate and misses by a lognormal factor of a chosen sigma, to measure what a predictor of that
quality buys (``python -m toolkit.bench tail``'s ``length_hints``). It is no predictor of a real model.
"""

from __future__ import annotations

import hashlib
import math
from abc import ABC, abstractmethod
from typing import Any

import numpy as np

from toolkit.config import SimEngineConfig
from toolkit.core.errors import ConfigError, FieldError
from toolkit.core.protocol import MAX_EXPECTED_TOKENS, Generate
from toolkit.engine.plans import plan_output


class LengthHint(ABC):
    @abstractmethod
    def expected_tokens(self, request: Generate) -> int:
        """The output tokens ``request`` is expected to produce (0: no guess). It runs in the rank's
        event loop before every request: keep it fast, or it delays the turn it guesses."""


class HintFailed(Exception):
    """The user's predictor raised or answered something else than a token count: its session fails."""


def ask(hint: LengthHint, request: Generate) -> int:
    """``hint``'s guess for ``request`` as the wire carries it, or HintFailed saying what went wrong."""
    try:
        value = hint.expected_tokens(request)
    except Exception as exc:
        raise HintFailed(f"workload.length_hint raised {type(exc).__name__}: {exc}") from exc
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value <= MAX_EXPECTED_TOKENS:
        raise HintFailed(f"workload.length_hint returned {value!r}: expected an int in [0, {MAX_EXPECTED_TOKENS}] "
                         f"(tokens; 0 = no guess)")
    return int(value)


class SimOracle(LengthHint):
    """The sim's own plan of each request (``toolkit.engine.plans.plan_output``), off by ``exp(sigma * e)``
    with ``e`` standard normal and fixed per request id (so every run of a bench misses the same way).

    ``engine`` is the run's sim engine config (``${engine}`` in a config); every group plans the same
    output, so the base config is enough.
    """

    def __init__(self, sigma: float, engine: dict[str, Any]) -> None:
        errors = []
        if not (isinstance(sigma, (int, float)) and math.isfinite(sigma) and sigma >= 0):
            errors.append(FieldError("workload.length_hint.sigma", sigma, "a number >= 0 (0: exact)"))
        if engine.get("type") != "sim":
            errors.append(FieldError("workload.length_hint.engine.type", engine.get("type"),
                                     "sim (the oracle knows only what the sim engine will generate)"))
        if errors:
            raise ConfigError(errors)
        self.sigma = float(sigma)
        self.engine = SimEngineConfig(**engine)

    def expected_tokens(self, request: Generate) -> int:
        if request.sampling.structured is not None:
            return 0  # its plan needs the tokenizer: no guess
        tokens, _, _ = plan_output(self.engine, request)
        digest = hashlib.blake2b(request.request_id.encode() + b"|hint", digest_size=8).digest()
        miss = float(np.random.default_rng(int.from_bytes(digest, "little")).standard_normal())
        return max(1, round(len(tokens) * math.exp(self.sigma * miss)))
