"""Cluster backends: how the router, replicas and ranks get started. Chosen by ``cluster.type``."""

from __future__ import annotations

from toolkit.cluster.base import Cluster, Component
from toolkit.config import CLUSTERS, Config
from toolkit.errors import ConfigError, FieldError
from toolkit.lifecycle import ProcessRef
from toolkit.rundir import RunDir

__all__ = ["Cluster", "Component", "make_cluster"]


def make_cluster(cfg: Config, run_dir: RunDir, owner: ProcessRef) -> Cluster:
    if cfg.cluster.type == "local":
        from toolkit.cluster.local import LocalCluster

        return LocalCluster(cfg, run_dir, owner)
    raise ConfigError([FieldError("cluster.type", cfg.cluster.type, f"one of {list(CLUSTERS)}")])
