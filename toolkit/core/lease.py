"""The launch's lease on its run: components end when the launch that started them is gone.

``launch`` holds ``<run dir>/lease.json`` and renews it every ``cluster.lease_s / 6`` seconds. Every
component (router, replicas, ranks; local or on Slurm) watches it from its own clock: when the
renewal counter has not moved for ``cluster.lease_s``, or a newer launch took the run over (a new
*epoch*: a resume), or the launch released it, the component exits and its Slurm job ends. So a
SIGKILLed launch leaves no job holding GPUs past the lease.

Why a counter and not a timestamp: the nodes' clocks may disagree, a component's own monotonic clock
does not. The wall-clock ``renewed_at`` is only used where no watch has been running yet: a
component that starts after its launch died (a job that was pending) exits at once, and a new launch
decides whether the lease it finds is still held.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time
from dataclasses import asdict, dataclass

from toolkit.core.errors import RunDirInUse
from toolkit.core.lifecycle import ProcessRef
from toolkit.core.rundir import RunDir, atomic_write, read_json

logger = logging.getLogger(__name__)

EPOCH_ENV = "TOOLKIT_LEASE_EPOCH"
"""The epoch of the launch that started a component (inherited through the environment by every
backend: submitit's local and Slurm executors, srun, mpiexec)."""


def current_epoch() -> int:
    """The epoch of the launch this process belongs to (0 outside a leased run)."""
    return int(os.environ.get(EPOCH_ENV, "0") or 0)


@dataclass
class LeaseRecord:
    epoch: int
    """Incremented by every launch that takes the run (a resume is a new epoch)."""
    seq: int = 0
    """Renewal counter: components watch it move."""
    renewed_at: float = 0.0
    """Wall-clock time of the last renewal."""
    host: str = ""
    pid: int = 0
    start: int | None = None
    """The holder's kernel start time (a recycled pid is not the holder)."""
    slurm_job: str = ""
    """``SLURM_JOB_ID`` of the holder when it runs inside a job (an sbatch allocation)."""
    restart: int = 0
    """``SLURM_RESTART_COUNT`` of the holder: a requeued job's next incarnation takes over at once."""
    released: bool = False
    """Set when the holder ended: its components exit at once."""

    @classmethod
    def read(cls, rd: RunDir) -> LeaseRecord | None:
        try:
            raw = read_json(rd.lease)
        except (OSError, ValueError):
            return None
        if not isinstance(raw, dict):
            return None
        try:
            return cls(**{k: raw[k] for k in cls.__dataclass_fields__ if k in raw})
        except TypeError:
            return None


def previous_incarnation(rec: LeaseRecord) -> bool:
    """``rec``'s holder was this Slurm job before Slurm requeued it (a preemption, a node failure, submitit
    requeueing a hydra-submitit sweep point)."""
    job = os.environ.get("SLURM_JOB_ID", "")
    return bool(job) and rec.slurm_job == job and rec.restart < int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)


def holder_gone(rec: LeaseRecord, lease_s: float, now: float | None = None) -> str:
    """Why the lease ``rec`` no longer binds a new launch ("" while its holder may be alive)."""
    now = time.time() if now is None else now
    if rec.released:
        return "released"
    if previous_incarnation(rec):
        return f"a previous incarnation of Slurm job {rec.slurm_job}"
    if rec.host == socket.gethostname() and not ProcessRef(rec.pid, rec.start).alive():
        return f"its launch (pid {rec.pid}) is gone"
    if now - rec.renewed_at > lease_s:
        return f"not renewed for {now - rec.renewed_at:.0f}s (cluster.lease_s = {lease_s:g})"
    return ""


class Lease:
    """The launch's side: take the run (a new epoch), renew in a thread, release at the end."""

    def __init__(self, rd: RunDir, lease_s: float) -> None:
        self.rd = rd
        self.lease_s = lease_s
        self.record: LeaseRecord | None = None
        self.lost = ""
        """Set (why) when another launch took the run over: this launch must stop at once."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> int:
        """Take the run dir's lease, or raise RunDirInUse if another live launch holds it or takes it
        at the same moment (each epoch is claimed once, exclusively; ``RunDir.lease_claims``)."""
        old = LeaseRecord.read(self.rd)
        if old is not None:
            why = holder_gone(old, self.lease_s)
            if not why:
                raise RunDirInUse(
                    f"run dir {self.rd.root} is held by a running launch (pid {old.pid} on {old.host}, renewed "
                    f"{time.time() - old.renewed_at:.0f}s ago): stop it first, or wait cluster.lease_s = "
                    f"{self.lease_s:g}s after it died")
            logger.info("taking over the run from epoch %d (%s)", old.epoch, why)
        # The epoch after the one just read, claimed exclusively: a launch whose read went stale (another
        # took the run meanwhile) finds that claim taken and is refused, never skips past it.
        epoch = (old.epoch if old is not None else self._highest_claim()) + 1
        self.rd.lease_claims.mkdir(exist_ok=True)
        while True:
            try:
                os.close(os.open(self.rd.lease_claim(epoch), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
                break
            except FileExistsError:
                if not self._abandoned(epoch):
                    raise self._outrun(epoch) from None
                epoch += 1
        me = ProcessRef.self()
        self.record = LeaseRecord(
            epoch=epoch, renewed_at=time.time(), host=socket.gethostname(),
            pid=me.pid, start=me.start, slurm_job=os.environ.get("SLURM_JOB_ID", ""),
            restart=int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0))
        if self._highest_claim() == epoch:
            self._write()
        if self._highest_claim() != epoch:  # a launch claimed a higher epoch before or as we wrote
            self.lost = "another launch took the run at the same moment"
            raise self._outrun(epoch)
        os.environ[EPOCH_ENV] = str(self.record.epoch)  # every component started from now on inherits it
        self._thread = threading.Thread(target=self._renew, name="lease-renewal", daemon=True)
        self._thread.start()
        return self.record.epoch

    def _abandoned(self, epoch: int) -> bool:
        """Whether the claim of ``epoch`` belongs to a launch that died before it wrote its lease: the
        lease still holds an older epoch and the claim is older than a lease period."""
        rec = LeaseRecord.read(self.rd)
        try:
            age = time.time() - self.rd.lease_claim(epoch).stat().st_mtime
        except FileNotFoundError:
            return False
        return (rec is None or rec.epoch < epoch) and age > self.lease_s

    def _highest_claim(self) -> int:
        names = [p.name for p in self.rd.lease_claims.glob("epoch-*")] if self.rd.lease_claims.is_dir() else []
        return max((int(n[6:]) for n in names if n[6:].isdigit()), default=0)

    def _outrun(self, epoch: int) -> RunDirInUse:
        return RunDirInUse(f"run dir {self.rd.root}: another launch took it over at the same moment "
                           f"(epoch {self._highest_claim()}; this launch had claimed {epoch}): "
                           "only one launch may resume a run")

    def _write(self) -> None:
        assert self.record is not None
        atomic_write(self.rd.lease, json.dumps(asdict(self.record)))

    def taken_over(self, now: LeaseRecord | None = None) -> str:
        """Why another launch holds the run, looked up now ("" while this one does); ``now``: the lease
        as just read. The renewing thread asks it each renewal; a launch whose components just ended
        asks it at once (they may have ended because a newer launch took the run, before the thread's
        next look)."""
        if self.lost or self.record is None:
            return self.lost
        now = now if now is not None else LeaseRecord.read(self.rd)
        top = self._highest_claim()
        if now is not None and (now.epoch, now.pid) != (self.record.epoch, self.record.pid) \
                and now.epoch >= self.record.epoch:
            self.lost = f"launch pid {now.pid} on {now.host} took the run over (epoch {now.epoch})"
        elif top > self.record.epoch:
            self.lost = f"a newer launch took the run over (epoch {top})"
        return self.lost

    def _renew(self) -> None:
        assert self.record is not None
        interval = max(0.2, self.lease_s / 6)
        while not self._stop.wait(interval):
            # Never write over a newer launch's lease (after a stall longer than the lease, a resume
            # may have taken the run): that would end all of its components.
            now = LeaseRecord.read(self.rd)
            if self.taken_over(now):
                logger.error("lease lost: %s", self.lost)
                return
            if now is not None and now.epoch < self.record.epoch:
                # An older launch's write that landed late (a stalled file system): ours goes back.
                logger.warning("lease.json held epoch %d (pid %d); restoring epoch %d", now.epoch, now.pid,
                               self.record.epoch)
            self.record.seq += 1
            self.record.renewed_at = time.time()
            try:
                self._write()
            except OSError as exc:  # a shared file system hiccup: the next renewal tries again
                logger.warning("could not renew the lease: %s", exc)

    def release(self) -> None:
        """Stop renewing and mark the lease released: whatever is left of the run exits at once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.record is not None and not self.record.released and not self.lost:
            self.record.released = True
            try:
                self._write()
            except OSError as exc:
                logger.warning("could not release the lease: %s", exc)


class LeaseWatch:
    """A component's side: the decision, from what it read and its own monotonic clock."""

    def __init__(self, epoch: int, lease_s: float, now: float) -> None:
        self.epoch = epoch
        self.lease_s = lease_s
        self.seq: int | None = None
        self.changed_at = now

    def check(self, rec: LeaseRecord | None, now: float, wall: float | None = None) -> str:
        """"" while the component may live on, else why it must exit. ``wall`` (time.time()) is given
        on the first check only: a lease already stale by the wall clock ends a late starter at once."""
        if rec is None:
            pass  # unreadable for now (a shared file system's torn read): only the clock decides
        elif rec.epoch < self.epoch:
            pass  # an older launch's late write: its own launch writes the lease back; the clock decides
        elif rec.epoch != self.epoch:
            return f"a newer launch took the run over (epoch {rec.epoch}, this component is of epoch {self.epoch})"
        elif rec.released:
            return "its launch ended"
        elif rec.seq != self.seq:
            if self.seq is None and wall is not None and wall - rec.renewed_at > self.lease_s:
                return f"its launch stopped renewing the lease {wall - rec.renewed_at:.0f}s ago"
            self.seq, self.changed_at = rec.seq, now
        if now - self.changed_at > self.lease_s:
            return f"its launch has not renewed the lease for {now - self.changed_at:.0f}s (cluster.lease_s)"
        return ""


def watch_lease(rd: RunDir, lease_s: float) -> None:
    """Exit this process (SIGTERM to itself, so ``finally`` blocks run) once its launch's lease ends.
    A process started without an epoch (a test's bare router, a benchmark) is not watched."""
    epoch = os.environ.get(EPOCH_ENV)
    if not epoch:
        return
    watch = LeaseWatch(int(epoch), lease_s, time.monotonic())
    why = watch.check(LeaseRecord.read(rd), time.monotonic(), wall=time.time())
    if why:
        # A job that starts after its launch died (or was superseded): before it binds, writes or
        # loads anything.
        logger.warning("not starting: %s", why)
        raise SystemExit(0)
    interval = min(2.0, max(0.1, lease_s / 10))

    def loop() -> None:
        reason = ""
        while not reason:
            time.sleep(interval)
            reason = watch.check(LeaseRecord.read(rd), time.monotonic())
        logger.warning("exiting: %s", reason)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=loop, name="lease-watch", daemon=True).start()
