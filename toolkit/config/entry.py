"""What every component process does first, whatever started it (submitit, srun, mpiexec)."""

from __future__ import annotations

from pathlib import Path

from toolkit.config import Config, load_run_config
from toolkit.core.lease import watch_lease
from toolkit.core.lifecycle import (
    ProcessRef,
    exit_on_sigterm,
    log_uncaught,
    setup_logging,
    watch_owner,
    write_pidfile,
)
from toolkit.core.rundir import RunDir


def enter_component(run_dir: str | Path, name: str, owner: ProcessRef | None = None,
                    log_name: str | None = None) -> tuple[RunDir, Config]:
    """Log to ``logs/<log_name or name>.log`` (an uncaught exception too), turn SIGTERM into SystemExit
    (so ``finally`` blocks close sockets and engines), load the run's config, exit with its lease
    (everywhere: at once if the lease is already another launch's) or with the launch process
    (``owner``, when it runs on this machine), and write the pid file."""
    rd = RunDir(Path(run_dir))
    setup_logging(rd.log(log_name or name))
    log_uncaught()
    exit_on_sigterm()
    cfg = load_run_config(rd.root)
    # Before the pid file: a component of a superseded launch that starts late leaves none behind for
    # the newer launch to count (ranks through MPI_Init) or to stop.
    watch_lease(rd, cfg.cluster.lease_s)
    me = ProcessRef.self(name)
    write_pidfile(rd.pidfile(name, me.pid), me)
    watch_owner(owner)
    return rd, cfg
