"""The run directory's layout: one place that names every file the processes share."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from toolkit.core.errors import RouterUnavailable, RunDirInUse

logger = logging.getLogger(__name__)


def atomic_write(path: Path, data: bytes | str) -> None:
    """Write via a temp file in the same directory and rename, so readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = data.encode() if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class FileWriter:
    """Writes files from a thread of its own, each with :func:`atomic_write`, the latest content for a
    path replacing one not yet written. The router's loop hands it what it persists (weights, flip
    sentinels, timelines) and goes on: an fsync on a busy local disk or a shared file system can take
    seconds, and the loop forwards every request. ``pending`` and ``error`` tell the loop whether a
    path is on disk yet (an answer that promises it waits for it); ``flush`` waits for the writes
    handed in so far, ``close`` flushes and ends the thread."""

    def __init__(self, name: str = "file-writer") -> None:
        self._queue: dict[Path, bytes | str | None] = {}  # None: remove
        self._writing: Path | None = None
        self._errors: dict[Path, str] = {}
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def write(self, path: Path, data: bytes | str) -> None:
        self._put(path, data)

    def remove(self, path: Path) -> None:
        """Queue the removal of ``path`` (after the writes handed in before it)."""
        self._put(path, None)

    def pending(self, path: Path) -> bool:
        """Whether a write or removal of ``path`` handed in is not done yet."""
        with self._cond:
            return path in self._queue or self._writing == path

    def error(self, path: Path) -> str | None:
        """Why the last write of ``path`` failed, None if it succeeded (or is pending)."""
        with self._cond:
            return self._errors.get(path)

    def _put(self, path: Path, data: bytes | str | None) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("write after FileWriter.close")
            self._queue.pop(path, None)  # re-queued at the end: writes keep the order they were asked in
            self._queue[path] = data
            self._errors.pop(path, None)
            self._cond.notify_all()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every write handed in so far is done; False if ``timeout_s`` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and self._writing is None, timeout_s)

    def close(self, timeout_s: float | None = 30.0) -> None:
        if not self.flush(timeout_s):
            logger.error("%d file(s) not written within %ss: %s", len(self._queue), timeout_s,
                         ", ".join(str(p) for p in self._queue))
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                path = next(iter(self._queue))
                data = self._queue.pop(path)
                self._writing = path
            error = None
            try:
                if data is None:
                    path.unlink(missing_ok=True)
                else:
                    atomic_write(path, data)
            except Exception as e:
                logger.exception("writing %s failed", path)
                error = f"{type(e).__name__}: {e}"
            finally:
                with self._cond:
                    self._writing = None
                    if error is not None and path not in self._queue:
                        self._errors[path] = error
                    self._cond.notify_all()


def read_json(path: Path, retries: int = 5, delay_s: float = 0.05) -> Any | None:
    """Read a JSON file another process writes; None if absent. Retries a partial or stale read."""
    for attempt in range(retries):
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (json.JSONDecodeError, OSError):
            # A shared file system can serve a stale handle or a torn read: list the dir and retry.
            if attempt == retries - 1:
                raise
            try:
                os.listdir(path.parent)
            except OSError:
                pass
            time.sleep(delay_s)
    return None


@dataclass(frozen=True)
class RunDir:
    root: Path

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def overrides(self) -> Path:
        """The command line's overrides of the launch that made the run (YAML list), written once it took the
        run dir: Hydra's ``.hydra/overrides.yaml`` is rewritten by any launch into the dir, a refused one too."""
        return self.root / "overrides.yaml"

    def read_overrides(self) -> list[str] | None:
        """:attr:`overrides`, or Hydra's copy in a run made before it was kept (None: neither)."""
        for path in (self.overrides, self.root / ".hydra" / "overrides.yaml"):
            if path.exists():
                return [str(o) for o in yaml.safe_load(path.read_text()) or []]
        return None

    @property
    def router_address(self) -> Path:
        return self.root / "router.json"

    @property
    def router_weights(self) -> Path:
        """The latest weights the router handed out (path, version): a restarted router hands them on."""
        return self.root / "weights.json"

    @property
    def timelines(self) -> Path:
        """The router's per-step timelines, ``<job>.step_XXXXX.json`` (``toolkit.report.run_report`` draws them)."""
        return self.root / "timeline"

    def timeline(self, job: str, step: int) -> Path:
        return self.timelines / f"{job}.step_{step:05d}.json"

    @property
    def timeline_png(self) -> Path:
        """In-flight requests per group over each step, flips marked (drawn from the timelines)."""
        return self.root / "timeline.png"

    @property
    def router_stats(self) -> Path:
        """The router's counters (requeued, migrated, dispatched per group...), rewritten as it runs."""
        return self.root / "router_stats.json"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def submitit(self) -> Path:
        """submitit's folders, one per component: its jobs' scripts, pickles and raw outputs."""
        return self.logs / "submitit"

    def log(self, name: str) -> Path:
        """A component's own log (``router``, ``replica-<group>-<i>``, ``rank-<r>``...)."""
        return self.logs / f"{name}.log"

    def rank_logs(self) -> list[Path]:
        return sorted(self.logs.glob("rank-*.log"))

    @property
    def ranks_out(self) -> Path:
        """The MPI launcher's forwarded output of every rank."""
        return self.logs / "ranks.out"

    @property
    def pids(self) -> Path:
        return self.root / "pids"

    def pidfile(self, name: str, pid: int) -> Path:
        """A process the run started, as ``lifecycle.ProcessRef`` JSON: teardown and a resume stop it
        by pid (and start time), whatever started it."""
        return self.pids / f"{name}.{pid}.pid"

    def pidfile_names(self, prefix: str) -> set[str]:
        """Names of the recorded processes whose name starts with ``prefix``."""
        return {p.name.split(".")[0] for p in self.pids.glob(f"{prefix}*.pid")}

    def forget_pids(self) -> None:
        for p in self.pids.glob("*.pid"):
            p.unlink(missing_ok=True)

    @property
    def steps(self) -> Path:
        return self.root / "steps"

    @property
    def sentinels(self) -> Path:
        return self.root / "sentinels"

    @property
    def report(self) -> Path:
        return self.root / "report.json"

    @property
    def metrics(self) -> Path:
        """Each component's Prometheus endpoint (``<name>.json``: target and labels)."""
        return self.root / "metrics"

    @property
    def prometheus_targets(self) -> Path:
        """Every endpoint in Prometheus' ``file_sd`` format, written by launch."""
        return self.root / "prometheus_targets.json"

    @property
    def trackers(self) -> Path:
        """Experiment trackers' files (``report.trackers``: the W&B run, TensorBoard's event files)."""
        return self.root / "trackers"

    @property
    def trackers_logged(self) -> Path:
        """The last step each tracker logged (a resumed run logs the steps its previous launch missed)."""
        return self.trackers / "logged.json"

    @property
    def lease(self) -> Path:
        """The launch's lease (``toolkit/core/lease.py``): components exit when it is no longer renewed."""
        return self.root / "lease.json"

    @property
    def lease_claims(self) -> Path:
        """One empty file per epoch a launch claimed (created exclusively, the epoch after the lease it
        read): two launches taking the run at once never get the same epoch, a launch whose read went
        stale is refused, and the highest claim is the run's holder."""
        return self.root / "lease.d"

    def lease_claim(self, epoch: int) -> Path:
        return self.lease_claims / f"epoch-{epoch:06d}"

    @property
    def events(self) -> Path:
        """The run's interruptions (resumes, requeues, replicas added, removed, preempted), one JSON
        object per line, written by launch alone."""
        return self.root / "events.jsonl"

    @property
    def stop_request(self) -> Path:
        """Present when launch asks the ranks to begin no further step (a signal before the time limit)."""
        return self.root / "stop.json"

    @property
    def scale_request(self) -> Path:
        """Replica counts asked for by ``python -m toolkit.launch.scale`` (launch applies them)."""
        return self.root / "scale.json"

    @property
    def scale_state(self) -> Path:
        """What launch has applied: per group, the target and the replicas running, starting, draining."""
        return self.root / "scale_state.json"

    def node_master(self, name: str, key: str) -> Path:
        """Where node rank 0 of multi-node replica ``name`` writes the address its other node ranks reach
        it at; ``key`` names the job (step) they share, so a replacement never reads its predecessor's."""
        return self.root / "replicas" / f"{name}.{key}.master.json"

    def replica_stopped(self, name: str) -> Path:
        """Written by node 0 of replica ``name`` when it stopped after a drain: the other nodes of a
        multi-node replica, which only hold their node, then exit too."""
        return self.root / "replicas" / f"{name}.stopped"

    @property
    def jobs_dir(self) -> Path:
        return self.root / "jobs"

    def jobs(self, epoch: int) -> Path:
        """Slurm job ids the launch of ``epoch`` submitted, one per line (a resume cancels leftovers)."""
        return self.jobs_dir / f"epoch-{epoch:04d}.txt"

    def all_jobs(self) -> list[Path]:
        """The Slurm job id files of every launch, oldest epoch first."""
        return sorted(self.jobs_dir.glob("epoch-*.txt"))

    def step_parquet(self, step: int) -> Path:
        return self.steps / f"step_{step:05d}.parquet"

    def step_report(self, step: int) -> Path:
        return self.steps / f"step_{step:05d}.json"

    def step_shards(self, step: int) -> Path:
        """``rollout.output=shards``: the step's per-rank files and manifest."""
        return self.steps / f"step_{step:05d}"

    def step_shard(self, step: int, rank: int) -> Path:
        return self.step_shards(step) / f"shard_{rank:05d}.parquet"

    def step_manifest(self, step: int) -> Path:
        return self.step_shards(step) / "manifest.json"

    @property
    def keys(self) -> Path:
        """The run's CURVE certificates and the gateway's token (``toolkit/core/security.py``)."""
        return self.root / "keys"

    @property
    def cache(self) -> Path:
        """Compile caches (vLLM, torch, Triton) when ``cluster.cache_dir`` names none."""
        return self.root / "cache"

    def first_unfinished_step(self) -> int:
        """The first step without a step report: the report is written last, so every step before it
        is complete and nothing of it or after it is."""
        step = 0
        while self.step_report(step).exists():
            step += 1
        return step

    def clear_steps_from(self, step: int) -> list[Path]:
        """Remove what an interrupted run left of ``step`` and later steps; returns what was removed."""
        removed = []
        for p in sorted(self.steps.glob("step_*")):
            num = p.name[5:].split(".")[0].split("_")[0]  # step_00012.json, step_00012/, step_123456.parquet
            if num.isdigit() and int(num) >= step:
                if p.is_dir():
                    shutil.rmtree(p)
                else:
                    p.unlink()
                removed.append(p)
        return removed

    def append_event(self, kind: str, **fields: object) -> dict[str, object]:
        """Record an interruption; launch is the only writer."""
        event = {"t": time.time(), "kind": kind, **fields}
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.events, "a") as f:
            f.write(json.dumps(event) + "\n")
        return event

    def read_events(self) -> list[dict[str, object]]:
        try:
            lines = self.events.read_text().splitlines()
        except FileNotFoundError:
            return []
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue  # a line cut by a crash mid-write
        return out

    def gateway_address(self, rank: int) -> Path:
        """Where rank ``rank`` advertises its HTTP gateway (agents over HTTP): ``{"url", "rank", "pid"}``."""
        return self.root / "gateways" / f"rank-{rank:05d}.json"

    def sentinel(self, job: str) -> Path:
        """The tail-flip sentinel of a job: present once the job's current step has flipped."""
        return self.sentinels / f"{job}.flip.json"

    def all_sentinels(self) -> list[Path]:
        """Every job's tail-flip sentinel."""
        return sorted(self.sentinels.glob("*.flip.json"))

    def holds_run(self) -> list[Path]:
        """What marks this directory as another run's (its config, address, steps...)."""
        return [p for p in (self.config, self.router_address, self.report, self.pids, self.steps, self.lease)
                if p.exists()]

    def ensure_unused(self) -> None:
        """Refuse a directory another run has used (unless resuming it): its router address would mislead
        the new run's components, and its step files would be overwritten or mixed with the new ones."""
        found = self.holds_run()
        if found:
            names = ", ".join(str(p.relative_to(self.root)) for p in found)
            raise RunDirInUse(f"run dir {self.root} already holds a run ({names}): pass resume=true to continue "
                              "it, a new hydra.run.dir, or remove that directory to run there again")

    def make(self) -> None:
        for d in (self.root, self.logs, self.pids, self.steps, self.sentinels):
            d.mkdir(parents=True, exist_ok=True)

    def poll_router_address(self, deadline: float, not_frontend: str | None = None,
                            check: Callable[[], None] | None = None) -> dict[str, str] | None:
        """The router's address once it is written (and differs from ``not_frontend``, the address of
        a router that died), or None at ``deadline`` (``time.monotonic()``); ``check`` runs between
        reads and may raise."""
        while True:
            info = read_json(self.router_address)
            if info and info.get("frontend") != not_frontend:
                return info
            if check is not None:
                check()
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)

    def wait_router_address(self, timeout_s: float) -> dict[str, str]:
        info = self.poll_router_address(time.monotonic() + timeout_s)
        if info is None:
            raise RouterUnavailable(f"no router address in {self.router_address} after {timeout_s:.0f}s")
        return info

    async def await_router_address(self, timeout_s: float) -> dict[str, str]:
        """:meth:`wait_router_address` for a task: each read in a thread of its own (a shared file system's
        can block), the waits on the loop, so that the task stops at once when it is cancelled (one thread
        polling for minutes would hold its process's exit until it gave up)."""
        deadline = time.monotonic() + timeout_s
        while not (info := await asyncio.to_thread(read_json, self.router_address)):
            if time.monotonic() > deadline:
                raise RouterUnavailable(f"no router address in {self.router_address} after {timeout_s:.0f}s")
            await asyncio.sleep(0.05)
        return info
