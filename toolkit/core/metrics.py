"""Prometheus metrics (``report.metrics``): components serve a read-only ``/metrics`` with
``prometheus_client``, each from its own registry and port, on the router's host rules (loopback
locally, every interface on Slurm). No prompt or token is ever in a metric: counts, rates, times.

Each component writes ``<run dir>/metrics/<name>.json`` (its ``host:port`` and labels) when it starts
serving; ``launch`` merges them into ``<run dir>/prometheus_targets.json`` in Prometheus' ``file_sd``
format, so a site's Prometheus (``file_sd_configs: [{files: [.../prometheus_targets.json]}]``) scrapes
every component of a run with no configuration.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server

from toolkit.core.rundir import RunDir, atomic_write, read_json
from toolkit.core.sockets import node_address

logger = logging.getLogger(__name__)


class Endpoint:
    """One component's ``/metrics``: ``registry`` served on an ephemeral port of ``host`` (a daemon
    thread), and its endpoint file, which :meth:`close` removes (a killed component's stays: its target
    is then down, which is what Prometheus should see)."""

    def __init__(self, registry: CollectorRegistry, host: str, run_dir: RunDir, name: str,
                 labels: dict[str, str]) -> None:
        self._server, self._thread = start_http_server(0, addr=host, registry=registry)
        self.port = int(self._server.server_port)
        shown = node_address() if host in ("0.0.0.0", "::", "*") else host
        self.target = f"{shown}:{self.port}"
        self.path = run_dir.metrics / f"{name}.json"
        atomic_write(self.path, json.dumps({"target": self.target, "pid": os.getpid(),
                                            "labels": {"component": name, **labels}}))
        logger.info("metrics on http://%s/metrics", self.target)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            info = read_json(self.path)
            if info and info.get("pid") == os.getpid():  # not a replacement's
                self.path.unlink()
        self._server.shutdown()
        self._server.server_close()


def write_targets(run_dir: RunDir) -> list[dict[str, Any]]:
    """``prometheus_targets.json`` from every endpoint file (file_sd: a list of {targets, labels}).
    ``run`` is the run dir's absolute path: a basename would be ``0``, ``1``... in every multirun sweep.
    No target is labelled ``job``: that label is Prometheus' scrape job, and a target's would rename the
    router's and replicas' own ``job`` (the rollout job of each series) to ``exported_job``."""
    groups = []
    for path in sorted(run_dir.metrics.glob("*.json")) if run_dir.metrics.exists() else []:
        info = read_json(path)
        if info:
            groups.append({"targets": [info["target"]], "labels": {"run": str(run_dir.root.absolute()), **info["labels"]}})
    atomic_write(run_dir.prometheus_targets, json.dumps(groups, indent=1))
    return groups
