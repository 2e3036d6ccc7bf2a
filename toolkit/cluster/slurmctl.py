"""Slurm's command-line tools, as the backends need them: job states (``squeue`` + ``sacct``),
``scancel``, and waiting until jobs have left the queue.

One ``JobStates`` per run caches a single query for all of the run's jobs for ``poll_s``, so a run
with hundreds of replicas asks the controller once per interval, not once per job.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import time
from dataclasses import dataclass

from toolkit.errors import ComponentFailed

logger = logging.getLogger(__name__)

# States in which a job still holds (or will get) its resources: a requeued or preempted-and-requeued
# replica is one of them, so the run waits for it to come back instead of starting a second one.
LIVE_STATES = frozenset({
    "PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED",
    "RESIZING", "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT", "RESV_DEL_HOLD", "SPECIAL_EXIT",
})
_TIMEOUT_S = 30.0


def need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        raise ComponentFailed(f"`{tool}` not found on PATH: is this a Slurm login node (or is the dev cluster "
                              "installed: bash slurm/dev-cluster.sh up)?")
    return path


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=_TIMEOUT_S, stdin=subprocess.DEVNULL)


@dataclass(frozen=True)
class JobState:
    state: str
    """Slurm's state name (RUNNING, PENDING, FAILED...), or UNKNOWN while neither tool knows the job."""
    reason: str = ""
    """squeue's reason for a pending job (Resources, Priority, BeginTime...)."""
    exit_code: int | None = None
    """For a finished job: the exit code sacct reports (0 for COMPLETED)."""

    @property
    def live(self) -> bool:
        # A job submitted a moment ago may not be in sacct yet: UNKNOWN counts as live.
        return self.state in LIVE_STATES or self.state == "UNKNOWN"

    def __str__(self) -> str:
        return f"{self.state} ({self.reason})" if self.reason and self.reason != "None" else self.state


class JobStates:
    """States of a set of Slurm jobs (array elements such as ``123_4`` included), refreshed at most
    every ``poll_s`` seconds."""

    def __init__(self, poll_s: float = 1.0) -> None:
        self.poll_s = poll_s
        self.ids: set[str] = set()
        self._states: dict[str, JobState] = {}
        self._at = 0.0

    def watch(self, job_id: str) -> None:
        self.ids.add(job_id)
        self._at = 0.0

    def get(self, job_id: str) -> JobState:
        if time.monotonic() - self._at >= self.poll_s:
            self.refresh()
        return self._states.get(job_id, JobState("UNKNOWN"))

    def refresh(self) -> None:
        states = queued_states(self.ids)
        missing = self.ids - states.keys()
        if missing:
            states.update(accounted_states(missing))
        self._states = states
        self._at = time.monotonic()


def queued_states(ids: set[str]) -> dict[str, JobState]:
    """Jobs the controller still lists (pending, running, completing), one line per array element."""
    if not ids:
        return {}
    out = _run([need("squeue"), "-h", "-r", "--me", "-t", "all", "-o", "%i|%T|%r"])
    if out.returncode != 0:
        logger.warning("squeue failed: %s", out.stderr.strip())
        return {}
    states = {}
    for line in out.stdout.splitlines():
        job, _, rest = line.strip().partition("|")
        state, _, reason = rest.partition("|")
        if job in ids:
            states[job] = JobState(state, reason)
    # squeue also lists recently finished jobs (-t all); their exit code is sacct's to tell.
    return {j: s for j, s in states.items() if s.state in LIVE_STATES}


def accounted_states(ids: set[str]) -> dict[str, JobState]:
    """Finished jobs from accounting (``sacct``): state and exit code."""
    out = _run([need("sacct"), "-X", "-n", "-P", "-o", "JobID,State,ExitCode", "-j", ",".join(sorted(ids))])
    if out.returncode != 0:
        logger.warning("sacct failed: %s", out.stderr.strip())
        return {}
    states = {}
    for line in out.stdout.splitlines():
        parts = line.strip().split("|")
        if len(parts) < 3 or parts[0] not in ids:
            continue
        # "CANCELLED by 0" -> CANCELLED; ExitCode is "code:signal".
        state = parts[1].split()[0] if parts[1] else "UNKNOWN"
        code, _, sig = parts[2].partition(":")
        exit_code = int(code) if code.isdigit() else None
        if exit_code == 0 and sig.isdigit() and int(sig):
            exit_code = 128 + int(sig)
        if state != "COMPLETED" and exit_code == 0:
            exit_code = 1  # cancelled, timed out, node failure...: not a success whatever the code says
        states[parts[0]] = JobState(state, exit_code=exit_code)
    return states


def scancel(ids: list[str], signal: str | None = None) -> None:
    """Cancel jobs (or job steps ``JOB.STEP``); Slurm sends SIGTERM, then SIGKILL after KillWait."""
    if not ids:
        return
    args = [need("scancel")]
    if signal is not None:
        args += ["--signal", signal]
    out = _run(args + list(ids))
    if out.returncode != 0:
        # Already finished jobs make scancel complain; that is the outcome we want anyway.
        logger.info("scancel %s: %s", " ".join(ids), out.stderr.strip())


def wait_gone(ids: list[str], timeout_s: float = 60.0) -> list[str]:
    """Wait until none of ``ids`` is pending or running; returns those still there at the timeout."""
    deadline = time.monotonic() + timeout_s
    left = set(ids)
    while left:
        left = set(queued_states(left))
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    return sorted(left)


def hostnames(nodelist: str) -> list[str]:
    """Expand a Slurm node list (``node[01-03],gpu7``) with ``scontrol show hostnames``."""
    out = _run([need("scontrol"), "show", "hostnames", nodelist])
    if out.returncode != 0:
        raise ComponentFailed(f"scontrol show hostnames {nodelist!r} failed: {out.stderr.strip()}")
    return out.stdout.split()
