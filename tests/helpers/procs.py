"""Processes in integration and cluster tests: ``python -m toolkit.launch`` in the foreground or the
background, waiting for a condition, and what a run leaves behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from toolkit.core.lifecycle import read_pidfiles


def wait_for(pred: Callable[[], Any], timeout_s: float = 20.0, what: str = "condition") -> Any:
    """The predicate's first truthy value, polled every 50 ms for at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := pred():
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def launch(args: list[str], timeout_s: float = 180, env_extra: dict[str, str] | None = None,
           **kw: Any) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="200", **(env_extra or {}))
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


@contextmanager
def explained(proc: subprocess.Popen[str], run: Path) -> Iterator[None]:
    """A wait that fails inside names what the run did: launch is stopped (``finish``) and its output's
    tail and the tail of every log of the run join the failure's message."""
    try:
        yield
    except AssertionError as e:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        output = finish(proc, 120)
        raise AssertionError(f"{e}\n--- launch's output ---\n{output[-4000:]}{log_tails(run)}") from None


def log_tails(run: Path, chars: int = 1500) -> str:
    """The last ``chars`` of every log of run dir ``run`` and of its jobs' raw outputs (submitit's
    ``*_log.out``/``.err``: tracebacks, an engine's own errors), each under its name."""
    logs = run / "logs"
    files = [*sorted(logs.glob("*.log")), *sorted(logs.rglob("*_log.out")), *sorted(logs.rglob("*_log.err"))] \
        if logs.is_dir() else []
    return "".join(f"\n--- {p.relative_to(logs)} ---\n{p.read_text(errors='replace')[-chars:]}" for p in files
                   if p.stat().st_size)


def ranks_started(run: Path) -> bool:
    pids = run / "pids"
    return pids.exists() and any(pids.glob("rank-*.pid"))


def lose_node_rank(run: Path, timeout_s: float, launch: subprocess.Popen[str], replica: str = "replica-throughput-0",
                   node: int = 1) -> list[int]:
    """Once the run's first step is written and node rank ``node`` of ``replica`` runs (its process and
    its engine worker: two pid files), SIGKILL all of them at once, as when that node is lost; their pids.
    Fails at once if ``launch`` has ended before."""

    def procs() -> list:  # type: ignore[type-arg]
        return [r for r in read_pidfiles(run / "pids") if r.name.startswith(f"{replica}-node{node}") and r.alive()]

    def up() -> bool:
        if launch.poll() is not None:
            raise AssertionError(f"launch exited ({launch.returncode}) before the first step with node rank {node} up")
        return len(procs()) >= 2 and (run / "steps" / "step_00000.json").exists()

    wait_for(up, timeout_s, f"the first step with node rank {node} of {replica} up")
    killed = []
    for ref in procs():
        os.kill(ref.pid, signal.SIGKILL)
        killed.append(ref.pid)
    return killed


def assert_no_process_left(run: Path, ranks: bool = True) -> None:
    """Every process the run recorded is gone (the router's and, with ``ranks``, the ranks' among them)."""
    refs = read_pidfiles(run / "pids")
    names = {r.name for r in refs}
    assert "router" in names and (not ranks or any(n.startswith("rank-") for n in names)), names
    alive = [(r.pid, r.name) for r in refs if r.alive()]
    assert not alive, f"still running after the run: {alive}"
