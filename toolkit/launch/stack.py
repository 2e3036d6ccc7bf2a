"""A router and its replicas as plain local processes, without launch: for benchmarks and tests.

``LocalStack`` writes a config into a run dir, starts ``python -m toolkit.router`` and
``python -m toolkit.engine.replica`` processes, waits until every group is ready, and stops exactly
the processes it started (by pid) when it is closed.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from toolkit.client import ready_counts, router_status
from toolkit.config import Config, save_run_config
from toolkit.core.errors import ReadinessTimeout
from toolkit.core.lifecycle import ProcessRef, popen_logged, read_pidfiles, stop_processes
from toolkit.core.names import process_name
from toolkit.core.rundir import RunDir


class LocalStack:
    def __init__(self, cfg: Config, root: Path) -> None:
        self.cfg = cfg
        self.run_dir = RunDir(root)
        self.run_dir.make()
        save_run_config(cfg, self.run_dir.config)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.owner = ProcessRef.self("stack")
        """This process: its router and replicas end with it (a benchmark killed, a test runner's timeout)."""
        self.replicas: dict[tuple[str, int], subprocess.Popen[bytes]] = {}
        self.frontend = ""

    def __enter__(self) -> LocalStack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def spawn(self, *args: str, log: str) -> subprocess.Popen[bytes]:
        p = popen_logged([sys.executable, "-u", *args], self.run_dir.logs / log)
        self.procs.append(p)
        return p

    def start_router(self, timeout_s: float = 30.0) -> subprocess.Popen[bytes]:
        p = self.spawn("-m", "toolkit.router", str(self.run_dir.root), self.owner.arg, log="router.out")
        self.frontend = self.run_dir.wait_router_address(timeout_s)["frontend"]
        return p

    def start_replica(self, group: str, index: int) -> subprocess.Popen[bytes]:
        p = self.spawn("-m", "toolkit.engine.replica", str(self.run_dir.root), group, str(index), self.owner.arg,
                       log=f"{process_name(group, index)}.out")
        self.replicas[(group, index)] = p
        return p

    def start(self, timeout_s: float = 60.0) -> LocalStack:
        """Router plus every replica of every group; returns once all are ready."""
        self.start_router()
        for g, gc in self.cfg.groups.items():
            for i in range(gc.replicas):
                self.start_replica(g, i)
        self.wait_ready(timeout_s)
        return self

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        want = {g: c.replicas for g, c in self.cfg.groups.items()}
        while time.monotonic() < deadline:
            st = router_status(self.frontend, 1.0)
            if st is not None and all(have >= want[g] for g, have in ready_counts(st, want).items()):
                return
            time.sleep(0.05)
        raise ReadinessTimeout(f"replicas not ready after {timeout_s:.0f}s (logs in {self.run_dir.logs})")

    def stop(self) -> None:
        refs = [ProcessRef.of(p.pid, "stack") for p in self.procs if p.poll() is None]
        stop_processes(refs + read_pidfiles(self.run_dir.pids), grace_s=3.0)
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
