"""A job that fails at boot the way an engine does: a line printed, then an exception."""

from __future__ import annotations

from pathlib import Path

from toolkit.core.lifecycle import log_uncaught, setup_logging


def fail_at_boot(log: str) -> None:
    setup_logging(Path(log))
    log_uncaught()
    print("engine: worker 1 failed to start: address already in use", flush=True)
    raise ValueError("no such model: /models/none")
