"""Runs that outlive their launch, with real processes: a router that leaves once its lease is stale,
resume after kill -9 and after a stop signal, refusals, a suspended launch. The lease's rules on
in-process objects: tests/unit/test_resume.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.helpers.outputs import assert_same_outputs, check_outputs
from tests.helpers.procs import finish, launch, start_launch, wait_for
from toolkit.config import compose_config
from toolkit.core.lease import EPOCH_ENV, LeaseRecord, holder_gone
from toolkit.core.lifecycle import read_pidfiles
from toolkit.core.rundir import RunDir, atomic_write
from toolkit.weights import publish


@pytest.mark.timeout(120)
def test_a_component_exits_when_its_lease_is_not_renewed(tmp_path: Path) -> None:
    """A real router process of epoch 1: alive while the lease moves, gone once it stops moving."""
    rd = RunDir(tmp_path / "run")
    rd.make()
    from toolkit.config import save_run_config

    save_run_config(compose_config(["cluster.lease_s=3"]), rd.config)
    rec = LeaseRecord(epoch=1, seq=0, renewed_at=time.time(), host="elsewhere", pid=1)
    atomic_write(rd.lease, json.dumps(rec.__dict__))
    log = open(tmp_path / "router.out", "wb")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "toolkit.router", str(rd.root)], stdout=log, stderr=log,
                            env=dict(os.environ, **{EPOCH_ENV: "1"}))
    try:
        wait_for(lambda: rd.router_address.exists(), 60, "the router's address")
        tmp = rd.lease.with_name(".lease.renewal")
        for _ in range(8):  # 4 s of renewals: longer than the lease, and it lives on
            rec.seq += 1
            # Written and renamed without atomic_write's fsync, which the other tests' disk writes can
            # stall: in one CI run the lease stood still for 3 s (the whole lease) while this loop ran,
            # and the router rightly went.
            tmp.write_text(json.dumps(rec.__dict__))
            os.replace(tmp, rd.lease)
            time.sleep(0.5)
        assert proc.poll() is None, (tmp_path / "router.out").read_text()
        wait_for(lambda: proc.poll() is not None, 30, "the router to exit once the lease is stale")
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        log.close()
    assert "has not renewed the lease" in (rd.logs / "router.log").read_text()


# ---- whole runs -----------------------------------------------------------------------------
RUN = ["engine.time_scale=0.5", "steps=3", "sessions_per_step=24"]


def _kill_launch_mid_step(run: Path, step: int, extra: list[str]) -> None:
    """SIGKILL the launch process once ``step`` has begun (its previous step's report is written)."""
    proc = start_launch([f"hydra.run.dir={run}", *RUN, *extra])
    try:
        wait_for(lambda: (run / "steps" / f"step_{step - 1:05d}.json").exists(), 120, f"step {step - 1} to end")
        time.sleep(0.3)
        proc.kill()
        proc.wait(timeout=30)
    finally:
        finish(proc, 30)


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_resume_after_kill_9_of_launch_mid_step_equals_an_uninterrupted_run(tmp_path: Path) -> None:
    run, ref = tmp_path / "run", tmp_path / "ref"
    # A checkpoint published for step 1: the resumed run's fresh replicas must load it before step 2.
    publish(tmp_path / "weights", 1, {"w": np.zeros(1, dtype=np.float32)})
    # Session 2/0 waits in its first tool call until `release` exists, so step 2 is still open when the
    # launch dies, however fast the machine (the same env in every run: the outputs stay comparable).
    release = tmp_path / "release"
    weights = [f"rollout.weights_dir={tmp_path / 'weights'}", "workload.env._target_=tests.helpers.partial_env.SlowSessions",
               "+workload.env.slow=[2/0]", f"+workload.env.until={release}"]
    _kill_launch_mid_step(run, step=2, extra=weights)
    # Its components end with it (the owner watch on this machine; the lease everywhere).
    wait_for(lambda: not [r for r in read_pidfiles(run / "pids") if r.alive()], 60, "the killed run's processes to end")
    assert not (run / "steps" / "step_00002.json").exists()
    release.touch()

    out = launch([f"hydra.run.dir={run}", *RUN, *weights, "resume=true"])
    assert out.returncode == 0, out.stdout + out.stderr
    assert "resuming" in out.stdout and "at step 3 of 3" in out.stdout
    steps = check_outputs(run, steps=3, sessions=24)
    assert [e["kind"] for e in steps[2]["interruptions"]] == ["resume"]
    assert steps[0]["interruptions"] == [] and steps[1]["interruptions"] == []
    report = json.loads((run / "report.json").read_text())
    assert [(e["kind"], e["step"], e["epoch"]) for e in report["interruptions"]] == [("resume", 2, 2)]
    rows = pq.read_table(run / "steps" / "step_00002.parquet").to_pylist()
    assert {v for r in rows for v in r["weight_versions"]} == {1}

    out = launch([f"hydra.run.dir={ref}", *RUN, *weights])
    assert out.returncode == 0, out.stdout + out.stderr
    assert_same_outputs(run, ref, 3)


def _usr1_after_first_step(run: Path, args: list[str]) -> str:
    """Launch's output after a SIGUSR1 once step 0 is done; it must exit 75 (stopped, resumable)."""
    proc = start_launch(args)
    try:
        wait_for(lambda: (run / "steps" / "step_00000.json").exists(), 120, "step 0 to end")
        proc.send_signal(signal.SIGUSR1)
    finally:
        output = finish(proc, 120)
    assert proc.returncode == 75, output
    return output


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_sigusr1_finishes_the_step_stops_and_a_resume_completes_the_run(tmp_path: Path) -> None:
    run = tmp_path / "run"
    output = _usr1_after_first_step(run, [f"hydra.run.dir={run}", *RUN, "cluster.signal_grace_s=120"])
    assert "SIGUSR1" in output and "resume=true" in output
    report = json.loads((run / "report.json").read_text())
    assert report["status"] == "interrupted"
    done = len(report["steps"])
    assert 1 <= done < 3 and [s["step"] for s in report["steps"]] == list(range(done))
    assert report["interruptions"][0]["kind"] == "signal" and report["interruptions"][0]["signal"] == "SIGUSR1"
    assert not list((run / "steps").glob(f"step_{done:05d}*"))  # the next step never began

    out = launch([f"hydra.run.dir={run}", *RUN, "resume=true"])
    assert out.returncode == 0, out.stdout + out.stderr
    check_outputs(run, steps=3, sessions=24)


@pytest.mark.mpi
def test_resume_with_a_changed_model_or_workload_is_refused_naming_the_keys(tmp_path: Path) -> None:
    run = tmp_path / "run"
    out = launch([f"hydra.run.dir={run}", "engine.time_scale=0.05", "steps=1", "sessions_per_step=4"])
    assert out.returncode == 0, out.stdout + out.stderr
    before = sorted(p.name for p in (run / "steps").iterdir())
    out = launch([f"hydra.run.dir={run}", "engine.time_scale=0.05", "steps=2", "sessions_per_step=4",
                  "resume=true", "engine.model=other-8b", "workload=singleturn"])
    assert out.returncode == 2
    for key in ("engine.model = 'other-8b'", "workload.name = 'singleturn'", "workload.env._target_"):
        assert key in out.stdout, out.stdout
    assert sorted(p.name for p in (run / "steps").iterdir()) == before  # nothing touched
    # Without resume the run dir is refused, and the message says how to continue it.
    out = launch([f"hydra.run.dir={run}", "engine.time_scale=0.05"])
    assert out.returncode == 2 and "resume=true" in out.stdout


@pytest.mark.mpi
def test_resume_of_a_finished_run_runs_only_the_added_steps(tmp_path: Path) -> None:
    run = tmp_path / "run"
    args = [f"hydra.run.dir={run}", "engine.time_scale=0.05", "sessions_per_step=4"]
    assert launch([*args, "steps=1"]).returncode == 0
    out = launch([*args, "steps=1", "resume=true"])
    assert out.returncode == 0 and "already done" in out.stdout, out.stdout + out.stderr
    out = launch([*args, "steps=2", "resume=true"])
    assert out.returncode == 0 and "at step 2 of 2" in out.stdout, out.stdout + out.stderr
    check_outputs(run, steps=2, sessions=4)


def test_a_requeued_slurm_job_resumes_the_run_it_made_without_being_told(tmp_path: Path) -> None:
    """A hydra-submitit sweep point that submitit requeued runs again with the command line it started with
    (no resume=true): the run its job made goes on; another job's launch into that directory is refused.
    (cluster=local, with Slurm's variables as a requeued job has them.)"""
    run = tmp_path / "run"
    args = [f"hydra.run.dir={run}", "engine.time_scale=0.05", "sessions_per_step=4"]
    first = launch([*args, "steps=1"], env_extra={"SLURM_JOB_ID": "4242"})
    assert first.returncode == 0, first.stdout + first.stderr
    other = launch([*args, "steps=2"], env_extra={"SLURM_JOB_ID": "4243", "SLURM_RESTART_COUNT": "1"})
    assert other.returncode == 2 and "already holds a run" in other.stdout, other.stdout + other.stderr
    out = launch([*args, "steps=2"], env_extra={"SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": "1"})
    assert out.returncode == 0 and "was requeued" in out.stdout and "at step 2 of 2" in out.stdout, out.stdout + out.stderr
    check_outputs(run, steps=2, sessions=4)


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_sigusr1_without_grace_abandons_the_step_in_flight_cleanly(tmp_path: Path) -> None:
    run = tmp_path / "run"
    args = [f"hydra.run.dir={run}", "engine.time_scale=1.0", "steps=3", "sessions_per_step=24"]
    _usr1_after_first_step(run, [*args, "cluster.signal_grace_s=1"])
    report = json.loads((run / "report.json").read_text())
    assert report["status"] == "interrupted" and "abandoned" in report["error"], report["error"]
    assert [s["step"] for s in report["steps"]] == [0]
    assert not [r for r in read_pidfiles(run / "pids") if r.alive()]
    out = launch([*args, "resume=true"])
    assert out.returncode == 0, out.stdout + out.stderr
    assert "at step 2 of 3" in out.stdout
    check_outputs(run, steps=3, sessions=24)


@pytest.mark.mpi
@pytest.mark.timeout(400)
def test_a_launch_suspended_past_its_lease_leaves_the_run_that_took_over_alone(tmp_path: Path) -> None:
    """Launch A is suspended (Ctrl-Z) past its lease and B resumes the run. Continued, A finds its
    lease lost and stops only what it started: not B's components by the run dir's pid files, and
    it writes no report.json over B's."""
    run = tmp_path / "run"
    rd = RunDir(run)
    args = [f"hydra.run.dir={run}", "engine.time_scale=0.5", "steps=60", "sessions_per_step=8", "cluster.lease_s=4"]

    def reports() -> int:
        return len(list(rd.steps.glob("step_*.json")))

    a = start_launch(args)
    b: subprocess.Popen[str] | None = None
    try:
        wait_for(lambda: reports() >= 1, 120, "launch A's first step")
        a.send_signal(signal.SIGSTOP)
        wait_for(lambda: bool(holder_gone(LeaseRecord.read(rd) or LeaseRecord(0), 4)), 30, "A's lease to go stale")
        b = start_launch([*args, "resume=true"])
        wait_for(lambda: (LeaseRecord.read(rd) or LeaseRecord(0)).epoch == 2, 60, "B to take the run")
        done = reports()
        wait_for(lambda: reports() >= done + 1, 120, "B to run a step")
        a.send_signal(signal.SIGCONT)
        out_a = finish(a, 120)
        assert a.returncode == 1 and "lost the run's lease" in out_a, out_a
        done = reports()
        wait_for(lambda: reports() >= done + 1, 120, "B to run on after A's teardown")
        b.send_signal(signal.SIGUSR1)  # B stops cleanly: its own components were never touched
        out_b = finish(b, 120)
        assert b.returncode == 75, out_b
        report = json.loads(rd.report.read_text())
        assert report["status"] == "interrupted" and "SIGUSR1" in report["error"], report["error"]
    finally:
        for p in (a, b):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGCONT)
                finish(p, 60)
