"""Setup checks of ``cluster=slurm`` and ``cluster=allocation`` beyond their fields' declared bounds
(``SlurmClusterConfig``, ``ReplicaResources``): what spans the cluster's fields and the run's groups."""

from __future__ import annotations

import dataclasses
from typing import Any

from toolkit.config import Config, SlurmClusterConfig
from toolkit.core.errors import FieldError


def _resources(c: SlurmClusterConfig) -> list[tuple[str, dict[str, Any]]]:
    """``cluster.replica`` and each group's overrides of it, by path."""
    return [("cluster.replica", dataclasses.asdict(c.replica)),
            *((f"cluster.group_resources.{g}", over) for g, over in c.group_resources.items())]


def named_partitions(c: SlurmClusterConfig) -> list[tuple[str, str]]:
    """Each partition the config names, by the field that names it (a field may list several: ``a,b``)."""
    fields = [("cluster.partition", c.partition),
              *((f"{prefix}.partition", values.get("partition")) for prefix, values in _resources(c))]
    return [(path, p) for path, value in fields if value for p in str(value).split(",")]


def check_slurm(cfg: Config) -> list[FieldError]:
    c = cfg.cluster
    assert isinstance(c, SlurmClusterConfig)
    errors = [FieldError(f"cluster.extra_sbatch[{i}]", line, "an sbatch option such as --reservation=rl")
              for i, line in enumerate(c.extra_sbatch) if not str(line).startswith("-")]
    errors += [FieldError(f"cluster.group_resources.{group}", over, f"one of the groups {sorted(cfg.groups)}")
               for group, over in c.group_resources.items() if group not in cfg.groups]
    return errors


def check_allocation(cfg: Config) -> list[FieldError]:
    """``cluster=slurm``'s checks, and one allocation's limits: its time limit holds the signal's grace, its
    one partition every step, its nodes every replica's GPUs."""
    c = cfg.cluster
    assert isinstance(c, SlurmClusterConfig)
    errors = check_slurm(cfg)
    # The allocation's --signal=B:USR1@N would come at the job's start (an endless requeue), or sbatch
    # refuses N above 65535. (With cluster=slurm the time limit is the components' jobs', not launch's.)
    if c.job_timeout_min >= 1 and (c.signal_grace_s >= c.job_timeout_min * 60 or c.signal_grace_s > 65535):
        errors.append(FieldError("cluster.signal_grace_s", c.signal_grace_s,
                                 f"below cluster.job_timeout_min = {c.job_timeout_min} min "
                                 f"({c.job_timeout_min * 60}s) and at most 65535"))
    # One allocation has one partition, and its steps end with it.
    errors += [FieldError(f"{prefix}.partition", values["partition"],
                          "null with cluster=allocation (a group's own partition needs cluster=slurm)")
               for prefix, values in _resources(c) if values.get("partition") is not None]
    if c.gpus_per_node:
        for group in cfg.groups:
            gpus = c.group_resources.get(group, {}).get("gpus", c.replica.gpus)
            if isinstance(gpus, int) and gpus > c.gpus_per_node:
                errors.append(FieldError(f"groups.{group} gpus", gpus, f"at most cluster.gpus_per_node = {c.gpus_per_node}"))
    return errors
