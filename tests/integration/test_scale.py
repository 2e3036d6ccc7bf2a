"""Elastic groups: ``python -m toolkit.launch.scale`` on a running run (real launch, router, sim replicas)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import finish, start_launch, wait_for
from tests.test_launch import assert_no_process_left, check_outputs
from toolkit.cluster import Cluster, Component
from toolkit.config import compose_config, save_run_config
from toolkit.core.errors import ConfigError, ToolkitError
from toolkit.core.rundir import RunDir
from toolkit.launch.scale import _parse, request, settled


def _scale(run: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "toolkit.launch.scale", str(run), *args], capture_output=True, text=True,
                          timeout=150)


def test_scale_requests_are_checked_before_they_reach_the_run(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        _parse(["throughput=4", "tail", "x=-1"])
    assert [e.field for e in err.value.errors] == ["tail", "x=-1"]
    rd = RunDir(tmp_path)
    rd.make()
    save_run_config(compose_config([]), rd.config)
    with pytest.raises(ConfigError) as err:
        request(tmp_path, {"throughput": 2, "bogus": 1, "tail": -1})
    assert {e.field for e in err.value.errors} == {"bogus", "tail"}
    assert "one of the run's groups ['tail', 'throughput']" in str(err.value)
    with pytest.raises(ToolkitError, match="no launch is running"):
        request(tmp_path, {"throughput": 2})
    assert not rd.scale_request.exists()


def test_settled_means_exact_counts_ready_and_nothing_draining() -> None:
    st = {"applied_seq": 2, "groups": {"throughput": {"target": 1, "members": 1, "draining": 0, "ready": 1}}}
    assert settled(st, 2, {"throughput": 1})
    assert not settled(st, 3, {"throughput": 1})
    st["groups"]["throughput"]["ready"] = 3  # the router has not seen the drained ones leave yet
    assert not settled(st, 2, {"throughput": 1})


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_scaling_a_group_up_and_down_mid_run_loses_and_duplicates_no_session(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = start_launch([f"hydra.run.dir={run}", "engine.time_scale=0.5", "steps=8", "sessions_per_step=32"])
    try:
        wait_for(lambda: (run / "steps" / "step_00000.json").exists(), 120, "the first step")
        up = _scale(run, "throughput=4", "--wait", "120")
        assert up.returncode == 0, up.stdout + up.stderr
        assert "throughput: target 4, started 4, ready 4, draining 0" in up.stdout
        # Down mid-step: the three highest replicas drain, what they hold migrates to throughput-0.
        down = _scale(run, "throughput=1", "--wait", "120")
        assert down.returncode == 0, down.stdout + down.stderr
        assert "throughput: target 1, started 1, ready 1, draining 0" in down.stdout
        finished = _scale(run, "tail=0", "throughput=2", "--finish", "--wait", "120")
        assert finished.returncode == 0, finished.stdout + finished.stderr
    finally:
        output = finish(proc, 240)
    assert proc.returncode == 0, output
    steps = check_outputs(run, steps=8, sessions=32)  # every session exactly once, complete
    report = json.loads((run / "report.json").read_text())
    s = report["summary"]
    assert (s["replicas_added"], s["replicas_removed"], s["replica_restarts"]) == (3, 4, 0), s
    kinds = [e["kind"] for e in report["interruptions"]]
    assert kinds.count("replica_added") == 3 and kinds.count("replica_removed") == 4
    assert sum(len(st["interruptions"]) for st in steps) >= 1
    assert report["router"].get("duplicates", 0) == 0  # no client had to resend: no answer was lost
    assert all(st["requests_by_status"].keys() == {"ok"} for st in steps), [st["requests_by_status"] for st in steps]
    assert_no_process_left(run)


class _Proc(Component):
    """A component that is alive until told otherwise (the backend is not what is tested here)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.running = True

    def alive(self) -> bool:
        return self.running

    def state(self) -> str:
        return "RUNNING" if self.running else "COMPLETED"

    def exit_code(self) -> int | None:
        return None if self.running else 0

    def cancel(self) -> None:
        self.running = False

    def kill(self) -> None:
        self.running = False

    def refs(self) -> list:  # type: ignore[type-arg]
        return []


class _Allocation(Cluster):
    """Room for two throughput replicas, as an sbatch allocation sized for two."""

    def start_router(self) -> Component:
        raise NotImplementedError

    def start_replica(self, group: str, index: int) -> Component:
        return _Proc(f"replica-{group}-{index}")

    def start_ranks(self, n: int, first_step: int = 0) -> Component:
        raise NotImplementedError

    def max_replicas(self, group: str) -> int | None:
        return 2


def test_an_allocation_reuses_a_slot_only_once_its_draining_replica_left(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from toolkit.core.lifecycle import ProcessRef
    from toolkit.core.rundir import atomic_write
    from toolkit.launch import replicas as replicas_mod
    from toolkit.launch.replicas import ReplicaSet

    drains: list[list[str]] = []
    monkeypatch.setattr(replicas_mod, "send_drain", lambda addr, names, migrate, **kw: drains.append(names))
    cfg = compose_config(["groups.throughput.replicas=2"])
    rd = RunDir(tmp_path)
    rd.make()
    rs = ReplicaSet(cfg, _Allocation(cfg, rd, ProcessRef.self()), rd)
    rs.start()
    assert sorted(rs.members) == [("tail", 0), ("throughput", 0), ("throughput", 1)]
    atomic_write(rd.scale_request, json.dumps({"seq": 1, "groups": {"throughput": 1}}))
    rs.tick("tcp://router", None)
    assert sorted(rs.draining) == [("throughput", 1)] and drains == [["throughput-1"]]
    atomic_write(rd.scale_request, json.dumps({"seq": 2, "groups": {"throughput": 2}}))
    rs.tick("tcp://router", None)
    assert ("throughput", 1) not in rs.members and rs.count("throughput") == 1  # its slot is not free yet
    rs.draining[("throughput", 1)].comp.cancel()  # the drained replica exits
    rs.tick("tcp://router", None)
    assert ("throughput", 1) in rs.members and not rs.draining and rs.count("throughput") == 2
    atomic_write(rd.scale_request, json.dumps({"seq": 3, "groups": {"throughput": 5}}))
    rs.tick("tcp://router", None)
    assert rs.count("throughput") == 2 and "room for 2" in rs.error
    kinds = [e["kind"] for e in rd.read_events()]
    assert kinds == ["replica_draining", "replica_removed", "replica_added"]
