"""The fleet twin: a run of ``launch``'s config in virtual time, with no process, socket or sleep. The
router is the router's own object (pool, policies, fair queue, tail routing, migrations, membership);
the replicas are :class:`~toolkit.plan.engine.TwinEngine` s on the sim's step model; the ranks run the
rollout's own sessions and step closers. Each step yields the step report a real run writes."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import gc
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from hydra.utils import instantiate

from toolkit.config import Config, SimEngineConfig, WeightsTransport, group_engine, samples_per_prompt
from toolkit.core import clock
from toolkit.core.errors import ConfigError, FieldError
from toolkit.core.rundir import RunDir
from toolkit.engine.plans import plan_output
from toolkit.plan.engine import MovedPlans, Plan
from toolkit.plan.fleet import TwinClient, TwinReplica, Wire
from toolkit.plan.loop import VirtualLoop
from toolkit.rollout.close import CLOSERS, STEP_COUNTERS, Landed
from toolkit.rollout.guard import FailureBudgetExceeded, check_failure_budget, inline_call
from toolkit.rollout.sessions import EnvSessions, rank_cap
from toolkit.rollout.stepreport import closing_report, step_report
from toolkit.router.server import Router
from toolkit.session.columns import Columns, StatBuilder
from toolkit.session.requests import RequestLog
from toolkit.session.sample import Sample

EPOCH = 1.7e9
"""The twin's wall clock at its start (virtual seconds are added to it): fixed, so a twin repeats."""
SESSION_START_S = 2e-4
"""A rank's time to start one session (its environment, first prompt and sample; its first turn encoded
and sent). A rank starts one session at a time, so a step's first turns reach the router spread out:
here the real runs' first turns left each rank 0.13-0.18 ms apart (typically; 0.02-0.33 ms in all)."""


def twin_errors(cfg: Config) -> list[FieldError]:
    """What a twin cannot run of ``cfg``, each naming the setting (empty: it runs)."""
    errors = []
    for g in sorted(cfg.groups):
        e = group_engine(cfg, g)
        if not isinstance(e, SimEngineConfig):
            errors.append(FieldError(f"groups.{g} engine type", e.type, "sim: the twin runs the sim's step model "
                                     "(set engine=sim, the group's speed in its fields)"))
    if cfg.workload.agent:
        errors.append(FieldError("workload.agent", "set", "null: agents over HTTP run outside the toolkit; the twin "
                                 "runs environments (workload.env)"))
    if cfg.rollout.weights_dir is not None:
        errors.append(FieldError("rollout.weights_dir", cfg.rollout.weights_dir, "null: the twin models no weight "
                                 "updates"))
    if cfg.rollout.weights_transport == WeightsTransport.stream:
        errors.append(FieldError("rollout.weights_transport", "stream", "checkpoint (with no rollout.weights_dir): "
                                 "the twin models no weight updates"))
    return errors


@dataclasses.dataclass
class TwinRun:
    """What a twin run gave: the step reports, and the fleet's counters at its end."""

    steps: list[dict[str, Any]]
    sessions: list[dict[tuple[int, int], tuple[int, int]]]
    """Per step, each session that landed in it: ``(started step, index) -> (generated tokens, turns)``."""
    replicas: dict[str, dict[str, Any]]
    """Per replica: its group and its engine's counters (``ReplicaStats`` as a dict)."""
    router: dict[str, int]
    """The router's event counts (completed, requeued, moves by reason...)."""
    virtual_s: float
    real_s: float
    """Seconds of this machine's time the twin took."""
    stopped: str = ""
    """Why the run stopped before its last step, as a real run would (past ``rollout.max_failed_fraction``);
    "" if it ran them all."""


class _Rank:
    """One rollout rank: its closer, its sessions and its share of the concurrency cap."""

    def __init__(self, cfg: Config, rank: int, size: int, client: TwinClient, max_model_len: int,
                 start_s: float) -> None:
        self.client = client
        self.sem = asyncio.Semaphore(rank_cap(cfg, rank, size))
        self.start_s = start_s
        self._starting_until = 0.0
        """The loop's time at which the rank is done starting the sessions it has begun."""
        self.closer = CLOSERS[cfg.rollout.close](
            cfg, rank, size, samples_per_prompt(cfg), self._run, sorted(cfg.groups), RequestLog, 0,
            lambda step, sid: client.session_done(cfg.job, step, sid), StatBuilder)  # it writes no rows
        self.sessions = EnvSessions(cfg, client, instantiate(cfg.workload.prompts), max_model_len,
                                    lambda: self.closer.open, inline_call)

    async def _run(self, started: int, index: int, attempt: int) -> list[Sample]:
        async with self.sem:
            if self.start_s > 0:  # its turn to be started, after those begun before it
                loop = asyncio.get_running_loop()
                self._starting_until = max(loop.time(), self._starting_until) + self.start_s
                await asyncio.sleep(self._starting_until - loop.time())
            samples = await self.sessions.run(started, index, attempt)
        self.closer.open.log.sessions_done_at.append(clock.wall())
        return samples


def _concat(parts: list[Columns]) -> Columns:
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


class Twin:
    def __init__(self, cfg: Config, run_dir: Path | None = None, latency_s: float = 0.0,
                 events: Callable[[Twin], None] | None = None, plan: Plan = plan_output,
                 gaps: list[float] | None = None, session_start_s: float = SESSION_START_S) -> None:
        """``run_dir``: where the router keeps its files (a temporary directory by default); ``latency_s``:
        each message's delay; ``events``: called once the fleet is up, to schedule what happens to it
        (``loop.call_at``: a replica lost mid-step...); ``plan``: each request's tokens (the sim's, or a
        replay's); ``gaps``: seconds between a step's end and the next one's start (a replayed run's);
        ``session_start_s``: a rank's time to start a session (:data:`SESSION_START_S`)."""
        errors = twin_errors(cfg)
        if errors:
            raise ConfigError(errors)
        self.cfg = cfg
        self.run_dir = run_dir
        self.latency_s = latency_s
        self.events = events
        self.plan = MovedPlans(plan)
        """Shared by the engines: a request that moves is planned once."""
        self.gaps = gaps or []
        self.session_start_s = session_start_s
        self.loop = VirtualLoop()
        self.wire = Wire(self.loop, latency_s)
        self.replicas: list[TwinReplica] = []
        self.router: Router | None = None
        self.sessions: list[dict[tuple[int, int], tuple[int, int]]] = []
        self.stopped = ""

    def run(self) -> TwinRun:
        t = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="twin-") as tmp:
            rd = RunDir(self.run_dir or Path(tmp))
            rd.make()
            cfg = dataclasses.replace(self.cfg, report=dataclasses.replace(self.cfg.report, metrics=False))
            # The loop's time read as its attribute, in C (``loop.time`` is a Python call, at every clock read).
            with clock.virtual(functools.partial(getattr, self.loop, "now"), EPOCH), _quiet_gc():
                self.router = Router(cfg, rd, links=self.wire)
                self.wire.router = self.router
                try:
                    steps = self.loop.run(self._main(cfg))
                finally:
                    self.router.close()
                    self.loop.close()
        return TwinRun(steps, self.sessions, {r.replica_id: {"group": r.group, **_stats(r)} for r in self.replicas},
                       dict(self.router.events()), self.loop.now, time.perf_counter() - t, self.stopped)

    async def _main(self, cfg: Config) -> list[dict[str, Any]]:
        assert self.router is not None
        for g in sorted(cfg.groups):
            for i in range(cfg.groups[g].replicas):
                self.replicas.append(TwinReplica(cfg, g, i, group_engine(cfg, g), self.wire, self.plan))
        for r in self.replicas:
            r.start()
        self.wire.start_timers(cfg.router.heartbeat_s)
        max_model_len = min(group_engine(cfg, g).max_model_len for g in cfg.groups)
        ranks = [_Rank(cfg, k, cfg.ranks, TwinClient(k, self.wire), max_model_len, self.session_start_s)
                 for k in range(cfg.ranks)]
        if self.events is not None:
            self.events(self)
        reports = []
        try:
            for step in range(cfg.steps):
                if step and step - 1 < len(self.gaps):
                    await asyncio.sleep(self.gaps[step - 1])
                await ranks[0].client.step_begin(cfg.job, step, cfg.sessions_per_step)
                t0, active0 = clock.wall(), self._active()
                landed: list[Landed] = list(await asyncio.gather(*(r.closer.collect(step) for r in ranks)))
                report, cols = self._report(cfg, step, t0, landed)
                wall = report["wall_s"]
                report["fleet_busy_share"] = ((self._active() - active0) / (len(self.replicas) * wall)
                                              if wall > 0 else None)
                reports.append(report)
                try:  # as every rank of a real run does after writing the step
                    check_failure_budget(step, cols, cfg.rollout.max_failed_fraction)
                except FailureBudgetExceeded as exc:
                    self.stopped = str(exc)
                    break
        finally:
            for rank in ranks:
                await rank.closer.aclose()
        return reports

    def _report(self, cfg: Config, step: int, t0: float, landed: list[Landed]) -> tuple[dict[str, Any], Columns]:
        assert self.router is not None
        groups = sorted(cfg.groups)
        wall = clock.wall() - t0
        cols = _concat([x.builder.columns() for x in landed])
        started, index, generated, turns = (np.asarray(cols[k]).tolist() for k in
                                            ("started_step", "index", "generated_tokens", "num_turns"))
        self.sessions.append(dict(zip(zip(started, index, strict=True), zip(generated, turns, strict=True),
                                      strict=True)))
        requests = _concat([x.log.columns(groups) for x in landed])
        closing = {"counts": np.array([x.counts[k] for x in landed for k in STEP_COUNTERS], dtype=np.int64),
                   "in_flight": np.array([g for x in landed for g in x.in_flight], dtype=np.int64).reshape(-1)}
        st = self.router.tail.flip.steps.get(cfg.job)
        flip = ({"job": cfg.job, "step": step, "time": st.flipped_at, "count": st.flip_count}
                if st is not None and st.step == step and st.flipped_at is not None else None)
        report = step_report(step, wall, t0, cols, requests, groups, cfg, flip, self.router.status().groups)
        report.update(closing_report(closing, cfg.rollout.close))
        return report, cols

    def _active(self) -> float:
        """Seconds in which the replicas' engines had work, summed, so far."""
        return sum(r.engine.stats().active_s for r in self.replicas)


YOUNG_GC = 10_000_000
"""Container objects a twin allocates (net) between two collections."""


@contextlib.contextmanager
def _quiet_gc() -> Iterator[None]:
    """The collector out of the way while a twin runs, and back as it was after (so that a sweep's twins
    do not pile up in the frozen generation). A twin's objects (sessions, samples, caches, requests in
    flight) live to its end, and a collection's passes over them found next to nothing: 1,529 objects in
    cycles in a step of 16,384 sessions, for 6% of its time (young collections every 50,000 objects, and
    every tenth of them the older generation). So what existed before is frozen out of every collection,
    the young generation is collected only every :data:`YOUNG_GC` objects (a step of 65,536 sessions
    runs without one), and what survives a collection is frozen too; garbage in cycles waits at most
    that long. Nothing is collected first or after: a full collection of a process that
    imported the toolkit costs a short twin more than anything else it does once, and everything,
    the young generation included (a collection of its million objects once the old threshold is back
    cost 2% of a 16,384-session step), goes to the oldest generation, collected later as any garbage."""
    threshold = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(YOUNG_GC, *threshold[1:])
    gc.callbacks.append(_freeze_survivors)
    try:
        yield
    finally:
        gc.callbacks.remove(_freeze_survivors)
        gc.freeze()  # the young generation too: with the old threshold back, it would be collected at once
        gc.unfreeze()
        gc.set_threshold(*threshold)


def _freeze_survivors(phase: str, info: dict[str, int]) -> None:
    if phase == "stop" and info["generation"] == 0:
        gc.freeze()


def _stats(r: TwinReplica) -> dict[str, Any]:
    s = r.engine.stats()
    return {f: getattr(s, f) for f in s.__struct_fields__}
