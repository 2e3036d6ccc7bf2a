"""Shared fixtures: configs composed the way ``launch`` composes them, and processes owned by pid."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from toolkit.config import Config, from_dictconfig, register_configs, save_run_config, validate
from toolkit.lifecycle import ProcessRef, read_pidfiles, stop_processes
from toolkit.rundir import RunDir

CONF = Path(__file__).resolve().parent.parent / "conf"
register_configs()


def compose_config(overrides: list[str] | None = None) -> Config:
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return from_dictconfig(compose(config_name="config", overrides=overrides or []))


class Procs:
    """Processes a test started; stopped by pid at the end, never by name."""

    def __init__(self, run_dir: RunDir) -> None:
        self.run_dir = run_dir
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, *args: str, log: str) -> subprocess.Popen[bytes]:
        out = open(self.run_dir.logs / log, "ab")  # noqa: SIM115
        try:
            p = subprocess.Popen([sys.executable, "-u", *args], stdout=out, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL)
        finally:
            out.close()
        self.procs.append(p)
        return p

    def router(self) -> subprocess.Popen[bytes]:
        p = self.start("-m", "toolkit.router", str(self.run_dir.root), log="router.out")
        self.run_dir.wait_router_address(20)
        return p

    def replica(self, group: str, index: int) -> subprocess.Popen[bytes]:
        return self.start("-m", "toolkit.engine.replica", str(self.run_dir.root), group, str(index),
                          log=f"replica-{group}-{index}.out")

    def stop(self) -> None:
        refs = [ProcessRef.of(p.pid, "test") for p in self.procs if p.poll() is None]
        stop_processes(refs + read_pidfiles(self.run_dir.pids), grace_s=3)
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass


@pytest.fixture
def make_run(tmp_path: Path) -> Iterator:
    """``make_run(overrides) -> (cfg, run_dir, procs)``: a validated config saved in a fresh run dir."""
    owned: list[Procs] = []

    def factory(overrides: list[str] | None = None) -> tuple[Config, RunDir, Procs]:
        cfg = compose_config(overrides)
        validate(cfg)
        rd = RunDir(tmp_path / f"run{len(owned)}")
        rd.make()
        save_run_config(cfg, rd.config)
        procs = Procs(rd)
        owned.append(procs)
        return cfg, rd, procs

    yield factory
    for p in owned:
        p.stop()


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
