"""The real Slurm of ``slurm/dev-cluster.sh`` in tests: whether it answers, shared run dirs, our jobs."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from pathlib import Path

from tests.helpers.paths import ROOT
from toolkit.cluster.storage import check_shared

FAST = ["cluster=slurm", "engine.time_scale=0.2"]


def _shared_root() -> Path:
    if env := os.environ.get("TOOLKIT_SHARED_TMP"):
        return Path(env)
    # A checkout under /tmp would put run dirs on node-local storage, which launch refuses on Slurm.
    inside = ROOT / ".slurm-test-runs"
    if check_shared(inside, "test run dirs", nodes=1) is None:
        return inside
    return Path.home() / ".cache" / "rollout-toolkit" / "slurm-test-runs"


SHARED = _shared_root()


@functools.cache
def slurm_problem() -> str | None:
    """Why the tests marked ``slurm`` cannot run here (asked once a session), or None."""
    if shutil.which("sbatch") is None:
        return "no sbatch on PATH (start the dev cluster: bash slurm/dev-cluster.sh up)"
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return "sinfo does not answer"
    states = out.stdout.split()
    if out.returncode != 0 or not any(s.rstrip("*") in ("idle", "mixed", "allocated") for s in states):
        return f"no usable Slurm node (sinfo: {out.stdout.strip() or out.stderr.strip()})"
    return None


def our_jobs(job: str) -> list[tuple[str, str]]:
    """(job id, state) of every queued job whose name starts with the run's job name."""
    out = subprocess.run(["squeue", "-h", "-r", "--me", "-o", "%i|%j|%T"], capture_output=True, text=True,
                         timeout=30, check=True)
    rows = [line.split("|") for line in out.stdout.splitlines()]
    return [(r[0], r[2]) for r in rows if r[1].startswith(job)]


def pending(job: str) -> list[tuple[str, str]]:
    out = subprocess.run(["squeue", "-h", "-r", "--me", "-o", "%j|%T|%r"], capture_output=True, text=True,
                         timeout=30, check=True)
    return [(r[1], r[2]) for r in (line.split("|") for line in out.stdout.splitlines()) if r[0].startswith(job)]


def job_id(job: str, name: str, array_index: int | None = None) -> str:
    out = subprocess.run(["squeue", "-h", "-r", "--me", "-o", "%i|%j"], capture_output=True, text=True,
                         timeout=30, check=True)
    for line in out.stdout.splitlines():
        jid, jname = line.split("|")
        if jname == f"{job}-{name}" and (array_index is None or jid.endswith(f"_{array_index}")):
            return jid
    raise AssertionError(f"no queued job {job}-{name} ({out.stdout})")


def accounting(ids: str) -> dict[str, str]:
    """JobID -> State for jobs and their steps, from sacct."""
    out = subprocess.run(["sacct", "-n", "-P", "-j", ids, "-o", "JobID,JobName,State"], capture_output=True,
                         text=True, timeout=30, check=True)
    return {p[0]: p[2] for p in (line.split("|") for line in out.stdout.splitlines())}


def registrations(run: Path, replica: str) -> set[str]:
    """Replica ids (``<name>@<host>:<pid>``) that registered with the router under ``replica``."""
    log = run / "logs" / "router.log"
    lines = log.read_text().splitlines() if log.exists() else []
    return {line.split("replica ")[1].split()[0] for line in lines
            if f"replica {replica}@" in line and " registered " in line}
