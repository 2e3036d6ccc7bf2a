"""Resume (``resume=true``): continue a run in its run dir at the first step without a step report.

A step's report is the last file written for it, so every step before the first one without a report
is complete, and what the interrupted run left of that step (a Parquet file written before the crash,
shards) is removed and the step runs again from its beginning, with the same sessions and seeds.
The config may differ from the stored one only in run settings: how long, where and how fast it
runs, never what it generates.
"""

from __future__ import annotations

import fnmatch
import json
import logging
from dataclasses import dataclass
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from toolkit.config import Config, load_run_config
from toolkit.core.errors import ConfigError, FieldError
from toolkit.core.lifecycle import read_pidfiles, stop_processes
from toolkit.core.rundir import RunDir, atomic_write, read_json
from toolkit.core.slurmctl import scancel, wait_gone

logger = logging.getLogger(__name__)

RUN_SETTINGS = (
    "steps", "resume", "cluster.*", "ranks", "groups.*.replicas", "groups.*.max_inflight", "router.*",
    "rollout.max_concurrent_rollouts", "rollout.max_failed_fraction", "rollout.request_timeout_s",
    "rollout.weights_timeout_s", "rollout.load_timeout_s", "rollout.weights_poll_s", "rollout.update_mode",
    "workload.env_timeout_s", "gateway.host", "gateway.port", "gateway.max_concurrent_requests",
    "gateway.max_body_mb", "gateway.keepalive_s", "engine.time_scale", "report.*",
)
"""Keys a resumed run may change (glob patterns): they change when, where and how fast the sessions
run, not which sessions run or what they generate."""


def _flat(cfg: Config) -> dict[str, Any]:
    out: dict[str, Any] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict) and node:
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            out[prefix] = node

    walk("", OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True))
    return out


def config_changes(stored: Config, new: Config) -> list[FieldError]:
    """The keys that differ and may not: every one, with both values."""
    old_flat, new_flat = _flat(stored), _flat(new)
    errors = []
    for key in sorted(old_flat.keys() | new_flat.keys()):
        old, cur = old_flat.get(key, "<absent>"), new_flat.get(key, "<absent>")
        if old == cur or any(fnmatch.fnmatchcase(key, pat) for pat in RUN_SETTINGS):
            continue
        errors.append(FieldError(key, cur, f"the run being resumed has {old!r}"))
    return errors


def check(cfg: Config, rd: RunDir) -> None:
    """Refuse to resume with a config that would generate differently (every differing key named)."""
    if not rd.config.exists():
        raise ConfigError([FieldError("resume", True, f"{rd.config} is missing: the run dir holds no run to resume "
                                                      "(remove the directory, or pass a new hydra.run.dir)")])
    errors = config_changes(load_run_config(rd.root), cfg)
    if errors:
        errors.append(FieldError("resume", True, "a resume may change only run settings: " + ", ".join(RUN_SETTINGS)
                                 + "; start a new run (a new hydra.run.dir) to change anything else"))
        raise ConfigError(errors)


@dataclass
class ResumePoint:
    first_step: int
    """The first step without a step report: it runs again from its beginning."""
    removed: list[str]
    """What the interrupted run had left of that step and later ones (removed)."""


def prepare(rd: RunDir, epoch: int, cfg: Config, overrides: list[str] | None = None) -> ResumePoint:
    """After taking the lease (epoch ``epoch``), before ``cfg`` replaces the stored config: stop what
    the previous launch left running, remove its partial step files, stop request, router address and
    tail sentinels (the step in flight runs again from its beginning, unflipped), and say where to begin.
    ``overrides``: the resume's command line; a group whose replicas it sets leaves the scaled counts
    (``scale.json``), the others keep theirs (without it: the groups whose counts differ from the stored)."""
    cancel_leftovers(rd, epoch)
    first = rd.first_unfinished_step()
    removed = [str(p.relative_to(rd.root)) for p in rd.clear_steps_from(first)]
    rd.stop_request.unlink(missing_ok=True)
    rd.router_address.unlink(missing_ok=True)  # components must not follow the old router
    for sentinel in rd.all_sentinels():
        sentinel.unlink()
    if overrides is not None:
        keys = [o.key_or_group.split(".") for o in OverridesParser.create().parse_overrides(overrides)]
        named = {k[1] for k in keys if len(k) == 3 and k[0] == "groups" and k[2] == "replicas"}
    else:
        stored = load_run_config(rd.root)
        named = {g for g in cfg.groups if g in stored.groups and stored.groups[g].replicas != cfg.groups[g].replicas}
    scaled = read_json(rd.scale_request)
    if named and isinstance(scaled, dict) and isinstance(scaled.get("groups"), dict):
        # Replica counts given on the resume's command line win over the last scale request, group by group.
        kept = {g: n for g, n in scaled["groups"].items() if g not in named}
        atomic_write(rd.scale_request, json.dumps({**scaled, "groups": kept}))
    if removed:
        logger.info("removed what the interrupted run left of step %d on: %s", first, removed)
    return ResumePoint(first, removed)


def cancel_leftovers(rd: RunDir, epoch: int) -> None:
    """The previous launch's components: the new epoch already tells them to exit; this makes sure
    (by pid, for processes on this machine; by ``scancel``, for the Slurm jobs it recorded)."""
    left = stop_processes(read_pidfiles(rd.pids), grace_s=5.0)
    if left:
        logger.warning("processes of the previous launch still alive: %s", [(r.pid, r.name) for r in left])
    rd.forget_pids()
    old_jobs = []
    files = [p for p in rd.all_jobs() if p != rd.jobs(epoch)]
    for p in files:
        old_jobs += [line.strip() for line in p.read_text().splitlines() if line.strip()]
    left_jobs: list[str] = []
    if old_jobs:
        scancel(old_jobs)
        left_jobs = wait_gone(old_jobs, timeout_s=90.0)
        if left_jobs:
            logger.warning("jobs of the previous launch still queued: %s", left_jobs)
    if not left_jobs:
        # Gone: their ids are forgotten, so no later resume cancels an id Slurm has given to another job.
        for p in files:
            p.unlink(missing_ok=True)
