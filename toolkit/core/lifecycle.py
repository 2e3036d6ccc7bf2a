"""Process lifecycles: pid files, an owner watchdog, logging setup, and stopping by pid.

Every component writes ``pids/<name>.pid`` (pid and kernel start time, so a recycled pid is never
signalled). Teardown and tests stop exactly those processes; nothing is ever killed by name.
"""

from __future__ import annotations

import asyncio
import faulthandler
import gc
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from toolkit.core.errors import Terminated

logger = logging.getLogger(__name__)
T = TypeVar("T")


def _stat(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat``'s fields from the third (state) on, None if the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Counted after the parenthesised command name, which may itself contain spaces.
    return stat[stat.rfind(")") + 2 :].split()


def start_time(pid: int) -> int | None:
    """The kernel start time of a process (clock ticks since boot), None if it is gone."""
    fields = _stat(pid)
    if fields is None or fields[0] == "Z":
        return None
    return int(fields[19])  # field 22


def cpu_seconds(pid: int) -> float | None:
    """CPU seconds (user + system) process ``pid`` has used, None if it is gone."""
    fields = _stat(pid)
    if fields is None:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # fields 14, 15


@dataclass(frozen=True)
class ProcessRef:
    pid: int
    start: int | None
    name: str = ""
    host: str = ""
    """The machine it runs on ("": this one, as recorded before hosts were): a pid means nothing on
    another (a resume's launch reading pid files a Slurm compute node wrote)."""

    @classmethod
    def of(cls, pid: int, name: str = "") -> ProcessRef:
        return cls(pid, start_time(pid), name, socket.gethostname())

    @classmethod
    def self(cls, name: str = "") -> ProcessRef:
        return cls.of(os.getpid(), name)

    @property
    def here(self) -> bool:
        return not self.host or self.host == socket.gethostname()

    def alive(self) -> bool:
        """Whether it still runs (False for a process of another machine: not this one's to judge)."""
        if not self.here:
            return False
        now = start_time(self.pid)
        return now is not None and (self.start is None or now == self.start)

    def signal(self, sig: int) -> None:
        """Signal the process if it is still the one recorded; never a ref without a start time (its
        process was gone when recorded: the pid may belong to anyone now)."""
        if self.start is not None and self.alive():
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def encode(self) -> str:
        return json.dumps({"pid": self.pid, "start": self.start, "name": self.name, "host": self.host})

    @property
    def arg(self) -> str:
        """``pid:start``: how a component's command line names the process it lives and dies with."""
        return f"{self.pid}:{self.start if self.start is not None else ''}"

    @classmethod
    def from_arg(cls, text: str, name: str = "owner") -> ProcessRef:
        """The process :attr:`arg` names (on this machine)."""
        pid, _, start = text.partition(":")
        return cls(int(pid), int(start) if start else None, name)

    @classmethod
    def decode(cls, text: str) -> ProcessRef:
        d = json.loads(text)
        return cls(int(d["pid"]), d.get("start"), d.get("name", ""), d.get("host", ""))


def popen_logged(cmd: list[str], log: Path, **popen_kw: Any) -> subprocess.Popen[bytes]:
    """Start ``cmd`` with stdout and stderr appended to ``log`` and no stdin; the child keeps the file."""
    out = open(log, "ab")  # noqa: SIM115 - the child owns it
    try:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, **popen_kw)
    finally:
        out.close()


def write_pidfile(path: Path, ref: ProcessRef) -> None:
    """Record ``ref`` at ``path`` (``RunDir.pidfile``); a ref without a start time is never recorded
    (its process had already gone, and :meth:`ProcessRef.signal` would not act on it anyway)."""
    if ref.start is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(ref.encode())


def read_pidfiles(pid_dir: Path) -> list[ProcessRef]:
    refs = []
    for p in sorted(pid_dir.glob("*.pid")):
        try:
            refs.append(ProcessRef.decode(p.read_text()))
        except (OSError, ValueError, KeyError):
            logger.warning("unreadable pid file %s", p)
    return refs


def stop_processes(refs: list[ProcessRef], grace_s: float = 5.0) -> list[ProcessRef]:
    """SIGTERM, then SIGKILL after ``grace_s``; returns those still alive at the end (should be none)."""
    unique: dict[int, ProcessRef] = {}
    for r in refs:  # a process can be known twice (its launcher and its pid file): keep a start time
        if unique.get(r.pid) is None or unique[r.pid].start is None:
            unique[r.pid] = r
    live = [r for r in unique.values() if r.start is not None and r.alive()]  # see ProcessRef.signal
    for r in live:
        r.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while live and time.monotonic() < deadline:
        time.sleep(0.05)
        live = [r for r in live if r.alive()]
    for r in live:
        logger.warning("process %s (%s) ignored SIGTERM; killing it", r.pid, r.name)
        r.signal(signal.SIGKILL)
    deadline = time.monotonic() + 2.0
    while live and time.monotonic() < deadline:
        time.sleep(0.02)
        live = [r for r in live if r.alive()]
    return live


def exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit (:class:`~toolkit.core.errors.Terminated`) so ``finally`` blocks close
    sockets and engines."""

    def handler(signum: int, frame: object) -> None:
        # Once: a second SIGTERM must not interrupt the cleanup the first one started.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Terminated(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def run_until_terminated(main: Coroutine[Any, Any, T], grace_s: float) -> T:
    """``asyncio.run(main)``, SIGTERM cancelling ``main`` at the loop's next turn and raising
    :class:`~toolkit.core.errors.Terminated` once its cleanup (``finally`` blocks, at their awaits) is
    done: never an exception raised at an arbitrary line of the loop's or a library's code. A cleanup
    that hangs is bounded: ``grace_s`` after the signal every thread's stack goes to stderr (the
    process's raw output, ``logs/<name>.out``) and the process exits with status 1."""
    signalled = False
    previous = signal.getsignal(signal.SIGTERM)

    async def guarded() -> T:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None

        def on_sigterm() -> None:
            nonlocal signalled
            if signalled:  # a second SIGTERM must not interrupt the cleanup the first one started
                return
            signalled = True
            faulthandler.dump_traceback_later(grace_s, exit=True)
            task.cancel()

        loop.add_signal_handler(signal.SIGTERM, on_sigterm)
        return await main

    try:
        return asyncio.run(guarded())
    except asyncio.CancelledError:
        if signalled:
            raise Terminated(128 + signal.SIGTERM) from None
        raise
    finally:
        # The loop closed with its handler. Signalled: no later SIGTERM may cut the exit short.
        signal.signal(signal.SIGTERM, signal.SIG_IGN if signalled else previous)


def watch_owner(owner: ProcessRef | None, interval_s: float = 1.0) -> None:
    """Exit this process (via SIGTERM to itself) once ``owner`` is gone: no orphan outlives a run."""
    if owner is None:
        return

    def loop() -> None:
        while owner.alive():
            time.sleep(interval_s)
        logger.warning("owner process %s is gone; exiting", owner.pid)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=loop, name="owner-watchdog", daemon=True).start()


def setup_logging(log_file: Path | None = None, level: int = logging.INFO) -> None:
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(log_file))
    logging.basicConfig(
        level=level,
        format="%(asctime)s %(levelname)s %(name)s [%(process)d] %(message)s",
        handlers=handlers,
        force=True,
    )


def log_uncaught() -> None:
    """An exception that ends this process goes to its log too, with its traceback: a job runner
    (submitit) logs only that the job raised, and the traceback would be in the job's raw output alone."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        if not issubclass(kind, KeyboardInterrupt):
            logging.getLogger("toolkit").critical("this process ends on an uncaught exception",
                                                  exc_info=(kind, value, tb))
        previous(kind, value, tb)

    sys.excepthook = hook


def stdout_file() -> str | None:
    """The file this process's standard output goes to (a submitit or Slurm job's log), None if it is
    not a file: what a library prints rather than logs (vLLM's engine processes) is there."""
    try:
        target = os.readlink("/proc/self/fd/1")
    except OSError:
        return None
    return target if os.path.isfile(target) else None


def quiet_gc(gen0: int = 50_000) -> None:
    """Keep the cyclic garbage collector out of a serving loop's way: what was allocated at startup
    (modules, config, tokenizer) is frozen out of every collection, and the young generation is
    collected less often. Measured on a rank serving 256 agent sessions (``toolkit/bench/gateway.py``):
    time in collections 0.47-1.7 s -> 0.32-0.35 s per run."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(gen0, *gc.get_threshold()[1:])
