"""A component process's lifecycle helpers (``toolkit/core/lifecycle.py``) that need no process."""

from __future__ import annotations

import gc
import logging
import sys
from pathlib import Path

from toolkit.core.lifecycle import log_uncaught, quiet_gc


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


def test_quiet_gc_freezes_what_exists_and_collects_the_young_less_often() -> None:
    threshold = gc.get_threshold()
    try:
        quiet_gc(gen0=12_345)
        assert gc.get_threshold() == (12_345, *threshold[1:]) and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)
