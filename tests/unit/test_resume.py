"""Runs that outlive their launch: the lease, resume after kill -9 and after a stop signal, refusals."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.conftest import finish, launch, start_launch, wait_for
from tests.test_launch import check_outputs
from toolkit.config import compose_config
from toolkit.core.errors import RunDirInUse
from toolkit.core.lease import EPOCH_ENV, Lease, LeaseRecord, LeaseWatch, holder_gone
from toolkit.core.lifecycle import ProcessRef, read_pidfiles
from toolkit.core.rundir import RunDir, atomic_write
from toolkit.launch.resume import config_changes
from toolkit.weights import latest, publish

PLACEMENT = {"num_replicas", "cached_tokens", "groups", "replicas"}
"""Columns that say where a session ran (which replica, what its cache held): they differ between two
uninterrupted runs too. Every other column must be equal."""


def assert_same_outputs(a: Path, b: Path, steps: int) -> None:
    for s in range(steps):
        ta = pq.read_table(a / "steps" / f"step_{s:05d}.parquet")
        tb = pq.read_table(b / "steps" / f"step_{s:05d}.parquet")
        assert ta.schema.names == tb.schema.names
        differ = [c for c in ta.schema.names if c not in PLACEMENT and ta.column(c).to_pylist() != tb.column(c).to_pylist()]
        assert not differ, f"step {s}: columns differ from the uninterrupted run's: {differ}"


# ---- units --------------------------------------------------------------------------------
def test_resume_allows_run_settings_and_names_every_other_change() -> None:
    base = compose_config([])
    same = compose_config(["steps=9", "resume=true", "cluster.ready_timeout_s=5", "groups.throughput.replicas=4",
                           "rollout.request_timeout_s=30", "engine.time_scale=0.5", "ranks=3"])
    assert config_changes(base, same) == []
    changed = compose_config(["engine.model=other-8b", "workload=singleturn", "seed=1"])
    keys = {e.field for e in config_changes(base, changed)}
    assert {"engine.model", "workload.name", "workload.env._target_", "seed", "workload.prompts.seed"} <= keys
    msg = {e.field: e.allowed for e in config_changes(base, changed)}
    assert msg["engine.model"] == "the run being resumed has 'sim-8b'"


def test_run_dir_finds_the_first_unfinished_step_and_clears_what_is_left_of_it(tmp_path: Path) -> None:
    rd = RunDir(tmp_path)
    rd.make()
    for s in (0, 1):
        rd.step_parquet(s).write_text("x")
        rd.step_report(s).write_text("{}")
    rd.step_parquet(2).write_text("partial")  # written, but no report: the crash came before it
    (rd.step_shards(3)).mkdir()
    (rd.step_shards(3) / "shard_00000.parquet").write_text("x")
    assert rd.first_unfinished_step() == 2
    removed = rd.clear_steps_from(2)
    assert sorted(p.name for p in removed) == ["step_00002.parquet", "step_00003"]
    assert sorted(p.name for p in rd.steps.iterdir()) == ["step_00000.json", "step_00000.parquet",
                                                          "step_00001.json", "step_00001.parquet"]


def test_latest_weights_up_to_the_resumed_step(tmp_path: Path) -> None:
    for s in (0, 3, 7):
        publish(tmp_path, s, {"w": np.zeros(1, dtype=np.float32)})
    assert latest(str(tmp_path), 5) == (tmp_path / "step_00003", 3)
    assert latest(str(tmp_path), 7) == (tmp_path / "step_00007", 7)
    assert latest(None, 5) is None


def test_lease_watch_decisions() -> None:
    w = LeaseWatch(epoch=2, lease_s=10, now=100.0)
    rec = LeaseRecord(epoch=2, seq=0, renewed_at=1000.0)
    assert w.check(rec, 101.0, wall=1001.0) == ""
    assert w.check(LeaseRecord(epoch=2, seq=1), 105.0) == ""
    assert w.check(None, 114.0) == ""  # unreadable once: only the clock decides
    assert "not renewed" in w.check(LeaseRecord(epoch=2, seq=1), 115.5)
    assert "newer launch" in LeaseWatch(2, 10, 0.0).check(LeaseRecord(epoch=3), 1.0)
    assert LeaseWatch(2, 10, 0.0).check(LeaseRecord(epoch=1), 1.0) == ""  # an older launch's late write
    assert "ended" in LeaseWatch(2, 10, 0.0).check(LeaseRecord(epoch=2, released=True), 1.0)
    late = LeaseWatch(2, 10, 0.0)  # a job that starts long after its launch died
    assert "stopped renewing" in late.check(LeaseRecord(epoch=2, seq=5, renewed_at=1000.0), 1.0, wall=1100.0)


def test_a_live_holder_keeps_the_run_and_a_dead_one_loses_it(tmp_path: Path) -> None:
    rd = RunDir(tmp_path)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        ref = ProcessRef.of(sleeper.pid)
        held = LeaseRecord(epoch=4, seq=1, renewed_at=time.time(), host=socket.gethostname(), pid=ref.pid,
                           start=ref.start)
        atomic_write(rd.lease, json.dumps(held.__dict__))
        assert holder_gone(held, 60) == ""
        with pytest.raises(RunDirInUse, match=f"pid {ref.pid}"):
            Lease(rd, 60).acquire()
    finally:
        sleeper.kill()
        sleeper.wait()
    assert "gone" in holder_gone(held, 60)
    lease = Lease(rd, 60)
    try:
        assert lease.acquire() == 5
        assert os.environ[EPOCH_ENV] == "5"
    finally:
        lease.release()
        os.environ.pop(EPOCH_ENV, None)
    rec = LeaseRecord.read(rd)
    assert rec is not None and rec.released and rec.epoch == 5


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
        for _ in range(8):  # 4 s of renewals: longer than the lease, and it lives on
            rec.seq += 1
            atomic_write(rd.lease, json.dumps(rec.__dict__))
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


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_resume_after_kill_9_of_launch_mid_step_equals_an_uninterrupted_run(tmp_path: Path) -> None:
    run, ref = tmp_path / "run", tmp_path / "ref"
    # A checkpoint published for step 1: the resumed run's fresh replicas must load it before step 2.
    publish(tmp_path / "weights", 1, {"w": np.zeros(1, dtype=np.float32)})
    weights = [f"rollout.weights_dir={tmp_path / 'weights'}"]
    _kill_launch_mid_step(run, step=2, extra=weights)
    # Its components end with it (the owner watch on this machine; the lease everywhere).
    wait_for(lambda: not [r for r in read_pidfiles(run / "pids") if r.alive()], 60, "the killed run's processes to end")
    assert not (run / "steps" / "step_00002.json").exists()

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


def test_resume_of_a_finished_run_runs_only_the_added_steps(tmp_path: Path) -> None:
    run = tmp_path / "run"
    args = [f"hydra.run.dir={run}", "engine.time_scale=0.05", "sessions_per_step=4"]
    assert launch([*args, "steps=1"]).returncode == 0
    out = launch([*args, "steps=1", "resume=true"])
    assert out.returncode == 0 and "already done" in out.stdout, out.stdout + out.stderr
    out = launch([*args, "steps=2", "resume=true"])
    assert out.returncode == 0 and "at step 2 of 2" in out.stdout, out.stdout + out.stderr
    check_outputs(run, steps=2, sessions=4)


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


def test_prepare_clears_what_would_mislead_the_resumed_step(tmp_path: Path) -> None:
    from toolkit.config import save_run_config
    from toolkit.launch.resume import prepare

    rd = RunDir(tmp_path)
    rd.make()
    save_run_config(compose_config([]), rd.config)
    rd.step_report(0).write_text("{}")
    rd.step_parquet(1).write_text("partial")
    atomic_write(rd.sentinel("rollout"), json.dumps({"step": 1, "count": 29}))  # step 1 had flipped
    atomic_write(rd.stop_request, "{}")
    atomic_write(rd.router_address, "{}")
    atomic_write(rd.scale_request, json.dumps({"seq": 1, "groups": {"throughput": 5}}))
    point = prepare(rd, 2, compose_config(["groups.throughput.replicas=3"]))
    assert point.first_step == 1 and point.removed == ["steps/step_00001.parquet"]
    for gone in (rd.sentinel("rollout"), rd.stop_request, rd.router_address, rd.scale_request):
        assert not gone.exists(), gone
    # Without a changed count on the command line, the last scale request stands.
    atomic_write(rd.scale_request, json.dumps({"seq": 1, "groups": {"throughput": 5}}))
    prepare(rd, 3, compose_config([]))
    assert rd.scale_request.exists()


def test_a_launch_whose_lease_was_taken_over_notices_and_leaves_it_alone(tmp_path: Path) -> None:
    rd = RunDir(tmp_path)
    lease = Lease(rd, lease_s=1.2)  # renewed every 0.2 s
    try:
        lease.acquire()
        taker = LeaseRecord(epoch=9, seq=0, renewed_at=time.time(), host="other", pid=4242)
        atomic_write(rd.lease, json.dumps(taker.__dict__))
        wait_for(lambda: bool(lease.lost), 10, "the old launch to notice")
        assert "pid 4242 on other" in lease.lost
    finally:
        lease.release()
        os.environ.pop(EPOCH_ENV, None)
    rec = LeaseRecord.read(rd)
    assert rec is not None and (rec.epoch, rec.pid, rec.released) == (9, 4242, False)  # untouched


def test_two_launches_taking_a_run_at_once_never_share_an_epoch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both read the same released lease (the barrier holds each right after its read): one takes the
    next epoch, the other is refused, instead of both running as that epoch."""
    import threading

    from toolkit.core import lease as lease_mod

    rd = RunDir(tmp_path)
    first = Lease(rd, 60)
    first.acquire()
    first.release()
    barrier = threading.Barrier(2, timeout=10)
    real = lease_mod.holder_gone

    def both_read_first(rec: LeaseRecord, lease_s: float, now: float | None = None) -> str:
        barrier.wait()
        return real(rec, lease_s, now)

    monkeypatch.setattr(lease_mod, "holder_gone", both_read_first)
    leases = [Lease(rd, 1.2), Lease(rd, 1.2)]  # renewed every 0.2 s
    outcomes: list[object] = [None, None]

    def take(k: int) -> None:
        try:
            outcomes[k] = leases[k].acquire()
        except RunDirInUse as exc:
            outcomes[k] = exc

    threads = [threading.Thread(target=take, args=(k,)) for k in range(2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert sorted(type(o).__name__ for o in outcomes) == ["RunDirInUse", "int"], outcomes
        won = next(o for o in outcomes if isinstance(o, int))  # 2, or 3 if it saw the other's claim of 2
        assert "another launch took it over at the same moment" in str(
            next(o for o in outcomes if isinstance(o, RunDirInUse)))
        assert won in (2, 3)
        # The loser may have written its lease just after the winner did: the winner writes its own back.
        wait_for(lambda: (LeaseRecord.read(rd) or LeaseRecord(0)).epoch == won, 10, "the winner's lease")
    finally:
        for lease in leases:
            lease.release()
        os.environ.pop(EPOCH_ENV, None)


def test_a_stalled_old_launchs_late_write_never_takes_the_run_back(tmp_path: Path) -> None:
    """The old holder's renewal write lands after a newer launch took over (a file system stall): the
    newer launch keeps the run and writes its lease back; its components never read it as newer."""
    rd = RunDir(tmp_path)
    old = Lease(rd, lease_s=1.2)
    old.acquire()
    old._stop.set()  # the old launch stalls: no more renewals
    assert old._thread is not None
    old._thread.join(5)
    new = Lease(rd, lease_s=1.2)
    try:
        wait_for(lambda: bool(holder_gone(LeaseRecord.read(rd) or LeaseRecord(0), 1.2)), 10, "the old lease to go stale")
        assert new.acquire() == 2
        watch = LeaseWatch(2, 1.2, time.monotonic())
        old._write()  # the stalled write lands
        late = LeaseRecord.read(rd)
        assert late is not None and late.epoch == 1 and watch.check(late, time.monotonic()) == ""
        wait_for(lambda: (LeaseRecord.read(rd) or LeaseRecord(0)).epoch == 2, 10, "the newer launch to write its lease back")
        assert not new.lost
    finally:
        new.release()
        os.environ.pop(EPOCH_ENV, None)


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


def test_a_component_of_a_dead_launch_does_not_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from toolkit.core.lease import watch_lease

    rd = RunDir(tmp_path)
    atomic_write(rd.lease, json.dumps(LeaseRecord(epoch=3, seq=7, renewed_at=time.time() - 600).__dict__))
    monkeypatch.setenv(EPOCH_ENV, "3")
    with pytest.raises(SystemExit) as exited:
        watch_lease(rd, 60)
    assert exited.value.code == 0
    monkeypatch.setenv(EPOCH_ENV, "2")  # superseded by a resume (epoch 3)
    atomic_write(rd.lease, json.dumps(LeaseRecord(epoch=3, seq=7, renewed_at=time.time()).__dict__))
    with pytest.raises(SystemExit):
        watch_lease(rd, 60)
    # The whole preamble: such a component leaves no pid file for the newer launch to count or stop.
    import logging

    from toolkit.config import save_run_config
    from toolkit.config.entry import enter_component

    save_run_config(compose_config([]), rd.config)
    handlers, sigterm = list(logging.getLogger().handlers), signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit):
            enter_component(tmp_path, "rank-0")
    finally:  # the preamble set this test process up as a component
        signal.signal(signal.SIGTERM, sigterm)
        for h in logging.getLogger().handlers:
            if h not in handlers:
                logging.getLogger().removeHandler(h)
                h.close()
    assert not list(rd.pids.glob("*.pid"))
