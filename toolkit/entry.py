"""What every component process does first, whatever started it (submitit, srun, mpiexec)."""

from __future__ import annotations

from pathlib import Path

from toolkit.config import Config, load_run_config
from toolkit.lease import watch_lease
from toolkit.lifecycle import ProcessRef, exit_on_sigterm, setup_logging, watch_owner, write_pidfile
from toolkit.rundir import RunDir


def enter_component(run_dir: str | Path, name: str, owner: ProcessRef | None = None,
                    log_name: str | None = None) -> tuple[RunDir, Config]:
    """Log to ``logs/<log_name or name>.log``, turn SIGTERM into SystemExit (so ``finally`` blocks
    close sockets and engines), write the pid file, exit with the launch process (``owner``, when it
    runs on this machine) or with its lease (everywhere), and load the run's config."""
    rd = RunDir(Path(run_dir))
    setup_logging(rd.logs / f"{log_name or name}.log")
    exit_on_sigterm()
    write_pidfile(rd.pids, name)
    watch_owner(owner)
    cfg = load_run_config(rd.root)
    watch_lease(rd, cfg.cluster.lease_s)
    return rd, cfg
