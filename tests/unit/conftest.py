"""The unit tier starts no process: while a unit test runs (its fixtures included), starting one
raises, and the test fails even if the code under test swallowed that error. In-process objects,
threads and loopback sockets of the test process are fine; anything else belongs in tests/integration.
"""

from __future__ import annotations

import multiprocessing.process
import os
import platform
import subprocess
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

# platform.processor() runs `uname -p` once and caches the answer; libraries ask it for their headers
# (the openai SDK does). Asked here, before any test, it starts no process during one.
platform.processor()
# matplotlib lists the system's fonts (`fc-list`) the first time its font manager loads on a machine
# (then it keeps them in its cache): loaded here, a fresh machine's unit tier starts that process before
# any test, not inside the first one that draws.
import matplotlib.font_manager  # noqa: E402,F401

_started = pytest.StashKey[list[str]]()
UNIT = Path(__file__).resolve().parent


class ProcessStartInUnitTest(RuntimeError):
    pass


def _refuse(item: pytest.Item, what: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        shown = args[1] if what == "subprocess.Popen" and len(args) > 1 else (kwargs.get("args") or args[:1])
        msg = (f"{what}({shown!r}) in the unit test {item.nodeid}: unit tests start no process "
               "(move the test to tests/integration, or test the logic on in-process objects)")
        item.stash[_started].append(msg)
        raise ProcessStartInUnitTest(msg)

    return refuse


@contextmanager
def _no_processes(item: pytest.Item) -> Iterator[None]:
    item.stash[_started] = []
    patches: list[tuple[Any, str, Any]] = [
        (subprocess.Popen, "__init__", _refuse(item, "subprocess.Popen")),  # run, call, check_output, asyncio
        (multiprocessing.process.BaseProcess, "start", _refuse(item, "multiprocessing.Process.start")),
    ]
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system", "execv", "execve", "execvp", "execvpe"):
        if hasattr(os, name):
            patches.append((os, name, _refuse(item, f"os.{name}")))
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    for obj, name, new in patches:
        setattr(obj, name, new)
    try:
        yield
    finally:
        for obj, name, old in saved:
            setattr(obj, name, old)


def _check(item: pytest.Item) -> None:
    started = item.stash.get(_started, [])
    if started:
        msgs, started[:] = list(started), []
        pytest.fail("\n".join(msgs), pytrace=False)


@contextmanager
def _reported_once(item: pytest.Item) -> Iterator[None]:
    """A phase that raised reports its own error (most often ProcessStartInUnitTest itself)."""
    try:
        yield
    except BaseException:
        item.stash.get(_started, []).clear()
        raise


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, Any, Any]:
    # This hook is called for every test of the session (not just the ones under this directory).
    if not item.path.resolve().is_relative_to(UNIT):
        return (yield)
    with _no_processes(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    with _reported_once(item):
        yield
    _check(item)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    with _reported_once(item):
        yield
    _check(item)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    with _reported_once(item):
        yield
    _check(item)
