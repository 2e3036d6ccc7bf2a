"""Prometheus metrics (``report.metrics``): components serve a read-only ``/metrics`` with
``prometheus_client``, each from its own registry and port, on the router's host rules (loopback
locally, every interface on Slurm). No prompt or token is ever in a metric: counts, rates, times.

Each component writes ``<run dir>/metrics/<name>.json`` (its ``host:port`` and labels) when it starts
serving; ``launch`` merges them into ``<run dir>/prometheus_targets.json`` in Prometheus' ``file_sd``
format, so a site's Prometheus (``file_sd_configs: [{files: [.../prometheus_targets.json]}]``) scrapes
every component of a run with no configuration.
"""

from __future__ import annotations

import json
import logging
import socket
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server

from toolkit.rundir import RunDir, atomic_write, read_json

logger = logging.getLogger(__name__)


def serve(registry: CollectorRegistry, host: str, run_dir: RunDir, name: str, labels: dict[str, str]) -> int:
    """Serve ``registry`` on an ephemeral port of ``host`` (a daemon thread) and record the endpoint."""
    server, _ = start_http_server(0, addr=host, registry=registry)
    port = int(server.server_port)
    shown = socket.gethostname() if host in ("0.0.0.0", "::", "*") else host
    atomic_write(run_dir.metrics / f"{name}.json",
                 json.dumps({"target": f"{shown}:{port}", "labels": {"component": name, **labels}}))
    logger.info("metrics on http://%s:%d/metrics", shown, port)
    return port


def write_targets(run_dir: RunDir) -> list[dict[str, Any]]:
    """``prometheus_targets.json`` from every endpoint file (file_sd: a list of {targets, labels})."""
    groups = []
    for path in sorted(run_dir.metrics.glob("*.json")) if run_dir.metrics.exists() else []:
        info = read_json(path)
        if info:
            groups.append({"targets": [info["target"]], "labels": {"run": run_dir.root.name, **info["labels"]}})
    atomic_write(run_dir.prometheus_targets, json.dumps(groups, indent=1))
    return groups
