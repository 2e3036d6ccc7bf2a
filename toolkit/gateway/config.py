"""Setup checks of the agent workload (``workload.agent``, ``gateway.*``): every error at once."""

from __future__ import annotations

import importlib
import socket
from typing import TYPE_CHECKING

from toolkit.core.errors import FieldError
from toolkit.model.tokenizer import chat_tokenizer_problem

if TYPE_CHECKING:
    from toolkit.config import Config


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def validate_agent(cfg: Config) -> list[FieldError]:
    """What the agent workload needs beyond its fields' declared bounds: an importable ``solve``, the
    model's chat template, and a port per rank (free, locally)."""
    w, g = cfg.workload, cfg.gateway
    errors = []
    target = w.agent.get("_target_")
    if not isinstance(target, str) or "." not in target:
        errors.append(FieldError("workload.agent._target_", target,
                                 "a dotted path to `async def solve(base_url, task) -> reward`"))
    else:
        module, _, name = target.rpartition(".")
        try:
            fn = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as exc:
            errors.append(FieldError("workload.agent._target_", target, f"an importable function ({exc})"))
        else:
            if not callable(fn):
                errors.append(FieldError("workload.agent._target_", target, "a callable (base_url, task) -> reward"))
    if w.tokenizer is None:
        errors.append(FieldError("workload.tokenizer", None, "the model's directory (tokenizer files with a chat "
                                 "template) or tiny: agents speak text, the gateway renders it with the model's template"))
    elif (why := chat_tokenizer_problem(w.tokenizer)) is not None:
        errors.append(FieldError("workload.tokenizer", w.tokenizer, why))
    if g.port != 0:
        last = g.port + cfg.ranks - 1
        if not 1 <= g.port <= last <= 65535:
            errors.append(FieldError("gateway.port", g.port, f"0, or a port such that port + ranks - 1 <= 65535 "
                                                               f"(ranks = {cfg.ranks})"))
        elif cfg.cluster.type == "local":
            busy = [p for p in range(g.port, last + 1) if not _port_free(g.host or "127.0.0.1", p)]
            if busy:
                errors.append(FieldError("gateway.port", g.port, f"free ports {g.port}..{last} (one per rank); "
                                                                   f"in use: {busy}"))
    return errors
