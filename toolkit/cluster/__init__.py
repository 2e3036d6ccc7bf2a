"""Cluster backends: how the router, replicas and ranks get started. Chosen by ``cluster.type``."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from toolkit.cluster.allocation import allocation_problems
from toolkit.cluster.base import Cluster, Component, exit_story, tail_lines
from toolkit.cluster.slurm_checks import named_partitions
from toolkit.cluster.storage import check_shared, cluster_nodes
from toolkit.config import CLUSTERS, Config, SlurmClusterConfig
from toolkit.core.errors import ConfigError, FieldError
from toolkit.core.lifecycle import ProcessRef
from toolkit.core.rundir import RunDir
from toolkit.core.slurmctl import partitions

__all__ = ["Cluster", "Component", "exit_story", "make_cluster", "partition_errors", "preflight", "tail_lines"]


def make_cluster(cfg: Config, run_dir: RunDir, owner: ProcessRef) -> Cluster:
    cluster = CLUSTERS.impl(cfg.cluster.type)(cfg, run_dir, owner)
    assert isinstance(cluster, Cluster)
    return cluster


def preflight(cfg: Config, run_root: Path) -> None:
    """Checks that need the machine, not just the config, before anything is written or started (found
    later, they left a run dir that a corrected command was then refused): ``cluster=allocation`` runs
    inside an allocation that holds its plan (nodes, and CPUs, memory and GPUs a node), ``cluster=slurm`` has ``sbatch``, every partition named is
    the cluster's; on Slurm the run dir (and the compile-cache dir) must be on storage that every node sees."""
    c = cfg.cluster
    if not isinstance(c, SlurmClusterConfig):
        return
    errors = _environment_errors(cfg)
    if c.shared_fs_check:
        errors += _storage_errors(c, run_root)
    if errors:
        raise ConfigError(errors)


def _environment_errors(cfg: Config) -> list[FieldError]:
    if cfg.cluster.type == "slurm" and shutil.which("sbatch") is None:
        return [FieldError("cluster", "slurm", "a machine with Slurm's sbatch on PATH (a login node)")]
    c = cfg.cluster
    assert isinstance(c, SlurmClusterConfig)
    known = partitions() if named_partitions(c) else None
    errors = partition_errors(c, known) if known is not None else []
    if cfg.cluster.type == "allocation":
        errors += [FieldError("cluster", "allocation", f"runs {why}") for why in allocation_problems(cfg, os.environ)]
    return errors


def partition_errors(c: SlurmClusterConfig, known: list[str]) -> list[FieldError]:
    """Each partition ``c`` names that is not among the cluster's ``known`` ones (else found at the first
    sbatch, after the run dir was taken)."""
    return [FieldError(path, p, f"one of the cluster's partitions: {', '.join(known)}")
            for path, p in named_partitions(c) if p not in known]


def _storage_errors(c: SlurmClusterConfig, run_root: Path) -> list[FieldError]:
    nodes = cluster_nodes(c.partition)
    errors = []
    for field, path in (("hydra.run.dir", run_root), ("cluster.cache_dir", c.cache_dir)):
        if path is None:
            continue
        msg = check_shared(Path(path), "the run dir" if field == "hydra.run.dir" else "the cache dir", nodes)
        if msg:
            errors.append(FieldError(field, str(path), msg))
    return errors
