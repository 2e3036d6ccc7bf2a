"""The run's replicas as launch keeps them: started, replaced, scaled up and down, watched.

One object owns every replica component of a run. Each pass of launch's watch loop calls
:meth:`ReplicaSet.tick`, which

- applies the latest scale request (``python -m toolkit.launch.scale``: ``<run dir>/scale.json``): a group
  scaled up gets new replicas at the lowest free indices; a group scaled down has its highest-index
  replicas *drained*: the router gives them no new request, migrates (or lets finish) what they hold,
  then tells them to shut down, and their processes exit 0. The Drain is resent until the process is
  gone (a router that restarted meanwhile drains them again); past ``rollout.request_timeout_s`` a
  replica still draining is cancelled (the router then requeues what it held, so nothing is lost);
- before the run is first ready, starts a replica that ended again (``cluster.boot_retries``);
- replaces a replica that died (``cluster.restart_replicas``);
- notices a replica job that Slurm preempted and requeued (it comes back as itself);
- writes ``scale_state.json`` (what ``toolkit.launch.scale --wait`` waits for) and records every change in
  the run's events.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from toolkit.client import send_drain
from toolkit.cluster import Cluster, Component, exit_story
from toolkit.config import Config
from toolkit.core.errors import ComponentFailed
from toolkit.core.names import place
from toolkit.core.rundir import RunDir, atomic_write, read_json
from toolkit.core.security import ClientCurve

logger = logging.getLogger(__name__)

Key = tuple[str, int]
_RESEND_S = 2.0
# Slurm states of a replica job that was running and is now waiting to run again (preempted, requeued).
_BACK_IN_QUEUE = ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "PREEMPTED", "SUSPENDED")


@dataclass
class Draining:
    comp: Component
    since: float
    """``time.monotonic()`` when the drain began."""
    migrate: bool
    sent_at: float = 0.0


def read_scale_request(rd: RunDir) -> dict[str, Any] | None:
    raw = read_json(rd.scale_request)
    return raw if isinstance(raw, dict) else None


class ReplicaSet:
    def __init__(self, cfg: Config, cluster: Cluster, rd: RunDir) -> None:
        self.cfg = cfg
        self.cluster = cluster
        self.rd = rd
        self.members: dict[Key, Component] = {}
        self.draining: dict[Key, Draining] = {}
        self.targets = {g: c.replicas for g, c in cfg.groups.items()}
        self.applied_seq = 0
        self.error = ""
        """Why the last scale request could not be applied in full ("" if it was)."""
        self.restarts = 0
        """Replicas this launch replaced after they exited."""
        self.boot_failures: dict[Key, int] = {}
        """Per replica, the times it ended before the run was first ready."""
        self._ran: dict[Key, bool] = {}
        """Replicas whose job was seen running (a later PENDING/REQUEUED means it was preempted)."""
        self._written: dict[str, Any] = {}
        self._status: Any | None = None
        """The router's latest Status (its ready and draining counts)."""
        # A resumed run keeps the counts its last scale request asked for.
        req = read_scale_request(rd)
        if req is not None:
            self.targets.update({g: int(n) for g, n in req.get("groups", {}).items() if g in self.targets})
            self.applied_seq = int(req.get("seq", 0))

    # ---- start -----------------------------------------------------------------------------
    def start(self) -> None:
        for group, n in self.targets.items():
            n = self._capped(group, n)
            for i, comp in enumerate(self.cluster.start_group(group, n)):
                self.members[(group, i)] = comp

    def _capped(self, group: str, n: int) -> int:
        cap = self.cluster.max_replicas(group)
        if cap is not None and n > cap:
            self.error = (f"{group}: {n} replicas asked for, the allocation has room for {cap} "
                          "(re-render the sbatch script for more)")
            logger.warning("%s", self.error)
            return cap
        return n

    def count(self, group: str) -> int:
        return sum(1 for g, _ in self.members if g == group)

    # ---- every pass of the watch loop ------------------------------------------------------
    def tick(self, frontend: str, curve: ClientCurve | None, status: Any | None = None) -> None:
        self._apply_request()
        self._drain(frontend, curve)  # first: a replica that has left frees its slot for _fill
        self._fill()
        self._replace_dead()
        self._watch_preemption()
        if status is not None:
            self._status = status
        self._write_state()

    def _apply_request(self) -> None:
        req = read_scale_request(self.rd)
        if req is None or int(req.get("seq", 0)) <= self.applied_seq:
            return
        self.applied_seq = int(req["seq"])
        self.error = ""
        self._status = None  # ready counts from before this request would mislead a waiting scale()
        migrate = bool(req.get("migrate", True))
        for group, n in req.get("groups", {}).items():
            if group not in self.targets:
                self.error = f"unknown group {group!r}; groups: {sorted(self.targets)}"
                continue
            self.targets[group] = self._capped(group, int(n))
        for group, want in self.targets.items():
            have = sorted(i for g, i in self.members if g == group)
            for i in have[want:][::-1]:  # the highest indices leave first
                self._begin_drain((group, i), migrate)

    def _fill(self) -> None:
        """Start replicas up to each group's target, at the lowest free indices (also later, once a
        draining replica has left the allocation's slot a scale-up waits for)."""
        for group, want in self.targets.items():
            have = {i for g, i in self.members if g == group}
            if len(have) >= want:
                continue
            taken = have | {i for g, i in self.draining if g == group}
            # In an allocation only its planned slots exist; one still draining is not free yet.
            cap = self.cluster.max_replicas(group)
            free = (i for i in (range(cap) if cap is not None else itertools.count()) if i not in taken)
            for _ in range(want - len(have)):
                i = next(free, None)
                if i is None:
                    break
                self.members[(group, i)] = self.cluster.start_replica(group, i)
                self.rd.append_event("replica_added", group=group, index=i)
                logger.info("scale: started replica %s-%d", group, i)

    def _begin_drain(self, key: Key, migrate: bool) -> None:
        comp = self.members.pop(key)
        self.draining[key] = Draining(comp, time.monotonic(), migrate)
        self.rd.append_event("replica_draining", group=key[0], index=key[1], migrate=migrate)
        logger.info("scale: draining replica %s-%d (%s)", key[0], key[1], "migrate" if migrate else "finish")

    def _drain(self, frontend: str, curve: ClientCurve | None) -> None:
        now = time.monotonic()
        bound = self.cfg.rollout.request_timeout_s + 30.0
        resend: dict[bool, list[str]] = {}
        for key, d in list(self.draining.items()):
            if not d.comp.alive():
                del self.draining[key]
                self.rd.append_event("replica_removed", group=key[0], index=key[1], drain_s=round(now - d.since, 3),
                                     state=d.comp.state())
                continue
            if now - d.since > bound:
                logger.warning("replica %s-%d still draining after %.0fs; cancelling it", *key, now - d.since)
                d.comp.cancel()
                d.since = now  # cancel again only after another bound
                continue
            if now - d.sent_at >= _RESEND_S:
                d.sent_at = now
                resend.setdefault(d.migrate, []).append(place(*key))
        for migrate, names in resend.items():  # one Drain for all: the router sees the whole change at once
            send_drain(frontend, names, migrate, timeout_s=1.0, curve=curve)

    def retry_failed_boots(self) -> list[str]:
        """Before the run is first ready: each replica that ended is started again while its
        ``cluster.boot_retries`` last (why it ended, in the returned lines); past that the run fails
        (:class:`ComponentFailed`) with why."""
        said = []
        for key, comp in list(self.members.items()):
            if comp.alive():
                continue
            story = exit_story(comp, self.rd.log(comp.name))
            n = self.boot_failures[key] = self.boot_failures.get(key, 0) + 1
            retries = self.cfg.cluster.boot_retries
            if n > retries:
                raise ComponentFailed(story + (f"\n(it ended before it was ready {n} times; cluster.boot_retries={retries})"
                                               if n > 1 else ""))
            logger.warning("%s ended before it was ready (%d of cluster.boot_retries=%d); starting it again. %s",
                           comp.name, n, retries, story)
            self.rd.append_event("replica_boot_failed", group=key[0], index=key[1], state=comp.state(), attempt=n)
            said.append(f"{comp.name} exited before it was ready ({comp.state()}); starting it again "
                        f"({n} of cluster.boot_retries={retries}; why: {self.rd.log(comp.name)})")
            self.members[key] = self.cluster.start_replica(*key)
        return said

    def _replace_dead(self) -> None:
        for key, comp in list(self.members.items()):
            if comp.alive():
                continue
            if not self.cfg.cluster.restart_replicas:
                raise ComponentFailed(f"{comp.name} exited ({comp.state()}) and cluster.restart_replicas is off")
            logger.warning("%s exited (%s); starting a replacement (its output: %s)", comp.name, comp.state(),
                           ", ".join(map(str, comp.outputs())) or "none")
            self.rd.append_event("replica_restarted", group=key[0], index=key[1], state=comp.state())
            self.restarts += 1
            self.members[key] = self.cluster.start_replica(*key)

    def _watch_preemption(self) -> None:
        for key, comp in self.members.items():
            state = comp.state().split(" ")[0]
            if state == "RUNNING":
                self._ran[key] = True
            # Ran, and is back in the queue (seen through COMPLETING or not, at the poll's pace).
            elif state in _BACK_IN_QUEUE and self._ran.pop(key, False):
                self.rd.append_event("replica_preempted", group=key[0], index=key[1], state=comp.state())
                logger.warning("%s was preempted (%s); the step goes on with the other replicas", comp.name,
                               comp.state())

    def _write_state(self) -> None:
        groups = {}
        for g, target in self.targets.items():
            gs = self._status.groups.get(g) if self._status is not None else None
            groups[g] = {"target": target, "members": self.count(g),
                         "draining": sum(1 for k in self.draining if k[0] == g),
                         "ready": gs.ready if gs is not None else None}
        state = {"applied_seq": self.applied_seq, "groups": groups, "error": self.error}
        if state != self._written:  # a file on a shared file system: written when it changes
            self._written = state
            atomic_write(self.rd.scale_state, json.dumps({**state, "t": time.time()}))
