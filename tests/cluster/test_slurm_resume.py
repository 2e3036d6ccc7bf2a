"""Runs that outlive their Slurm jobs, on the real dev Slurm: the sbatch job requeued mid-step (by
``scontrol requeue``, and by launch itself at the USR1 before a time limit) resumes and ends with the
outputs of an uninterrupted run; a SIGKILLed ``cluster=slurm`` launch leaves no job behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.outputs import assert_same_outputs, check_outputs
from tests.helpers.paths import ROOT
from tests.helpers.procs import finish, launch, start_launch, wait_for
from tests.helpers.slurm import FAST, job_id, our_jobs, pending, registrations

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(600)]


RUN = ["engine.time_scale=0.5", "steps=3", "sessions_per_step=24"]


def _submit(d: Path, job: str, extra: list[str]) -> str:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    out = subprocess.run(
        ["sbatch", "--parsable", f"--chdir={ROOT}", f"--output={d}/slurm-%j.out", f"--job-name={job}",
         str(ROOT / "slurm" / "rollout.sbatch"), f"hydra.run.dir={d / 'run'}", f"job={job}", *RUN, *extra],
        capture_output=True, text=True, timeout=60, env=env, check=True)
    return out.stdout.strip().split(";")[0]


def _restart_soon(job: str, jid: str) -> None:
    """A requeued job may run again only after its BeginTime (~2 min): once it is back in the queue,
    let it go sooner (not at once: slurmd refuses to relaunch a job id it has just killed)."""
    wait_for(lambda: ("PENDING", "BeginTime") in pending(job), 120, "the job to be requeued")
    subprocess.run(["scontrol", "update", f"JobId={jid}", "StartTime=now+3"], check=True, timeout=30)


def _sacct_state(jid: str) -> str:
    out = subprocess.run(["sacct", "-n", "-X", "-P", "-j", jid, "-o", "State"], capture_output=True, text=True,
                         timeout=30)
    return out.stdout.strip().split("\n")[0] if out.stdout.strip() else ""


def _wait_done(d: Path, job: str, jid: str) -> None:
    wait_for(lambda: not our_jobs(job), 300, "the job to end")
    # Accounting lags the queue: wait for sacct's final state.
    wait_for(lambda: _sacct_state(jid) not in ("", "PENDING", "RUNNING", "REQUEUED", "COMPLETING"), 60,
             "accounting to record the job's end")
    log = "".join(p.read_text() for p in d.glob("slurm-*.out"))
    assert _sacct_state(jid) == "COMPLETED", log


def _reference(tmp_path: Path, job: str) -> Path:
    """The same run, uninterrupted, on this machine (cluster=local): the sim's outputs do not depend on
    where it runs."""
    ref = tmp_path / "ref"
    out = launch([f"hydra.run.dir={ref}", f"job={job}", *RUN])
    assert out.returncode == 0, out.stdout + out.stderr
    return ref


def test_scontrol_requeue_of_the_sbatch_job_mid_step_resumes_it(slurm_run: tuple[Path, str], tmp_path: Path) -> None:
    d, job = slurm_run
    r = d / "run"
    jid = _submit(d, job, [])
    wait_for(lambda: (r / "steps" / "step_00000.json").exists(), 240, "the first step")
    subprocess.run(["scontrol", "requeue", jid], check=True, timeout=30)
    _restart_soon(job, jid)
    _wait_done(d, job, jid)
    steps = check_outputs(r, steps=3, sessions=24)
    report = json.loads((r / "report.json").read_text())
    resumes = [e for e in report["interruptions"] if e["kind"] == "resume"]
    assert len(resumes) == 1 and resumes[0]["slurm_restart_count"] == 1 and resumes[0]["slurm_job"] == jid
    assert any(e["kind"] == "signal" and e["signal"] == "SIGTERM" for e in report["interruptions"])
    resumed = resumes[0]["step"]
    assert 1 <= resumed <= 2 and [e["kind"] for e in steps[resumed]["interruptions"]] == ["resume"]
    assert_same_outputs(r, _reference(tmp_path, job), 3)


def test_usr1_to_the_sbatch_job_stops_it_requeues_it_and_it_resumes(slurm_run: tuple[Path, str], tmp_path: Path) -> None:
    d, job = slurm_run
    r = d / "run"
    jid = _submit(d, job, ["cluster.signal_grace_s=60"])
    wait_for(lambda: (r / "steps" / "step_00000.json").exists(), 240, "the first step")
    subprocess.run(["scancel", "--signal=USR1", "--batch", jid], check=True, timeout=30)
    _restart_soon(job, jid)
    _wait_done(d, job, jid)
    check_outputs(r, steps=3, sessions=24)
    kinds = [e["kind"] for e in json.loads((r / "report.json").read_text())["interruptions"]]
    assert kinds == ["signal", "requeue", "resume"], kinds
    assert_same_outputs(r, _reference(tmp_path, job), 3)


def test_kill_9_of_a_slurm_launch_ends_every_job_within_the_lease_and_the_same_command_resumes(
        slurm_run: tuple[Path, str]) -> None:
    d, job = slurm_run
    r = d / "run"
    lease_s = 10
    args = [f"hydra.run.dir={r}", f"job={job}", *FAST, "steps=8", f"cluster.lease_s={lease_s}"]
    proc = start_launch(args)
    try:
        wait_for(lambda: (r / "steps" / "step_00000.json").exists(), 180, "the first step")
        assert len(our_jobs(job)) == 5  # router, 2 + 1 replicas, ranks
        proc.kill()
        proc.wait(timeout=30)
    finally:
        finish(proc, 30)
    wait_for(lambda: not our_jobs(job), lease_s + 30, "squeue to hold no job of the killed launch")
    # What each component said as it went: the lease, not a scancel, ended them.
    assert "has not renewed the lease" in (r / "logs" / "router.log").read_text()
    # From the login node, the same command with resume=true continues the run.
    out = launch([*args, "resume=true"], timeout_s=300)
    assert out.returncode == 0, out.stdout + out.stderr
    check_outputs(r, steps=8, sessions=32)
    assert [e["kind"] for e in json.loads((r / "report.json").read_text())["interruptions"]] == ["resume"]


def _events(r: Path) -> list[dict]:
    path = r / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_scaling_and_a_preempted_replica_lose_and_duplicate_no_session(slurm_run: tuple[Path, str]) -> None:
    d, job = slurm_run
    r = d / "run"
    proc = start_launch([f"hydra.run.dir={r}", f"job={job}", *FAST, "steps=40", "router.heartbeat_s=0.2"])
    try:
        wait_for(lambda: (r / "steps" / "step_00000.json").exists(), 180, "the first step")
        up = subprocess.run([sys.executable, "-m", "toolkit.launch.scale", str(r), "throughput=3", "--wait", "180"],
                            capture_output=True, text=True, timeout=200)
        assert up.returncode == 0, up.stdout + up.stderr
        # Slurm preempts (requeues) a replica mid-step: the step goes on with the others.
        victim = job_id(job, "replica-throughput", array_index=1)
        subprocess.run(["scontrol", "requeue", victim], check=True, timeout=30)
        wait_for(lambda: any(e["kind"] == "replica_preempted" for e in _events(r)), 60, "the preemption to be seen")
        down = subprocess.run([sys.executable, "-m", "toolkit.launch.scale", str(r), "throughput=2"], capture_output=True,
                              text=True, timeout=60)
        assert down.returncode == 0, down.stdout + down.stderr
        wait_for(lambda: any(e["kind"] == "replica_removed" for e in _events(r)), 120, "throughput-2 to leave")
        _restart_soon(job, victim)
        wait_for(lambda: len(registrations(r, "throughput-1")) == 2, 120, "the preempted replica to come back")
        assert proc.poll() is None, "the run ended before the preempted replica came back"
    finally:
        output = finish(proc, 400)
    assert proc.returncode == 0, output
    check_outputs(r, steps=40, sessions=32)  # every session exactly once, complete
    s = json.loads((r / "report.json").read_text())["summary"]
    assert (s["replicas_added"], s["replicas_removed"], s["replicas_preempted"], s["replica_restarts"]) == (1, 1, 1, 0), s


def test_a_requeue_that_slurm_refuses_ends_the_trainers_wait(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """scontrol refuses to requeue (a job id it does not know): the run's events say so, and a
    trainer's wait_step ends at once (RunEnded) instead of waiting for a job that will not come back."""
    import signal

    from rich.console import Console

    from toolkit.config import compose_config
    from toolkit.core.rundir import RunDir, atomic_write
    from toolkit.launch import app as launch_mod
    from toolkit.samples import RunEnded, wait_step

    rd = RunDir(tmp_path)
    rd.make()
    atomic_write(rd.lease, json.dumps({"epoch": 1, "released": True}))
    atomic_write(rd.report, json.dumps({"status": "interrupted", "error": "SIGUSR1 with 120s of grace"}))
    monkeypatch.setenv("SLURM_JOB_ID", "987654321")
    before = signal.getsignal(signal.SIGTERM)
    try:
        launch_mod._requeue(compose_config(["cluster=allocation"]), rd, Console(quiet=True))
    finally:
        signal.signal(signal.SIGTERM, before)
    kinds = [e["kind"] for e in rd.read_events()]
    assert kinds == ["requeue", "requeue_failed"], rd.read_events()
    with pytest.raises(RunEnded, match="interrupted"):
        wait_step(rd, 0, timeout_s=60)


def test_a_run_whose_job_slurm_requeued_is_waited_for_until_the_job_is_gone(tmp_path: Path, slurm_run) -> None:  # type: ignore[no-untyped-def]
    """The launch of a preempted (requeued) job was stopped by Slurm's SIGTERM, so its report says
    interrupted with no requeue event of its own: while Slurm still queues the job, a trainer waits."""
    from toolkit import samples
    from toolkit.core.rundir import RunDir, atomic_write
    from toolkit.core.slurmctl import scancel, wait_gone
    from toolkit.samples import RunEnded, StepTimeout, wait_step

    _, name = slurm_run
    jid = subprocess.run(["sbatch", "--parsable", f"--job-name={name}", "--begin=now+3600", f"--output={tmp_path}/%j.out",
                          "--wrap", "true"], capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    try:
        rd = RunDir(tmp_path / "run")
        rd.make()
        atomic_write(rd.lease, json.dumps({"epoch": 1, "released": True, "slurm_job": jid}))
        atomic_write(rd.report, json.dumps({"status": "interrupted", "error": "stopped by SIGTERM during step 0"}))
        with pytest.raises(StepTimeout):
            wait_step(rd, 0, timeout_s=1)
    finally:
        scancel([jid])
        wait_gone([jid], timeout_s=60)
    samples._QUEUED.clear()  # the wait polls squeue every 10 s; the test need not wait for it
    with pytest.raises(RunEnded, match="interrupted"):
        wait_step(rd, 0, timeout_s=60)
