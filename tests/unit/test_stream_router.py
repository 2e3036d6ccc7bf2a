"""Streamed updates at the router, a router in a thread with fake replicas: the chain's plan (ranks, who
is left out of a delta, a dense update when nobody holds the base), the answer, replicas left behind
out of dispatch until the trainer's dense copy, late replicas, engines that cannot stream. With real
processes (the sim's modelled link, real vLLM): tests/integration/test_stream_sim.py,
tests/cluster/vllm_routed/test_vllm_stream_routed.py."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from tests.helpers.procs import wait_for
from tests.helpers.router import FakeReplica, RouterThread, quiet, recv, status
from toolkit.core import protocol as P

M = TypeVar("M", bound=P.Message)

pytestmark = pytest.mark.timeout(60)


@contextlib.contextmanager
def router(tmp_path: Path, *streams: str) -> Iterator[tuple[RouterThread, list[FakeReplica], object]]:
    """A router in this process, one ready fake replica per entry of ``streams`` and a raw client socket."""
    from toolkit.config import compose_config
    from toolkit.launch.validation import validate

    cfg = compose_config(["groups=single", f"groups.throughput.replicas={max(1, len(streams))}", "router.heartbeat_s=5",
                          "router.probe_timeout_s=0.5"])
    validate(cfg)
    rt = RouterThread(cfg, tmp_path / "run")
    replicas: list[FakeReplica] = []
    client = rt.socket()
    try:
        for i, s in enumerate(streams):
            r = FakeReplica(rt, f"throughput-{i}", streams=s)
            r.become_ready()
            replicas.append(r)
        yield rt, replicas, client
    finally:
        client.close(0)
        for r in replicas:
            r.close()
        rt.close()


def announce(client, version: int, base: int = -1, target: str = "") -> P.StreamPlan:  # type: ignore[no-untyped-def]
    client.send_multipart(P.encode(P.StreamWeights(version, b"m", "127.0.0.1", 5000 + version, base, 30.0, target)))
    plan = until(client, P.StreamPlan)
    assert plan.version == version, plan
    return plan


def until(client, kind: type[M], asks: list[P.StreamWanted] | None = None) -> M:  # type: ignore[no-untyped-def]
    """The client's next ``kind`` message. The router's asks for a dense copy (``StreamWanted``) may come
    before it, again every ``router.probe_timeout_s`` while a replica waits for one: kept in ``asks``."""
    while True:
        msg = recv(client)
        if isinstance(msg, kind):
            return msg
        assert isinstance(msg, P.StreamWanted), msg
        if asks is not None:
            asks.append(msg)


def part(replica: FakeReplica) -> P.StreamWeights:
    """The next message ``replica`` gets that is not a readiness probe (answered: it serves on)."""
    while True:
        msg = replica.recv()
        if isinstance(msg, P.Generate) and msg.job == "__probe__":
            replica.send(P.Result(msg.request_id, output_token_ids=[7], replica_id=replica.replica_id))
            continue
        assert isinstance(msg, P.StreamWeights), msg
        return msg


def ready(rt: RouterThread) -> int:
    return status(rt).ready


def test_a_dense_update_chains_every_replica_and_answers_once_all_applied_it(tmp_path: Path) -> None:
    with router(tmp_path, "gloo", "model", "gloo") as (rt, (a, sim, b), client):
        plan = announce(client, 1)
        # The chain: the replicas that join it, in order, ranks 1.. (the trainer is 0); the sim models its link.
        assert plan.world == 3 and not plan.dense and not plan.error
        assert plan.replicas == [a.replica_id, b.replica_id, sim.replica_id]
        parts = {r.replica_id: part(r) for r in (a, sim, b)}
        assert [(parts[r.replica_id].rank, parts[r.replica_id].world) for r in (a, b, sim)] == [(1, 3), (2, 3), (0, 3)]
        assert all(p.master == "127.0.0.1" and p.port == 5001 and p.manifest == b"m" for p in parts.values())
        a.send(P.WeightsUpdated(1, a.replica_id))
        sim.send(P.WeightsUpdated(1, sim.replica_id))
        assert quiet(client, 0.3)  # one replica has not applied it yet
        b.send(P.WeightsUpdated(1, b.replica_id))
        done = recv(client)
        assert isinstance(done, P.WeightsUpdated) and done.version == 1 and done.replicas == 3 and not done.error
        st = wait_for(lambda: (s := _status(rt)).weights_version == 1 and s, what="the router's version")
        assert st.loading == []


def _status(rt: RouterThread) -> P.Status:
    from toolkit.client import router_status

    st = router_status(rt.frontend, 5.0, ctx=rt.ctx)
    assert st is not None
    return st


def test_a_replica_whose_apply_failed_leaves_dispatch_until_the_trainers_dense_copy(tmp_path: Path) -> None:
    with router(tmp_path, "gloo", "gloo") as (rt, (a, b), client):
        announce(client, 1)
        part(a), part(b)
        a.send(P.WeightsUpdated(1, a.replica_id))
        b.send(P.WeightsUpdated(1, b.replica_id, error="RuntimeError: staging version 1 failed: LinkBroken"))
        # The answer names b; b holds version 0 while a serves version 1: b is out of dispatch, and the
        # trainer is asked for a dense copy for it (the answer waits for weights.json: either comes first).
        asks: list[P.StreamWanted] = []
        done = until(client, P.WeightsUpdated, asks)
        wanted = asks[0] if asks else until(client, P.StreamWanted)
        assert done.replicas == 1 and b.replica_id in done.error and "LinkBroken" in done.error
        assert (wanted.version, wanted.replica_id) == (1, b.replica_id)
        wait_for(lambda: ready(rt) == 1, what="b out of dispatch")

        # The next update is a delta against version 1: b, which does not hold it, is left out.
        plan = announce(client, 2, base=1)
        assert plan.replicas == [a.replica_id] and plan.world == 2
        assert part(a).rank == 1
        a.send(P.WeightsUpdated(2, a.replica_id))
        asks = []
        done = until(client, P.WeightsUpdated, asks)
        assert done.version == 2 and done.replicas == 1 and not done.error
        assert all(w.replica_id == b.replica_id for w in asks)  # asked again for b's copy, nobody else's

        # The trainer's dense copy of version 2 for b: a chain of two; b serves again once it applied it.
        plan = announce(client, 2, target=b.replica_id)
        assert plan.replicas == [b.replica_id] and plan.world == 2 and plan.target == b.replica_id
        got = part(b)
        assert (got.rank, got.world, got.target) == (1, 2, b.replica_id)
        b.send(P.WeightsUpdated(2, b.replica_id))
        wait_for(lambda: ready(rt) == 2, what="b back in dispatch")


def test_a_delta_nobody_holds_the_base_of_is_asked_dense(tmp_path: Path) -> None:
    with router(tmp_path, "gloo") as (_, (a,), client):
        plan = announce(client, 4, base=3)
        assert plan.dense and not plan.replicas
        assert quiet(a.sock, 0.3)  # nothing was sent to the replica


def test_an_engine_that_cannot_stream_fails_the_update_at_once_naming_it(tmp_path: Path) -> None:
    with router(tmp_path, "gloo", "") as (_, (a, old), client):
        plan = announce(client, 1)
        assert old.replica_id in plan.error and "weights_transport=stream" in plan.error
        assert quiet(a.sock, 0.3)


def test_a_replica_that_registers_after_an_update_serves_only_once_it_has_it(tmp_path: Path) -> None:
    with router(tmp_path, "gloo") as (rt, (a,), client):
        announce(client, 1)
        part(a)
        a.send(P.WeightsUpdated(1, a.replica_id))
        assert isinstance(recv(client), P.WeightsUpdated)
        late = FakeReplica(rt, "throughput-1", streams="gloo")
        try:
            wanted = recv(client)
            assert isinstance(wanted, P.StreamWanted) and (wanted.version, wanted.replica_id) == (1, late.replica_id)
            late.become_ready()  # its probe passes, but it holds version 0 (and is asked for again meanwhile)
            assert ready(rt) == 1
            announce(client, 1, target=late.replica_id)
            assert part(late).target == late.replica_id
            late.send(P.WeightsUpdated(1, late.replica_id))
            wait_for(lambda: ready(rt) == 2, what="the late replica in dispatch")
        finally:
            late.close()


def test_an_update_with_no_replica_yet_is_the_runs_weights_for_the_first_that_registers(tmp_path: Path) -> None:
    with router(tmp_path) as (rt, _, client):
        plan = announce(client, 1)
        assert plan.replicas == [] and plan.world == 1
        done = recv(client)
        assert isinstance(done, P.WeightsUpdated) and done.version == 1 and done.replicas == 0
        first = FakeReplica(rt, "throughput-0", streams="gloo")
        try:
            wanted = recv(client)  # the run's weights are version 1: it is sent them before it serves
            assert isinstance(wanted, P.StreamWanted) and (wanted.version, wanted.replica_id) == (1, first.replica_id)
        finally:
            first.close()


def test_an_update_while_every_replica_takes_another_is_refused_at_once(tmp_path: Path) -> None:
    with router(tmp_path, "gloo") as (_, (a,), client):
        announce(client, 1)
        part(a)  # a takes version 1 and has not answered
        plan = announce(client, 2)
        assert plan.busy and "taking another update" in plan.error and a.replica_id in plan.error


def test_the_workers_of_a_tensor_parallel_replica_take_consecutive_ranks(tmp_path: Path) -> None:
    from toolkit.config import compose_config
    from toolkit.launch.validation import validate

    cfg = compose_config(["groups=single", "groups.throughput.replicas=2", "router.heartbeat_s=5"])
    validate(cfg)
    rt = RouterThread(cfg, tmp_path / "run")
    client = rt.socket()
    a = FakeReplica(rt, "throughput-0", streams="gloo", stream_ranks=2)
    b = FakeReplica(rt, "throughput-1", streams="gloo", stream_ranks=2)
    try:
        a.become_ready()
        b.become_ready()
        plan = announce(client, 1)
        assert plan.world == 5 and sorted(plan.replicas) == [a.replica_id, b.replica_id]
        got = {r.replica_id: (p.rank, p.world, p.prev) for r in (a, b) for p in [part(r)]}
        # In the plan's order, two ranks each: 1-2 and 3-4 (the trainer is 0); each replica's first worker
        # receives from the one before it (rank 0, then rank 1), and passes its workers their shares.
        assert [got[rid] for rid in plan.replicas] == [(1, 5, 0), (3, 5, 1)]
    finally:
        client.close(0)
        a.close()
        b.close()
        rt.close()


def _drain_asks(client, asks: list[P.Message]) -> None:  # type: ignore[no-untyped-def]
    while not quiet(client, 0.5):
        asks.append(recv(client))


def test_a_stream_is_answered_once_every_replica_of_its_plan_answered_not_at_its_first_failure(tmp_path: Path) -> None:
    """b fails at once while a is still applying: the trainer hears nothing until a answers; then that a
    applied it and b did not. a serves the version; b leaves dispatch for a dense copy of it."""
    with router(tmp_path, "gloo", "gloo") as (rt, (a, b), client):
        announce(client, 1)
        part(a), part(b)
        b.send(P.WeightsUpdated(1, b.replica_id, error="LinkBroken"))
        assert quiet(client, 0.5)  # a has not answered
        a.send(P.WeightsUpdated(1, a.replica_id))
        asks: list[P.Message] = []
        done = until(client, P.WeightsUpdated, asks)  # type: ignore[arg-type]
        assert done.replicas == 1 and b.replica_id in done.error
        _drain_asks(client, asks)
        assert {(w.version, w.replica_id) for w in asks} == {(1, b.replica_id)}  # b's copy; never a's
        wait_for(lambda: ready(rt) == 1, what="b out of dispatch")
        assert _status(rt).weights_version == 1


def test_a_resent_version_leaves_the_replicas_that_hold_it_off_its_chain(tmp_path: Path) -> None:
    """A replica holding the version would not join a chain for it again: the others would wait for it
    for the link's timeout. It counts as applied; a resend everyone holds is answered at once."""
    with router(tmp_path, "gloo", "gloo") as (_, (a, b), client):
        announce(client, 1)
        part(a), part(b)
        a.send(P.WeightsUpdated(1, a.replica_id))
        b.send(P.WeightsUpdated(1, b.replica_id, error="LinkBroken"))
        assert until(client, P.WeightsUpdated).replicas == 1
        plan = announce(client, 1)  # the trainer sends version 1 again, dense
        assert plan.replicas == [b.replica_id] and plan.world == 2
        assert part(b).rank == 1 and quiet(a.sock, 0.3)
        b.send(P.WeightsUpdated(1, b.replica_id))
        assert until(client, P.WeightsUpdated).replicas == 2
        plan = announce(client, 1)
        assert plan.replicas == [] and plan.world == 1
        assert until(client, P.WeightsUpdated).replicas == 2
        refused = announce(client, 1, target=a.replica_id)  # nor a dense copy to one that holds it
        assert "holds version 1 already" in refused.error


def test_a_failed_stream_leaves_nothing_loading_nothing_recorded_and_version_0_is_refused(tmp_path: Path) -> None:
    """No replica applied version 1: the run has no streamed weights (weights.json says so, for a restarted
    router), the replica serves on and is not 'loading' (its stall clock runs)."""
    from toolkit.router.weights import WeightSync

    with router(tmp_path, "gloo") as (rt, (a,), client):
        assert "start at 1" in announce(client, 0).error
        announce(client, 1)
        part(a)
        a.send(P.WeightsUpdated(1, a.replica_id, error="LinkBroken"))
        done = until(client, P.WeightsUpdated)
        assert done.replicas == 0 and "LinkBroken" in done.error
        st = _status(rt)
        assert st.loading == [] and st.weights_version == -1 and ready(rt) == 1
        files = rt.router.run_dir.router_weights
        wait_for(lambda: files.read_text() == "{}", what="weights.json rolled back")
        restarted = WeightSync(rt.router.run_dir, rt.router.files, rt.router.pool, lambda *a: None, lambda *a: None)
        assert restarted.latest is None and restarted.landed == -1

        # A version applied later, then one whose every replica fails: back to it, nothing loading.
        announce(client, 2)
        part(a)
        a.send(P.WeightsUpdated(2, a.replica_id))
        assert until(client, P.WeightsUpdated).replicas == 1
        announce(client, 3, base=2)
        part(a)
        a.send(P.WeightsUpdated(3, a.replica_id, error="WrongBase"))
        assert until(client, P.WeightsUpdated).replicas == 0
        st = _status(rt)
        assert st.loading == [] and st.weights_version == 2 and ready(rt) == 1


def test_a_plan_whose_replicas_all_left_is_a_failure_and_a_dense_copy_lands_the_version(tmp_path: Path) -> None:
    """The only replica restarts mid-update (it registers again): the trainer is told it failed (not
    'applied by 0', which would commit it as the base of the next delta). A version no replica was there
    for lands once a late one gets its dense copy: a run waiting for it (max_staleness) goes on."""
    with router(tmp_path, "gloo") as (rt, (a,), client):
        announce(client, 1)
        part(a)
        a.send(a.register)
        done = until(client, P.WeightsUpdated)
        assert done.replicas == 0 and "left before applying it" in done.error and a.replica_id in done.error

    with router(tmp_path / "late") as (rt, _, client):
        announce(client, 1)
        assert until(client, P.WeightsUpdated).replicas == 0  # no replica yet: answered at once
        late = FakeReplica(rt, "throughput-0", streams="gloo")
        try:
            assert until(client, P.StreamWanted).replica_id == late.replica_id
            late.become_ready()
            announce(client, 1, target=late.replica_id)
            part(late)
            late.send(P.WeightsUpdated(1, late.replica_id))
            wait_for(lambda: _status(rt).weights_version == 1, what="version 1 landed by the dense copy")
        finally:
            late.close()


def test_a_restarted_router_takes_out_of_dispatch_a_replica_behind_the_one_holding_the_runs_version(tmp_path: Path) -> None:
    import json

    from toolkit.config import compose_config
    from toolkit.core.rundir import RunDir
    from toolkit.launch.validation import validate

    cfg = compose_config(["groups=single", "groups.throughput.replicas=2", "router.heartbeat_s=5",
                          "router.probe_timeout_s=0.5"])
    validate(cfg)
    rd = RunDir(tmp_path / "run")
    rd.make()
    rd.router_weights.write_text(json.dumps({"path": "", "version": 2, "serial": 2}))
    rt = RouterThread(cfg, tmp_path / "run")
    behind = ahead = None
    try:
        assert _status(rt).weights_version == -1  # a streamed version counts once a replica holds it
        behind = FakeReplica(rt, "throughput-0", streams="gloo")
        behind.send(P.Register(behind.replica_id, "throughput", streams="gloo", weights=P.UpdateWeights("", 1, 1)))
        behind.become_ready()
        ahead = FakeReplica(rt, "throughput-1", streams="gloo")
        ahead.send(P.Register(ahead.replica_id, "throughput", streams="gloo", weights=P.UpdateWeights("", 2, 2)))
        ahead.become_ready()
        wait_for(lambda: ready(rt) == 1 and _status(rt).weights_version == 2, what="only the replica on version 2")
    finally:
        for r in (behind, ahead):
            if r is not None:
                r.close()
        rt.close()
