"""Scaling on in-process objects: what settled means, and an allocation reusing a slot only once its
draining replica left. Scaling a real run: tests/integration/test_scale.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from toolkit.cluster import Cluster, Component
from toolkit.config import compose_config
from toolkit.core.names import process_name
from toolkit.core.rundir import RunDir
from toolkit.launch.scale import settled


def test_settled_means_exact_counts_ready_and_nothing_draining() -> None:
    st = {"applied_seq": 2, "groups": {"throughput": {"target": 1, "members": 1, "draining": 0, "ready": 1}}}
    assert settled(st, 2, {"throughput": 1})
    assert not settled(st, 3, {"throughput": 1})
    st["groups"]["throughput"]["ready"] = 3  # the router has not seen the drained ones leave yet
    assert not settled(st, 2, {"throughput": 1})


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
        return _Proc(process_name(group, index))

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
