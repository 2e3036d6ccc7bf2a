"""The interface every cluster backend implements, and the components it hands back."""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from toolkit.config import Config
from toolkit.core.lifecycle import ProcessRef, read_pidfiles, stop_processes, write_pidfile
from toolkit.core.rundir import RunDir

logger = logging.getLogger(__name__)


class Component(ABC):
    """One started thing (a job, a process group) that the run owns and must stop."""

    def __init__(self, name: str) -> None:
        self.name = name

    @abstractmethod
    def alive(self) -> bool: ...

    @abstractmethod
    def state(self) -> str:
        """A short human-readable state (RUNNING, FINISHED, exit code...)."""

    @abstractmethod
    def exit_code(self) -> int | None:
        """None while running."""

    @abstractmethod
    def cancel(self) -> None:
        """Ask it to stop (returns at once)."""

    @abstractmethod
    def kill(self) -> None:
        """Stop it now."""

    @abstractmethod
    def refs(self) -> list[ProcessRef]:
        """The processes this component started directly (for the by-pid teardown)."""

    def outputs(self) -> list[Path]:
        """Files holding what its processes printed rather than logged (a traceback, an engine's own
        errors), one per task: where a failure's cause is when its log does not have it."""
        return []

    def pending(self) -> bool:
        """Waiting for resources (a queued Slurm job); bounded by ``cluster.ready_timeout_s``."""
        return False

    def stop(self, wait_s: float = 30.0) -> bool:
        """Cancel it, kill it if it has not ended within ``wait_s``; whether it is gone (a controller
        that does not answer may leave it running: nothing must be started in its place then)."""
        for end in (self.cancel, self.kill):
            end()
            deadline = time.monotonic() + wait_s
            while self.alive() and time.monotonic() < deadline:
                time.sleep(0.2)
            if not self.alive():
                return True
        return False

    def interrupted(self) -> str:
        """Why it ended without failing ("" if it did not): Slurm's time limit, a preemption, a node's
        failure. A run whose ranks end so is interrupted, and ``resume=true`` continues it."""
        return ""


def exit_story(comp: Component, log: Path) -> str:
    """Why ``comp`` ended, as far as its files tell: the last lines of its log and of its raw outputs (a
    traceback, or an engine's own error: vLLM's workers print theirs)."""
    outputs = "".join(f"\nlast lines of its output {out}:\n{tail_lines(out, 25)}" for out in comp.outputs())
    return f"{comp.name} exited ({comp.state()}); last lines of {log}:\n{tail_lines(log)}{outputs}"


def submitit_outputs(job: Any) -> list[Path]:
    """A submitit job's raw outputs, every task's: its ``*_log.out`` then its ``*_log.err`` (none where
    its stderr goes to its stdout)."""
    folder, jid = Path(job.paths.folder), job.job_id
    return [*sorted(folder.glob(f"{jid}_*_log.out")), *sorted(folder.glob(f"{jid}_*_log.err"))]


def tail_lines(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class Cluster(ABC):
    def __init__(self, cfg: Config, run_dir: RunDir, owner: ProcessRef) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.owner = owner
        self.components: list[Component] = []

    def track(self, comp: Component) -> Component:
        """Own ``comp``: it is stopped by ``stop_all``, and its pids are recorded in the run dir."""
        self.components.append(comp)
        for ref in comp.refs():
            write_pidfile(self.run_dir.pidfile(f"{comp.name}.launcher", ref.pid), ref)
        return comp

    @abstractmethod
    def start_router(self) -> Component: ...

    @abstractmethod
    def start_replica(self, group: str, index: int) -> Component: ...

    def start_group(self, group: str, n: int) -> list[Component]:
        """Replicas 0..n-1 of ``group`` (a backend may submit them together, e.g. as a job array)."""
        return [self.start_replica(group, i) for i in range(n)]

    def max_replicas(self, group: str) -> int | None:
        """The most replicas of ``group`` this backend can run at once (None: as many as asked for)."""
        return None

    @abstractmethod
    def start_ranks(self, n: int, first_step: int = 0) -> Component:
        """The ``n`` rollout ranks as one MPI world, beginning at ``first_step`` (a resumed run)."""

    def stop_all(self, grace_s: float = 5.0, sweep: bool = True) -> list[ProcessRef]:
        """Cancel every component, then stop by pid whatever is left (with ``sweep``, every process in
        the run dir's pid files too); returns survivors (none)."""
        for c in self.components:
            if c.alive():
                c.cancel()
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(c.alive() for c in self.components):
            time.sleep(0.05)
        for c in self.components:
            if c.alive():
                logger.warning("%s did not stop in %.0fs; killing it", c.name, grace_s)
                c.kill()
        refs = [r for c in self.components for r in c.refs()] + (read_pidfiles(self.run_dir.pids) if sweep else [])
        refs = [r for r in refs if r.pid != self.owner.pid]
        return stop_processes(refs, grace_s=2.0)

