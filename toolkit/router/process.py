"""The router process's entry: enter the run, bind, serve until told to stop, write the stats."""

from __future__ import annotations

import logging

from toolkit.config.entry import enter_component
from toolkit.core.lifecycle import ProcessRef, quiet_gc
from toolkit.core.sockets import bind_host
from toolkit.router.server import Router

logger = logging.getLogger(__name__)


def serve(run_dir: str, owner: ProcessRef | None = None) -> None:
    """Entry point of the router process (a submitit job or ``python -m toolkit.router RUN_DIR``)."""
    rd, cfg = enter_component(run_dir, "router", owner)
    router = Router(cfg, rd)
    try:
        router.bind(bind_host(cfg.router.host, cfg.cluster.type))
        quiet_gc()  # as the ranks do: 5% of the router's instructions a request, counted in-process
        router.run()
    except (KeyboardInterrupt, SystemExit):
        logger.info("router stopping")
    finally:
        router.write_stats()
        router.close()
