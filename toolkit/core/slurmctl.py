"""Slurm's command-line tools, as the backends need them: job states (``squeue`` + ``sacct``),
``scancel``, and waiting until jobs have left the queue.

One ``JobStates`` per run caches a single query for all of the run's jobs for ``poll_s``, so a run
with hundreds of replicas asks the controller once per interval, not once per job.
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
import time
from dataclasses import dataclass

from toolkit.core.errors import ComponentFailed

logger = logging.getLogger(__name__)

# States in which a job still holds (or will get) its resources: a requeued or preempted-and-requeued
# replica is one of them, so the run waits for it to come back instead of starting a second one.
LIVE_STATES = frozenset({
    "PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED",
    "RESIZING", "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT", "RESV_DEL_HOLD", "SPECIAL_EXIT",
})
FINAL_STATES = frozenset({"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"})
"""Ends a job does not come back from (Slurm requeues a preempted job or one whose node failed, not
these): :class:`JobStates` asks no more of a job once it has seen one."""
_TIMEOUT_S = 30.0


def need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        raise ComponentFailed(f"`{tool}` not found on PATH: is this a Slurm login node (or is the dev cluster "
                              "installed: bash slurm/dev-cluster.sh up)?")
    return path


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    """A Slurm command; one the controller does not answer in time fails like any other (a busy
    slurmctld is a hiccup to look past, not the run's end)."""
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(args, -1, "", f"no answer within {_TIMEOUT_S:.0f}s")


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
        self._final: dict[str, JobState] = {}
        """Jobs seen in a :data:`FINAL_STATES` state: never asked about again (a run that replaces jobs over
        days would otherwise ask squeue and sacct about every one of them every ``poll_s``)."""
        self._at = 0.0

    def watch(self, job_id: str) -> None:
        self.ids.add(job_id)
        self._at = 0.0

    def get(self, job_id: str) -> JobState:
        if time.monotonic() - self._at >= self.poll_s:
            self.refresh()
        return self._states.get(job_id, JobState("UNKNOWN"))

    def refresh(self) -> None:
        try:
            self._refresh()
        finally:
            # From when the answers came: a controller slow to answer must not be asked again at once
            # for every job looked up (each look would then cost a squeue and a sacct).
            self._at = time.monotonic()

    def _refresh(self) -> None:
        self._states = {**self._ask(self.ids - self._final.keys()), **self._final}
        self._final.update({j: st for j, st in self._states.items() if st.state in FINAL_STATES})

    def _ask(self, ids: set[str]) -> dict[str, JobState]:
        listed = listed_states(ids)
        if listed is None:
            # squeue failed: accounting still tells which jobs ended (a cancelled one is seen ended). Its
            # live states are not taken (a lagging slurmdbd may still say PENDING of a running job); such
            # a job, and one it does not know, stays as last seen.
            ended = {j: s for j, s in accounted_states(ids).items() if not s.live}
            return {**self._states, **ended}
        states = {j: s for j, s in listed.items() if s.state in LIVE_STATES}
        missing = ids - states.keys()
        if missing:
            accounted = accounted_states(missing)
            for j in missing:
                if j in accounted:
                    states[j] = accounted[j]
                elif j in listed:  # finished, and no accounting (a site without it, or sacct failed)
                    states[j] = JobState(listed[j].state, exit_code=0 if listed[j].state == "COMPLETED" else 1)
                elif j in self._states and self._states[j].state != "UNKNOWN":
                    before = self._states[j]
                    # Gone from squeue and not in sacct: a finished job stays as it was seen; a live one
                    # ended, and how is not known.
                    states[j] = JobState("UNKNOWN_END", exit_code=1) if before.live else before
        return states


def listed_states(ids: set[str]) -> dict[str, JobState] | None:
    """The states squeue lists for ``ids`` (live ones, and recently finished ones: ``-t all``), one line
    per array element; None if squeue failed (nothing is known, least of all that they are gone)."""
    if not ids:
        return {}
    out = _run([need("squeue"), "-h", "-r", "--me", "-t", "all", "-o", "%i|%T|%r"])
    if out.returncode != 0:
        logger.warning("squeue failed: %s", out.stderr.strip())
        return None
    states = {}
    for line in out.stdout.splitlines():
        job, _, rest = line.strip().partition("|")
        state, _, reason = rest.partition("|")
        if job in ids:
            states[job] = JobState(state, reason)
    return states


def queued_states(ids: set[str]) -> dict[str, JobState] | None:
    """Jobs the controller still lists as live (pending, running, completing); None if squeue failed."""
    listed = listed_states(ids)
    return None if listed is None else {j: s for j, s in listed.items() if s.state in LIVE_STATES}


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
        err = out.stderr.strip()
        # Already finished jobs make scancel complain; that is the outcome we want anyway. Anything else
        # (the controller did not answer) leaves jobs to wait_gone, which cancels again.
        finished = "already completing or completed" in err or "Invalid job id" in err
        (logger.info if finished else logger.warning)("scancel %s: %s", " ".join(ids), err)


def wait_gone(ids: list[str], timeout_s: float = 60.0, signal: str | None = None) -> list[str]:
    """Wait until none of ``ids`` is pending or running; returns those still there at the timeout. A
    squeue that fails proves nothing gone: it is asked again. Every 10 s the ones still listed are
    cancelled again (with ``signal``): a scancel the controller missed is not the end of it."""
    deadline = time.monotonic() + timeout_s
    again = time.monotonic() + 10.0
    left = set(ids)
    while left:
        queued = queued_states(left)
        if queued is not None:
            left = set(queued)
        if not left or time.monotonic() > deadline:
            break
        if queued is not None and time.monotonic() > again:
            scancel(sorted(left), signal)
            again = time.monotonic() + 10.0
        time.sleep(0.5)
    return sorted(left)


def requeue(job: str, attempts: int = 3) -> str:
    """``scontrol requeue job``; "" once done, else scontrol's error. A controller that did not answer
    is asked again (its first answer may come after the job's time is up), unless the job's restart
    count shows the unanswered request took effect (asked again, the controller would say no to a job
    already requeued, and the run would be reported as not coming back)."""
    # One bound for all of it: the stop signal's grace has the teardown to hold besides.
    deadline = time.monotonic() + attempts * _TIMEOUT_S
    before = restarts(job)
    err = ""
    for i in range(attempts):
        if i and before is not None and (now := restarts(job)) is not None and now > before:
            return ""
        if i and time.monotonic() > deadline:
            break
        out = _run([need("scontrol"), "requeue", job])
        if out.returncode == 0:
            return ""
        err = out.stderr.strip()
        if out.returncode != -1:  # the controller answered: no
            break
        time.sleep(1.0)
    return err


def restarts(job: str) -> int | None:
    """How many times Slurm has restarted (requeued) ``job``: ``scontrol show job``'s ``Restarts``; None
    if it did not answer."""
    out = _run([need("scontrol"), "show", "job", job])
    m = re.search(r"\bRestarts=(\d+)", out.stdout) if out.returncode == 0 else None
    return int(m.group(1)) if m else None


def step_ids(job: str, step_name: str) -> list[str]:
    """The ids (``JOB.STEP``) of ``job``'s steps named ``step_name`` ([] if squeue does not answer)."""
    out = _run([need("squeue"), "-h", "-s", "-j", job, "-o", "%i|%j"])
    return [line.split("|")[0] for line in out.stdout.splitlines() if line.endswith(f"|{step_name}")]


def partitions() -> list[str] | None:
    """The cluster's partitions (``sinfo``; its default's ``*`` dropped); None when sinfo is not there or
    does not answer (then sbatch says what it refuses)."""
    if shutil.which("sinfo") is None:
        return None
    out = _run(["sinfo", "-h", "-o", "%P"])
    return sorted({p.rstrip("*") for p in out.stdout.split()}) if out.returncode == 0 else None


def hostnames(nodelist: str) -> list[str]:
    """Expand a Slurm node list (``node[01-03],gpu7``) with ``scontrol show hostnames``."""
    out = _run([need("scontrol"), "show", "hostnames", nodelist])
    if out.returncode != 0:
        raise ComponentFailed(f"scontrol show hostnames {nodelist!r} failed: {out.stderr.strip()}")
    return out.stdout.split()
