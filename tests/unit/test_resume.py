"""Runs that outlive their launch, on in-process objects: the lease and its watch, what a resume
allows and clears. With real launches: tests/integration/test_resume.py."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import time
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.procs import wait_for
from toolkit.config import compose_config
from toolkit.core.errors import RunDirInUse
from toolkit.core.lease import EPOCH_ENV, Lease, LeaseRecord, LeaseWatch, holder_gone
from toolkit.core.lifecycle import ProcessRef
from toolkit.core.rundir import RunDir, atomic_write
from toolkit.launch.resume import config_changes
from toolkit.weights import latest, publish


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
    """The holder here is this test's process (alive); then a launch whose process is gone: a pid no
    process can have, and this pid with another start time (the pid was reused)."""
    rd = RunDir(tmp_path)
    ref = ProcessRef.self()
    held = LeaseRecord(epoch=4, seq=1, renewed_at=time.time(), host=socket.gethostname(), pid=ref.pid, start=ref.start)
    atomic_write(rd.lease, json.dumps(held.__dict__))
    assert holder_gone(held, 60) == ""
    with pytest.raises(RunDirInUse, match=f"pid {ref.pid}"):
        Lease(rd, 60).acquire()
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())  # pids are below it
    assert "gone" in holder_gone(dataclasses.replace(held, pid=pid_max), 60)
    assert ref.start is not None
    held = dataclasses.replace(held, start=ref.start + 1)
    atomic_write(rd.lease, json.dumps(held.__dict__))
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
    for gone in (rd.sentinel("rollout"), rd.stop_request, rd.router_address):
        assert not gone.exists(), gone
    assert json.loads(rd.scale_request.read_text())["groups"] == {}  # the count given wins over the scaled one
    # Without a changed count on the command line, the last scale request stands.
    atomic_write(rd.scale_request, json.dumps({"seq": 1, "groups": {"throughput": 5}}))
    prepare(rd, 3, compose_config([]))
    assert json.loads(rd.scale_request.read_text())["groups"] == {"throughput": 5}
    # Group by group, by what the command line names: the tail's scaled count stands beside a throughput
    # count given; a count given equal to the stored one (undoing a scale-up) wins too.
    for line, left in (("groups.throughput.replicas=6", {"tail": 3}), ("groups.throughput.replicas=2", {"tail": 3})):
        atomic_write(rd.scale_request, json.dumps({"seq": 2, "groups": {"throughput": 4, "tail": 3}}))
        prepare(rd, 4, compose_config([line]), [f"hydra.run.dir={tmp_path}", line, "resume=true"])
        assert json.loads(rd.scale_request.read_text())["groups"] == left, line


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
        won = next(o for o in outcomes if isinstance(o, int))
        assert "another launch took it over at the same moment" in str(
            next(o for o in outcomes if isinstance(o, RunDirInUse)))
        assert won == 2
        # The loser may have written its lease just after the winner did: the winner writes its own back.
        wait_for(lambda: (LeaseRecord.read(rd) or LeaseRecord(0)).epoch == won, 10, "the winner's lease")
    finally:
        for lease in leases:
            lease.release()
        os.environ.pop(EPOCH_ENV, None)


def test_a_launch_whose_read_went_stale_is_refused_and_an_abandoned_claim_is_skipped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """B reads the released lease, then A takes the whole run before B claims: B is refused (it never
    takes the epoch after A's). A claim whose launch died before writing its lease is skipped once it is
    older than a lease period."""
    from toolkit.core import lease as lease_mod

    rd = RunDir(tmp_path)
    first = Lease(rd, 60)
    first.acquire()
    first.release()
    a, b = Lease(rd, 1.2), Lease(rd, 1.2)
    real = lease_mod.holder_gone

    def a_takes_the_run_meanwhile(rec: LeaseRecord, lease_s: float, now: float | None = None) -> str:
        monkeypatch.setattr(lease_mod, "holder_gone", real)
        assert a.acquire() == 2
        return real(rec, lease_s, now)

    try:
        monkeypatch.setattr(lease_mod, "holder_gone", a_takes_the_run_meanwhile)
        with pytest.raises(RunDirInUse, match="another launch took it over at the same moment"):
            b.acquire()
        assert not a.taken_over() and (LeaseRecord.read(rd) or LeaseRecord(0)).epoch == 2
        a.release()
        os.close(os.open(rd.lease_claim(3), os.O_CREAT | os.O_WRONLY))  # a launch died after claiming 3
        with pytest.raises(RunDirInUse, match="another launch took it over"):
            Lease(rd, 60).acquire()  # the claim may still be written: not skipped yet
        old = time.time() - 5
        os.utime(rd.lease_claim(3), (old, old))
        c = Lease(rd, 1.2)
        assert c.acquire() == 4
        c.release()
    finally:
        for lease in (a, b):
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
