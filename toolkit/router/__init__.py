"""The router: queue, fair dispatch across jobs, replica policies, tail flip."""

from __future__ import annotations

import logging
from pathlib import Path

from toolkit.lifecycle import ProcessRef, exit_on_sigterm, setup_logging, watch_owner, write_pidfile

logger = logging.getLogger(__name__)


def serve(run_dir: str, owner: ProcessRef | None = None) -> None:
    """Entry point of the router process (a submitit job or ``python -m toolkit.router RUN_DIR``)."""
    from toolkit.config import load_run_config
    from toolkit.router.server import Router
    from toolkit.rundir import RunDir
    from toolkit.sockets import bind_host

    rd = RunDir(Path(run_dir))
    setup_logging(rd.logs / "router.log")
    exit_on_sigterm()
    write_pidfile(rd.pids, "router")
    watch_owner(owner)
    cfg = load_run_config(rd.root)
    router = Router(cfg, rd)
    try:
        router.bind(bind_host(cfg.router.host, cfg.cluster.type))
        router.run()
    except (KeyboardInterrupt, SystemExit):
        logger.info("router stopping")
    finally:
        router.write_stats()
        router.close()
