"""A replica stopped from outside (SIGTERM: a preemption, a kill) says ``Leaving``: the router takes its
requests back at once, not after missed heartbeats, and counts no engine death against them. A router in a
thread with fake replicas; the replica's side (it says so on SIGTERM) runs in
tests/integration/test_lifecycle.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import zmq

from tests.helpers.requests import gen
from tests.helpers.router import FakeReplica, RouterThread, recv
from toolkit.core import protocol as P

pytestmark = pytest.mark.timeout(60)


def test_a_leaving_replicas_request_runs_elsewhere_at_once_and_no_death_is_counted(tmp_path: Path) -> None:
    from toolkit.config import compose_config
    from toolkit.launch.validation import validate

    # One death would fail the request (poison), and the heartbeats are far apart: only Leaving moves it.
    cfg = compose_config(["groups=single", "groups.throughput.replicas=2", "router.heartbeat_s=30",
                          "router.max_engine_deaths=1"])
    validate(cfg)
    rt = RouterThread(cfg, tmp_path / "run")
    a, b = FakeReplica(rt, "throughput-0", max_inflight=1), FakeReplica(rt, "throughput-1", max_inflight=1)
    client = rt.socket()
    try:
        a.become_ready()
        b.become_ready()
        client.send_multipart(P.encode(gen("r1", session="s")))
        poller = zmq.Poller()
        for r in (a, b):
            poller.register(r.sock, zmq.POLLIN)
        ready = dict(poller.poll(10_000))
        first, other = (a, b) if a.sock in ready else (b, a)
        msg = first.recv()
        assert isinstance(msg, P.Generate) and msg.request_id == "r1"
        first.send(P.Leaving("stopped from outside (Terminated)"))
        again = other.recv()  # within the test's timeout: long before a missed heartbeat (90 s)
        assert isinstance(again, P.Generate) and again.request_id == "r1"
        other.send(P.Result("r1", output_token_ids=[9, 9], replica_id=other.replica_id))
        res = recv(client)
        assert isinstance(res, P.Result) and res.status == "ok" and res.output_token_ids == [9, 9], res
    finally:
        client.close(0)
        a.close()
        b.close()
        rt.close()
