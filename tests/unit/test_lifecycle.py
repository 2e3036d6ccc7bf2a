"""A component process's lifecycle helpers (``toolkit/core/lifecycle.py``) that need no process."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from toolkit.core.lifecycle import log_uncaught


def test_an_uncaught_exception_goes_to_the_log_with_its_traceback(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """What submitit logs of a job that raised is only that it raised: the traceback joins the log."""
    seen: list[type] = []
    monkeypatch.setattr(sys, "excepthook", lambda kind, value, tb: seen.append(kind))
    handler = logging.FileHandler(tmp_path / "c.log")
    logging.getLogger("toolkit").addHandler(handler)
    try:
        log_uncaught()
        try:
            raise ValueError("no such model")
        except ValueError:
            sys.excepthook(*sys.exc_info())
    finally:
        logging.getLogger("toolkit").removeHandler(handler)
        handler.close()
    text = (tmp_path / "c.log").read_text()
    assert "uncaught exception" in text and "Traceback" in text and "ValueError: no such model" in text
    assert seen == [ValueError]  # and the usual hook still prints it
