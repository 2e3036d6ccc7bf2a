"""One run: start the router, the replicas and the ranks, watch them, and always tear down.

``Run`` owns every component it starts; leaving its ``with`` block (normal end, Ctrl-C, an
exception, a failed component) cancels all of them and then stops, by pid, any process of the run
that is still alive.
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from rich.console import Console

from toolkit.client import ready_counts, router_status
from toolkit.cluster import Cluster, Component, exit_story, make_cluster, tail_lines
from toolkit.config import ENGINES, Config, curve_enabled, group_engine
from toolkit.core.errors import ComponentFailed, Interrupted, ReadinessTimeout
from toolkit.core.lease import Lease
from toolkit.core.lifecycle import ProcessRef
from toolkit.core.metrics import write_targets
from toolkit.core.rundir import RunDir, atomic_write, read_json
from toolkit.core.security import ClientCurve, client_curve, generate_keys
from toolkit.launch.progress import Progress
from toolkit.launch.replicas import ReplicaSet
from toolkit.report.trackers import Trackers

logger = logging.getLogger(__name__)


class StopSignal:
    """SIGUSR1, noted by its handler (a flag and a time, no I/O in a signal handler); the run's loops
    act on it. Installed once, as early as launch can, and kept: its default action ends the process."""

    def __init__(self) -> None:
        self.signum = 0
        self.at = 0.0

    def install(self) -> None:
        signal.signal(signal.SIGUSR1, self._handler)

    def _handler(self, signum: int, frame: object) -> None:
        if not self.signum:
            self.signum, self.at = signum, time.monotonic()


STOP = StopSignal()


class Run:
    def __init__(self, cfg: Config, run_dir: RunDir, console: Console | None = None,
                 lease: Lease | None = None) -> None:
        self.cfg = cfg
        self.lease = lease
        self.run_dir = run_dir
        self.console = console or Console(stderr=False)
        self.owner = ProcessRef.self("launch")
        self.cluster: Cluster = make_cluster(cfg, run_dir, self.owner)
        self.router: Component | None = None
        self.replicas = ReplicaSet(cfg, self.cluster, run_dir)
        self.ranks: Component | None = None
        self.address: dict[str, str] = {}
        self.step_reports: list[dict[str, Any]] = []
        self.router_restarts = 0
        self.t_start = time.time()
        self.t_ready = 0.0
        self.curve: ClientCurve | None = None
        self._status_at = 0.0
        self.trackers: Trackers | None = None
        self.progress = Progress(self.console, cfg.job, cfg.steps, cfg.report.log_interval_s)
        self.next_step = 0
        self.stop_reason = ""
        """Why launch asked the ranks to begin no further step (a signal before the time limit)."""
        self.stop_deadline: float | None = None
        """``time.monotonic()`` by which the step in flight must end, or it is abandoned."""

    def __enter__(self) -> Run:
        STOP.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    # ---- start -----------------------------------------------------------------------------
    def start(self) -> None:
        cfg = self.cfg
        if curve_enabled(cfg):
            generate_keys(self.run_dir.root)  # before the router: it loads them at start
        self.curve = client_curve(self.run_dir.root)
        self.router = self.cluster.start_router()
        deadline = time.monotonic() + cfg.cluster.ready_timeout_s
        info = self.run_dir.poll_router_address(deadline, check=self._check_router)
        if info is None:
            raise ReadinessTimeout(f"router wrote no address in {cfg.cluster.ready_timeout_s:.0f}s; "
                                   f"state {self.router.state()}")
        self.address = info
        self.replicas.start()
        self.wait_ready(deadline)
        self.t_ready = time.time()

    def wait_ready(self, deadline: float) -> None:
        want = {g: self.replicas.count(g) for g in self.cfg.groups}
        have: dict[str, int] = {}
        while True:
            self._check_stop(starting=True)
            self._check_router()
            for line in self.replicas.retry_failed_boots():
                self.console.print(f"[yellow]{line}[/yellow]", highlight=False, soft_wrap=True)
                # A try boots from scratch: it gets the whole of ready_timeout_s, as the first did.
                deadline = max(deadline, time.monotonic() + self.cfg.cluster.ready_timeout_s)
            status = router_status(self.address["frontend"], timeout_s=1.0, curve=self.curve)
            if status is not None:
                have = ready_counts(status, want)
                if all(have[g] >= n for g, n in want.items()):
                    return
            if time.monotonic() > deadline:
                lines = [f"{g}: {have.get(g, 0)}/{n} ready" for g, n in want.items()]
                # Name the jobs that are stuck (pending, configuring...) and in which state: on a
                # cluster that is usually the whole story (no GPUs free, a bad partition...).
                comps = [self.router, *self.replicas.members.values()]
                states = [f"{c.name}: {c.state()}" + ("" if c.state().startswith("RUNNING") else "  <- stuck")
                          for c in comps]
                raise ReadinessTimeout(f"replicas not ready in {self.cfg.cluster.ready_timeout_s:.0f}s: "
                                       + ", ".join(lines) + "\n  " + "\n  ".join(states))
            time.sleep(0.1)

    def _check_router(self) -> None:
        assert self.router is not None
        self._check_alive(self.router, self.run_dir.log("router"))

    def _check_alive(self, comp: Component, log: Path) -> None:
        if not comp.alive():
            raise ComponentFailed(exit_story(comp, log))

    # ---- steps -----------------------------------------------------------------------------
    def load_previous(self, first_step: int) -> None:
        """A resumed run's report covers the whole run: the steps done before the interruption too. Its
        trackers get those its previous launches did not log (even when every step is done: a launch may
        end between the last step's report and its next look at them)."""
        for step in range(first_step):
            rep = read_json(self.run_dir.step_report(step))
            if rep is not None:
                self.step_reports.append(rep)
        self.next_step = first_step
        cfg = self.cfg
        if cfg.report.trackers:
            config = OmegaConf.to_container(OmegaConf.load(self.run_dir.config))
            self.trackers = Trackers(list(cfg.report.trackers), self.run_dir, config,  # type: ignore[arg-type]
                                     {"wandb_project": cfg.report.wandb_project, "wandb_mode": cfg.report.wandb_mode})
            self.trackers.catch_up(self.step_reports)

    def execute(self, first_step: int = 0) -> dict[str, Any]:
        cfg = self.cfg
        self.load_previous(first_step)
        self.ranks = self.cluster.start_ranks(cfg.ranks, first_step)
        ranks_deadline = time.monotonic() + cfg.cluster.ready_timeout_s
        init_deadline: float | None = None  # counted from when they run: a queue wait is not MPI_Init's
        retried = False
        while True:
            pending = self.ranks.pending()
            # Only until they first run: ranks Slurm requeued (preemption) wait for their resources again.
            if pending and init_deadline is None and time.monotonic() > ranks_deadline:
                raise ReadinessTimeout(f"the rollout ranks did not start in {cfg.cluster.ready_timeout_s:.0f}s: "
                                       f"ranks: {self.ranks.state()}  <- stuck")
            if init_deadline is None and not pending:
                init_deadline = time.monotonic() + cfg.cluster.ready_timeout_s
            if retried and init_deadline is not None and self.ranks.exit_code() is None and \
                    self._ranks_stuck_in_init(init_deadline):  # (ranks that failed say why below)
                raise ReadinessTimeout(f"the rollout ranks did not get through MPI_Init in "
                                       f"{cfg.cluster.ready_timeout_s:.0f}s, started twice: ranks: "
                                       f"{self.ranks.state()}  <- stuck; {self._ranks_failure()}")
            if not retried and init_deadline is not None and self._ranks_stuck_in_init(init_deadline):
                # Once: MPI's wire-up of a fresh world can fail or hang where a stale one was killed
                # (seen after an sbatch requeue, whose steps reuse the previous incarnation's ids).
                logger.warning("the ranks did not get through MPI_Init (%s); starting them again", self.ranks.state())
                self.console.print("[yellow]the ranks did not get through MPI_Init; starting them again[/yellow]")
                retried = True
                if not self.ranks.stop(30.0):
                    raise ComponentFailed(f"the ranks did not get through MPI_Init and could not be stopped "
                                          f"({self.ranks.state()}): starting them again would run a second "
                                          f"set beside them")
                self.ranks = self.cluster.start_ranks(cfg.ranks, first_step)
                ranks_deadline = time.monotonic() + cfg.cluster.ready_timeout_s
                init_deadline = None
                continue
            while self.next_step < cfg.steps and (rep := read_json(self.run_dir.step_report(self.next_step))):
                self.step_reports.append(rep)
                self.progress.step_done(self.next_step)
                self.console.print(progress_line(rep, cfg.steps), soft_wrap=True)
                if self.trackers is not None:
                    self.trackers.log(rep)
                self.next_step += 1
            code = self.ranks.exit_code()
            if code is not None:
                if code != 0 and (why := self.ranks.interrupted()):
                    raise Interrupted(f"{why}; step {self.next_step} runs again from its beginning on resume")
                if code != 0:
                    self._check_lease(now=True)  # they ended because a newer launch took the run: say that
                    raise ComponentFailed(f"rollout ranks exited with {code}; {self._ranks_failure()}")
                if self.next_step < cfg.steps and read_json(self.run_dir.step_report(self.next_step)) is None:
                    if self.stop_reason:
                        raise Interrupted(f"{self.stop_reason}: stopped before step {self.next_step} of {cfg.steps}")
                    raise ComponentFailed(f"ranks exited 0 but step {self.next_step} has no report")
                if self.next_step >= cfg.steps:
                    break
                continue
            self._check_stop()
            self._keep_router()
            self._watch_replicas()
            time.sleep(0.1)
        return self.summary()

    def _ranks_stuck_in_init(self, deadline: float) -> bool:
        """The ranks failed, or are still running past ``deadline``, before every one of them got through
        MPI_Init (each writes its pid file right after)."""
        assert self.ranks is not None
        if self.ranks.pending():
            return False
        up = self.run_dir.pidfile_names("rank-")
        if len(up) >= self.cfg.ranks:
            return False
        code = self.ranks.exit_code()
        return (code is not None and code != 0) or time.monotonic() > deadline

    def _check_stop(self, starting: bool = False) -> None:
        """Act on SIGUSR1 (Slurm sends it ``cluster.signal_grace_s`` before the time limit): no further
        step begins; the step in flight ends if it can before the deadline, which leaves time to tear
        down; past it, it is abandoned. Also: a launch that lost its lease stops at once."""
        self._check_lease()
        if STOP.signum and not self.stop_reason:
            grace = self.cfg.cluster.signal_grace_s
            margin = max(10.0, min(60.0, grace / 3))
            name = signal.Signals(STOP.signum).name
            self.stop_reason = f"{name} with {grace}s of grace"
            self.stop_deadline = STOP.at + max(0.0, grace - margin)
            try:
                atomic_write(self.run_dir.stop_request, json.dumps({"signal": name, "t": time.time()}))
                self.run_dir.append_event("signal", signal=name, step=self.next_step, grace_s=grace,
                                          finish_by_s=round(max(0.0, grace - margin), 1))
            except OSError as exc:  # the ranks then run on until the deadline abandons the step
                logger.error("could not write the stop request: %s", exc)
            logger.warning("%s: finishing step %d within %.0fs, then stopping", self.stop_reason, self.next_step,
                           grace - margin)
            self.console.print(f"[yellow]{self.stop_reason}: finishing step {self.next_step + 1} if it ends within "
                               f"{max(0.0, grace - margin):.0f}s, then stopping for a resume[/yellow]")
        if self.stop_reason and starting:
            raise Interrupted(f"{self.stop_reason}: stopped before step {self.next_step} began")
        if self.stop_deadline is not None and time.monotonic() > self.stop_deadline:
            raise Interrupted(f"{self.stop_reason}: step {self.next_step} did not end within the grace; "
                              "abandoned (it runs again from its beginning on resume)")

    def _check_lease(self, now: bool = False) -> None:
        """``now``: look at the lease at once, not only at what the renewing thread last saw."""
        if now and self.lease is not None:
            self.lease.taken_over()
        if self.superseded:
            raise ComponentFailed(f"this launch lost the run's lease: {self.superseded}")

    def _ranks_failure(self) -> str:
        """What the failing rank said: its own log holds the error, written before it aborted (the
        launcher's forwarded output can lag behind the exit, or end before the message)."""
        for log in self.run_dir.rank_logs():
            lines = log.read_text(errors="replace").splitlines()
            start = next((i for i in range(len(lines) - 1, -1, -1)
                          if " ERROR " in lines[i] and f"{log.stem.replace('-', ' ')} failed" in lines[i]), None)
            if start is not None:
                return f"{log}:\n" + "\n".join(lines[start:start + 25])
        out = self.run_dir.ranks_out
        return f"last lines of {out}:\n{tail_lines(out)}"

    def _keep_router(self) -> None:
        assert self.router is not None
        if self.router.alive():
            return
        if not self.cfg.cluster.restart_router:
            self._check_alive(self.router, self.run_dir.log("router"))
        logger.warning("router exited (%s); starting a new one", self.router.state())
        self.console.print(f"[yellow]router exited ({self.router.state()}); restarting it[/yellow]")
        self.router_restarts += 1
        old = self.address.get("frontend")
        self.router = self.cluster.start_router()
        deadline = time.monotonic() + self.cfg.cluster.ready_timeout_s
        info = self.run_dir.poll_router_address(deadline, not_frontend=old, check=self._check_router)
        if info is None:
            raise ReadinessTimeout("the restarted router wrote no new address")
        self.address = info

    def _follow_router(self) -> None:
        """A router that did not answer may have moved: one Slurm requeued itself (preemption) comes
        back on new ports, maybe on another node, and writes its new address; launch did not start it,
        so only the file says so."""
        try:
            info = read_json(self.run_dir.router_address)
        except (OSError, ValueError) as exc:  # a shared file system's hiccup: the next second looks again
            logger.warning("could not read %s: %s", self.run_dir.router_address, exc)
            return
        if info and info.get("frontend") and info["frontend"] != self.address.get("frontend"):
            logger.warning("the router moved to %s (it was at %s)", info["frontend"], self.address.get("frontend"))
            self.address = info

    def _watch_replicas(self) -> None:
        """Scale requests, replacements, drains, preemptions; the router's counts (and the live progress)
        every second."""
        now = time.monotonic()
        status = None
        if now - self._status_at >= 1.0:
            self._status_at = now
            status = router_status(self.address["frontend"], timeout_s=1.0, curve=self.curve)
            if status is None:
                self._follow_router()
        self.replicas.tick(self.address["frontend"], self.curve, status)
        self.progress.update(status, self.replicas.restarts)
        if status is not None and self.cfg.report.metrics:
            try:
                write_targets(self.run_dir)  # endpoints come and go with restarted components
            except OSError as exc:  # a shared file system's hiccup: the next second tries again
                logger.warning("could not write %s: %s", self.run_dir.prometheus_targets, exc)

    def summary(self) -> dict[str, Any]:
        reps = self.step_reports
        events = Counter(str(e.get("kind")) for e in self.run_dir.read_events())
        wall = [r["wall_s"] for r in reps]
        tokens = sum(r["generated_tokens"] for r in reps)
        failures: Counter[str] = Counter()
        sessions: Counter[str] = Counter()
        for r in reps:
            failures.update({k: v for k, v in r["requests_by_status"].items() if k != "ok"})
            sessions.update(r.get("sessions_by_status", {}))
        return {
            "steps": len(reps),
            "sessions": sum(r["sessions"] for r in reps),
            "startup_s": self.t_ready - self.t_start if self.t_ready else None,
            "step_wall_s_mean": sum(wall) / len(wall) if wall else None,
            "generated_tokens": tokens,
            "tokens_per_s": tokens / sum(wall) if wall and sum(wall) > 0 else None,
            "failed_requests": dict(failures),
            "sessions_by_status": dict(sessions),
            # From the run's events: every launch of a resumed run counted.
            "replica_restarts": events["replica_restarted"],
            "replicas_added": events["replica_added"],
            "replicas_removed": events["replica_removed"],
            "replicas_preempted": events["replica_preempted"],
            "resumes": events["resume"],
            "router_restarts": self.router_restarts,
        }

    @property
    def superseded(self) -> str:
        """Why another launch holds the run now ("" while this one does)."""
        return self.lease.lost if self.lease is not None else ""

    def write_report(self, summary: dict[str, Any] | None, error: str | None = None,
                     status: str | None = None) -> None:
        """``status``: ok, failed, or interrupted (a signal or a stop: ``resume=true`` continues it).
        Not written by a launch another one superseded: ``report.json`` is the newer launch's."""
        if self.superseded:
            logger.error("not writing %s (%s): %s", self.run_dir.report, self.superseded, error)
            return
        report = {
            "run_dir": str(self.run_dir.root),
            "status": status or ("ok" if error is None else "failed"),
            "error": error,
            "wall_s": time.time() - self.t_start,
            "summary": summary,
            "router": read_json(self.run_dir.router_stats),
            "interruptions": self.run_dir.read_events(),
            "steps": self.step_reports,
        }
        atomic_write(self.run_dir.report, json.dumps(report, indent=1))

    # ---- teardown --------------------------------------------------------------------------
    def teardown(self) -> None:
        self.stop_components()
        # After the components: a tracker's upload (wandb.finish) may take its time; the GPUs are free.
        if self.trackers is not None:
            self.trackers.close()
            self.trackers = None

    def stop_components(self) -> None:
        with contextlib.suppress(OSError):  # a display on a terminal that hung up: the teardown goes on
            self.progress.close()
        # Each backend's own time to close (vLLM's shutdown waits on its workers), then stop by pid.
        grace = max(ENGINES.impl(group_engine(self.cfg, g).type).shutdown_s for g in self.cfg.groups)
        # A launch that lost its lease stops only what it started itself: the pid files are the newer
        # launch's now.
        survivors = self.cluster.stop_all(grace, sweep=not self.superseded)
        if survivors:
            logger.error("processes still alive after teardown: %s", [(r.pid, r.name) for r in survivors])


def progress_line(rep: dict[str, Any], steps: int) -> str:
    st = rep["sessions_by_status"]
    parts = [
        f"[bold]step {rep['step'] + 1}/{steps}[/bold]",
        f"{rep['sessions']} sessions ({st.get('completed', 0)} completed)",
        f"{rep['wall_s']:.2f}s" + (f" ({rep['bound_ratio']:.2f}x its bound)" if rep.get("bound_ratio") else ""),
        f"{(rep['tokens_per_s'] or 0):,.0f} tok/s",
    ]
    if rep.get("reward_mean") is not None:
        parts.append(f"reward {rep['reward_mean']:.3f}")
    if rep.get("prefix_hit_rate") is not None:
        parts.append(f"prefix hit {100 * rep['prefix_hit_rate']:.1f}%")
    if rep.get("close") == "count":
        # What it carried in and on, what it left out, and how far behind its sessions' oldest weights were.
        worst = max((int(k) for k in rep.get("staleness") or {}), default=0)
        parts.append(f"carried in {rep['carried_in']}, on {rep['carried_out']}, staleness <= {worst}"
                     + (f", dropped stale {rep['dropped_stale']}" if rep.get("dropped_stale") else "")
                     + (f", restarted {rep['restarted_stale']}" if rep.get("restarted_stale") else "")
                     + (f", filtered groups {rep['filtered_groups']}" if rep.get("filtered_groups") else "")
                     + (" [yellow](closed short)[/yellow]" if rep.get("closed_short") else ""))
    tail = rep.get("tail")
    if tail:
        # Moves to the tail group, and with trades the residents' moves back to the bulk.
        parts.append(f"{tail['policy']}: {tail['moves']} move{'' if tail['moves'] == 1 else 's'}"
                     + (f", {tail['started']} turns started on the tail group" if tail.get("started") else ""))
    flip = rep.get("flip")
    if flip and flip.get("count") is not None:
        parts.append(f"flip {flip['count']}/{rep['sessions']} at {flip['time_s']:.2f}s, "
                     f"spillover {flip['spillover']:.3f}")
    bad = {k: v for k, v in rep["requests_by_status"].items() if k != "ok"}
    if bad:
        parts.append(f"[red]failed requests {bad}[/red]")
    return " · ".join(parts)
