"""Shared fixtures: configs composed the way ``launch`` composes them, and processes owned by pid."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from toolkit.client import RouterClient
from toolkit.config import CONF_DIR, Config, compose_config, register_configs
from toolkit.core.rundir import RunDir
from toolkit.launch.stack import LocalStack
from toolkit.launch.validation import validate

CONF = CONF_DIR
register_configs()




@pytest.fixture
def make_run(tmp_path: Path) -> Iterator:
    """``make_run(overrides) -> (cfg, run_dir, stack)``: a validated config saved in a fresh run dir;
    the stack's processes are stopped by pid at the end of the test."""
    owned: list[LocalStack] = []

    def factory(overrides: list[str] | None = None) -> tuple[Config, RunDir, LocalStack]:
        cfg = compose_config(overrides)
        validate(cfg)
        stack = LocalStack(cfg, tmp_path / f"run{len(owned)}")
        owned.append(stack)
        return cfg, stack.run_dir, stack

    yield factory
    for p in owned:
        p.stop()


async def with_client(rd: RunDir, fn, timeout_s: float = 90.0):  # type: ignore[no-untyped-def]
    """Run ``fn(client)`` with a connected RouterClient of the run, bounded by ``timeout_s``."""
    c = RouterClient(rd)
    await c.connect(10)
    try:
        return await asyncio.wait_for(fn(c), timeout_s)
    finally:
        await c.close()


def wait_for(pred, timeout_s: float = 20.0, what: str = "condition") -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def launch(args: list[str], timeout_s: float = 180, **kw) -> subprocess.CompletedProcess[str]:  # type: ignore[no-untyped-def]
    env = dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="200")
    return subprocess.run([sys.executable, "-m", "toolkit.launch", *args], capture_output=True, text=True,
                          timeout=timeout_s, env=env, **kw)


def start_launch(args: list[str], **kw: Any) -> subprocess.Popen[str]:
    """``launch`` in the background (stdout and stderr together), for tests that act on it mid-run."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="200")
    return subprocess.Popen([sys.executable, "-m", "toolkit.launch", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, **kw)


def finish(proc: subprocess.Popen[str], timeout_s: float = 240) -> str:
    """Launch's output once it exits. If it does not exit in time, it gets SIGINT (its teardown:
    stop by pid, scancel) and, failing that, SIGKILL."""
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
    return output


def ranks_started(run: Path) -> bool:
    pids = run / "pids"
    return pids.exists() and any(pids.glob("rank-*.pid"))


def lose_node_rank(run: Path, timeout_s: float, replica: str = "replica-throughput-0", node: int = 1) -> list[int]:
    """Once the run's first step is written and node rank ``node`` of ``replica`` runs (its process and
    its engine worker: two pid files), SIGKILL all of them at once, as when that node is lost; their pids."""
    from toolkit.core.lifecycle import read_pidfiles

    def procs() -> list:  # type: ignore[type-arg]
        return [r for r in read_pidfiles(run / "pids") if r.name.startswith(f"{replica}-node{node}") and r.alive()]

    wait_for(lambda: len(procs()) >= 2 and (run / "steps" / "step_00000.json").exists(), timeout_s,
             f"the first step with node rank {node} of {replica} up")
    killed = []
    for ref in procs():
        os.kill(ref.pid, signal.SIGKILL)
        killed.append(ref.pid)
    return killed
