"""One run: start the router, the replicas and the ranks, watch them, and always tear down.

``Run`` owns every component it starts; leaving its ``with`` block (normal end, Ctrl-C, an
exception, a failed component) cancels all of them and then stops, by pid, any process of the run
that is still alive.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from toolkit.client import ready_counts, router_status
from toolkit.cluster import Cluster, Component, make_cluster
from toolkit.config import Config
from toolkit.errors import ComponentFailed, ReadinessTimeout
from toolkit.lifecycle import ProcessRef
from toolkit.rundir import RunDir, atomic_write, read_json
from toolkit.security import ClientCurve, client_curve, curve_enabled, generate_keys

logger = logging.getLogger(__name__)


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class Run:
    def __init__(self, cfg: Config, run_dir: RunDir, console: Console | None = None) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.console = console or Console(stderr=False)
        self.owner = ProcessRef.self("launch")
        self.cluster: Cluster = make_cluster(cfg, run_dir, self.owner)
        self.router: Component | None = None
        self.replicas: dict[tuple[str, int], Component] = {}
        self.ranks: Component | None = None
        self.address: dict[str, str] = {}
        self.step_reports: list[dict[str, Any]] = []
        self.restarts = 0
        self.router_restarts = 0
        self.t_start = time.time()
        self.t_ready = 0.0
        self.curve: ClientCurve | None = None

    def __enter__(self) -> Run:
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
        for group in cfg.groups:
            for i, comp in enumerate(self.cluster.start_group(group)):
                self.replicas[(group, i)] = comp
        self.wait_ready(deadline)
        self.t_ready = time.time()

    def wait_ready(self, deadline: float) -> None:
        want = {g: c.replicas for g, c in self.cfg.groups.items()}
        have: dict[str, int] = {}
        while True:
            self._check_router()
            for (g, i), comp in self.replicas.items():
                self._check_alive(comp, self.run_dir.logs / f"replica-{g}-{i}.log")
            status = router_status(self.address["frontend"], timeout_s=1.0, curve=self.curve)
            if status is not None:
                have = ready_counts(status, want)
                if all(have[g] >= n for g, n in want.items()):
                    return
            if time.monotonic() > deadline:
                lines = [f"{g}: {have.get(g, 0)}/{n} ready" for g, n in want.items()]
                # Name the jobs that are stuck (pending, configuring...) and in which state: on a
                # cluster that is usually the whole story (no GPUs free, a bad partition...).
                comps = [self.router, *self.replicas.values()]
                states = [f"{c.name}: {c.state()}" + ("" if c.state().startswith("RUNNING") else "  <- stuck")
                          for c in comps]
                raise ReadinessTimeout(f"replicas not ready in {self.cfg.cluster.ready_timeout_s:.0f}s: "
                                       + ", ".join(lines) + "\n  " + "\n  ".join(states))
            time.sleep(0.1)

    def _check_router(self) -> None:
        assert self.router is not None
        self._check_alive(self.router, self.run_dir.logs / "router.log")

    def _check_alive(self, comp: Component, log: Path) -> None:
        if not comp.alive():
            raise ComponentFailed(f"{comp.name} exited ({comp.state()}); last lines of {log}:\n{_tail(log)}")

    # ---- steps -----------------------------------------------------------------------------
    def execute(self) -> dict[str, Any]:
        cfg = self.cfg
        self.ranks = self.cluster.start_ranks(cfg.ranks)
        ranks_deadline = time.monotonic() + cfg.cluster.ready_timeout_s
        next_step = 0
        while True:
            if self.ranks.pending() and time.monotonic() > ranks_deadline:
                raise ReadinessTimeout(f"the rollout ranks did not start in {cfg.cluster.ready_timeout_s:.0f}s: "
                                       f"ranks: {self.ranks.state()}  <- stuck")
            while next_step < cfg.steps and (rep := read_json(self.run_dir.step_report(next_step))):
                self.step_reports.append(rep)
                self.console.print(progress_line(rep, cfg.steps), soft_wrap=True)
                next_step += 1
            code = self.ranks.exit_code()
            if code is not None:
                if code != 0:
                    raise ComponentFailed(f"rollout ranks exited with {code}; {self._ranks_failure()}")
                if next_step < cfg.steps and read_json(self.run_dir.step_report(next_step)) is None:
                    raise ComponentFailed(f"ranks exited 0 but step {next_step} has no report")
                if next_step >= cfg.steps:
                    break
                continue
            self._keep_router()
            self._replace_dead_replicas()
            time.sleep(0.1)
        return self.summary()

    def _ranks_failure(self) -> str:
        """What the failing rank said: its own log holds the error, written before it aborted (the
        launcher's forwarded output can lag behind the exit, or end before the message)."""
        for log in sorted(self.run_dir.logs.glob("rank-*.log")):
            lines = log.read_text(errors="replace").splitlines()
            start = next((i for i in range(len(lines) - 1, -1, -1)
                          if " ERROR " in lines[i] and f"{log.stem.replace('-', ' ')} failed" in lines[i]), None)
            if start is not None:
                return f"{log}:\n" + "\n".join(lines[start:start + 25])
        out = self.run_dir.logs / "ranks.out"
        return f"last lines of {out}:\n{_tail(out)}"

    def _keep_router(self) -> None:
        assert self.router is not None
        if self.router.alive():
            return
        if not self.cfg.cluster.restart_router:
            self._check_alive(self.router, self.run_dir.logs / "router.log")
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

    def _replace_dead_replicas(self) -> None:
        for key, comp in list(self.replicas.items()):
            if comp.alive():
                continue
            if not self.cfg.cluster.restart_replicas:
                raise ComponentFailed(f"{comp.name} exited ({comp.state()}) and cluster.restart_replicas is off")
            logger.warning("%s exited (%s); starting a replacement", comp.name, comp.state())
            self.restarts += 1
            self.replicas[key] = self.cluster.start_replica(*key)

    def summary(self) -> dict[str, Any]:
        reps = self.step_reports
        wall = [r["wall_s"] for r in reps]
        tokens = sum(r["generated_tokens"] for r in reps)
        failures: dict[str, int] = {}
        for r in reps:
            for k, v in r["requests_by_status"].items():
                if k != "ok":
                    failures[k] = failures.get(k, 0) + v
        return {
            "steps": len(reps),
            "sessions": sum(r["sessions"] for r in reps),
            "startup_s": self.t_ready - self.t_start if self.t_ready else None,
            "step_wall_s_mean": sum(wall) / len(wall) if wall else None,
            "generated_tokens": tokens,
            "tokens_per_s": tokens / sum(wall) if wall and sum(wall) > 0 else None,
            "failed_requests": failures,
            "replica_restarts": self.restarts,
            "router_restarts": self.router_restarts,
        }

    def write_report(self, summary: dict[str, Any] | None, error: str | None = None) -> None:
        report = {
            "run_dir": str(self.run_dir.root),
            "status": "ok" if error is None else "failed",
            "error": error,
            "wall_s": time.time() - self.t_start,
            "summary": summary,
            "router": read_json(self.run_dir.root / "router_stats.json"),
            "steps": self.step_reports,
        }
        atomic_write(self.run_dir.report, json.dumps(report, indent=1))

    # ---- teardown --------------------------------------------------------------------------
    def teardown(self) -> None:
        survivors = self.cluster.stop_all()
        if survivors:
            logger.error("processes still alive after teardown: %s", [(r.pid, r.name) for r in survivors])


def progress_line(rep: dict[str, Any], steps: int) -> str:
    st = rep["sessions_by_status"]
    parts = [
        f"[bold]step {rep['step'] + 1}/{steps}[/bold]",
        f"{rep['sessions']} sessions ({st.get('completed', 0)} completed)",
        f"{rep['wall_s']:.2f}s",
        f"{(rep['tokens_per_s'] or 0):,.0f} tok/s",
    ]
    if rep.get("reward_mean") is not None:
        parts.append(f"reward {rep['reward_mean']:.3f}")
    if rep.get("prefix_hit_rate") is not None:
        parts.append(f"prefix hit {100 * rep['prefix_hit_rate']:.1f}%")
    flip = rep.get("flip")
    if flip and flip.get("count") is not None:
        parts.append(f"flip {flip['count']}/{rep['sessions']} at {flip['time_s']:.2f}s, "
                     f"spillover {flip['spillover']:.3f}")
    bad = {k: v for k, v in rep["requests_by_status"].items() if k != "ok"}
    if bad:
        parts.append(f"[red]failed requests {bad}[/red]")
    return " · ".join(parts)
