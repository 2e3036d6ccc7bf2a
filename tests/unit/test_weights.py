"""Weight reloads at the router, a router in a thread with fake replicas: updates while the file system
hangs, loads past their bound, restarted routers and the weights replicas hold. With real router and
sim replica processes (every replica acknowledges, results carry versions, ``rollout.weights_dir``
reaches the Parquet): tests/integration/test_weights.py. The published-checkpoint rules and
``rollout.max_staleness`` are in ``tests/unit/test_handshake.py``."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.aio import with_client
from tests.helpers.procs import wait_for
from tests.helpers.requests import gen as _gen
from toolkit.client import RouterClient, router_status
from toolkit.core import protocol as P

gen = functools.partial(_gen, max_tokens=16)


@contextlib.contextmanager
def fake_router(tmp_path: Path, overrides: tuple[str, ...] = ("router.heartbeat_s=5",)):  # type: ignore[no-untyped-def]
    """A router in this process, one ready fake replica and a raw client socket."""
    from tests.helpers.router import FakeReplica, RouterThread
    from toolkit.config import compose_config
    from toolkit.launch.validation import validate

    cfg = compose_config(["groups=single", *overrides])
    validate(cfg)
    rt = RouterThread(cfg, tmp_path / "run")
    try:
        replica = FakeReplica(rt, "throughput-0")
        replica.become_ready()
        client = rt.socket()
        yield rt, replica, client
        client.close(0)
        replica.close()
    finally:
        rt.close()


@contextlib.contextmanager
def one_replica(tmp_path: Path, monkeypatch, disk: Callable[[Path, bytes | str], None]):  # type: ignore[no-untyped-def]
    """:func:`fake_router` whose ``atomic_write`` is ``disk``."""
    import toolkit.core.rundir as rundir

    monkeypatch.setattr(rundir, "atomic_write", disk)
    with fake_router(tmp_path) as (_, replica, client):
        yield replica, client


def update_loaded_everywhere(replica, client, version: int) -> None:  # type: ignore[no-untyped-def]
    """The client asks for ``version``; the replica gets it and acknowledges."""
    client.send_multipart(P.encode(P.UpdateWeights(f"/ckpt/{version}", version)))
    got = replica.recv()
    assert isinstance(got, P.UpdateWeights) and got.version == version
    replica.send(P.WeightsUpdated(version, replica.replica_id))


@pytest.mark.timeout(60)
def test_the_router_forwards_an_update_while_the_file_system_hangs(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The router keeps ``weights.json`` for a restarted router, but an fsync on a busy disk or a shared
    file system can take seconds: the replicas get the update at once, and the client its answer once
    the file is written (a router restarted after the answer must not hand out older weights)."""
    from tests.helpers.router import quiet, recv

    with weights_record_hung(tmp_path, monkeypatch) as (replica, client, release):
        update_loaded_everywhere(replica, client, 3)  # while the file's write hangs
        assert quiet(client, 1.0)  # loaded everywhere, but not yet on disk: no answer
        assert not (tmp_path / "run" / "weights.json").exists()
        release.set()
        ack = recv(client)
        assert isinstance(ack, P.WeightsUpdated) and (ack.version, ack.replicas, ack.error) == (3, 1, "")
        assert json.loads((tmp_path / "run" / "weights.json").read_text()) == {"path": "/ckpt/3", "version": 3,
                                                                             "serial": 1}


@contextlib.contextmanager
def weights_record_hung(tmp_path: Path, monkeypatch):  # type: ignore[no-untyped-def]
    """:func:`one_replica` whose router's write of ``weights.json`` hangs until the event it yields is set."""
    import toolkit.core.rundir as rundir

    release = threading.Event()
    real = rundir.atomic_write

    def hung_disk(path: Path, data: bytes | str) -> None:
        if path.name == "weights.json":
            assert release.wait(30)
        real(path, data)

    try:
        with one_replica(tmp_path, monkeypatch, hung_disk) as (replica, client):
            try:
                yield replica, client, release
            finally:
                release.set()  # before the router stops: its thread may be in the hung write
    finally:
        release.set()


@pytest.mark.timeout(60)
def test_an_update_the_router_cannot_record_fails_and_a_resend_records_it(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A failed write of ``weights.json`` (a full disk) is the client's error, naming the file; updating
    again writes it again."""
    import toolkit.core.rundir as rundir
    from tests.helpers.router import recv

    full = [True]
    real = rundir.atomic_write

    def full_disk(path: Path, data: bytes | str) -> None:
        if path.name == "weights.json" and full[0]:
            raise OSError(28, "No space left on device")
        real(path, data)

    with one_replica(tmp_path, monkeypatch, full_disk) as (replica, client):
        update_loaded_everywhere(replica, client, 3)
        ack = recv(client)
        assert isinstance(ack, P.WeightsUpdated) and ack.replicas == 1
        assert "weights.json" in ack.error and "No space left on device" in ack.error
        full[0] = False
        client.send_multipart(P.encode(P.UpdateWeights("/ckpt/3", 3)))  # the client updates again
        ack = recv(client)
        assert isinstance(ack, P.WeightsUpdated) and (ack.version, ack.replicas, ack.error) == (3, 1, "")
        assert json.loads((tmp_path / "run" / "weights.json").read_text()) == {"path": "/ckpt/3", "version": 3,
                                                                                 "serial": 1}


@pytest.mark.timeout(60)
def test_a_replica_loading_weights_is_not_taken_for_a_stalled_one(tmp_path: Path) -> None:
    """A load pauses generation with requests in the engine (update_mode=pause): no token for a while
    is the load, not a hang; once it is acknowledged the stall clock runs again."""
    import time

    from tests.helpers.router import recv, status

    with fake_router(tmp_path, ("router.heartbeat_s=0.2", "router.missed_heartbeats=100",
                                "router.stall_timeout_s=0.5")) as (rt, replica, client):
        client.send_multipart(P.encode(gen("r1")))
        assert isinstance(replica.recv(), P.Generate)
        client.send_multipart(P.encode(P.UpdateWeights(str(tmp_path), 1)))
        assert isinstance(replica.recv(), P.UpdateWeights)
        beat = P.Heartbeat(replica.replica_id, P.ReplicaStats(running=1))  # no token generated: the engine is paused
        for _ in range(20):  # many stall timeouts
            replica.send(beat)
            time.sleep(0.1)
        assert status(rt).ready == 1
        replica.send(P.WeightsUpdated(1, replica.replica_id))
        answer = recv(client)
        assert isinstance(answer, P.WeightsUpdated) and answer.replicas == 1 and not answer.error

        def dropped() -> bool:
            replica.send(beat)
            return status(rt).registered == 0

        wait_for(dropped, 20, "the replica, loaded and still generating nothing, to be dropped as stalled")


@pytest.mark.timeout(60)
def test_a_load_past_its_bound_fails_naming_the_replicas_still_loading(tmp_path: Path) -> None:
    """A replica that never acknowledges (a hung file system under its checkpoint) ends the update after
    ``rollout.load_timeout_s`` with an error that names it; status lists it while it loads."""
    from toolkit.client import WeightsUpdateFailed
    from toolkit.core.rundir import RunDir

    with fake_router(tmp_path) as (rt, replica, client):

        async def body(c: RouterClient) -> None:
            with pytest.raises(WeightsUpdateFailed, match=r"within 1s; still loading: throughput-0@"):
                await c.update_weights(str(tmp_path), 4, timeout_s=1.0, resend_s=0.2)

        asyncio.run(with_client(RunDir(tmp_path / "run"), body))
        assert isinstance(replica.recv(), P.UpdateWeights)  # it got the update, and stays silent

        def loading() -> list[str]:
            st = router_status(rt.frontend, 5.0, ctx=rt.ctx)
            assert st is not None
            return st.loading

        assert loading() == [replica.replica_id]
        replica.send(P.WeightsUpdated(4, replica.replica_id))
        wait_for(lambda: loading() == [], 10, "the replica's acknowledgement")


@pytest.mark.timeout(60)
def test_a_load_whose_record_hangs_says_so(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Every replica loaded the weights, but the router's write of weights.json hangs (the shared file
    system under the run dir): the timeout says that, rather than 'still loading: none'."""
    from toolkit.core.rundir import RunDir

    with weights_record_hung(tmp_path, monkeypatch) as (replica, _, _):

        def loads() -> None:
            got = replica.recv()
            replica.send(P.WeightsUpdated(got.version, replica.replica_id))

        loader = threading.Thread(target=loads, daemon=True)
        loader.start()

        async def body(c: RouterClient) -> None:
            update = asyncio.ensure_future(c.update_weights(str(tmp_path), 4, timeout_s=60, resend_s=0.2))
            for _ in range(200):  # the replica has acknowledged: only the record holds the answer
                if not loader.is_alive() and not (await c.status(timeout_s=5.0)).loading:
                    break
                await asyncio.sleep(0.05)
            # What the update's timeout says now (it is not waited for: a bound, not a state).
            why = await c._not_loaded(str(tmp_path), 4, 60)
            assert "every replica acknowledged them, but the router has not answered: its write of " \
                   "weights.json" in why, why
            assert not update.done()
            update.cancel()
            with pytest.raises(asyncio.CancelledError):
                await update

        asyncio.run(with_client(RunDir(tmp_path / "run"), body))
        loader.join(10)


@pytest.mark.timeout(60)
def test_a_restarted_router_takes_the_newer_weights_a_replica_holds(tmp_path: Path) -> None:
    """The previous router forwarded version 5 and died before recording it (weights.json says 4, the
    fourth update): a replica that registers holding 5, handed out as the fifth, makes 5 the run's weights, so a replica registered on 4 loads 5
    (not 4, then 5 on the trainer's resend) and a later one gets 5 at once; a client's update then
    rules as always."""
    from tests.helpers.router import FakeReplica, recv

    with restarted_router(tmp_path, {"path": "/ckpt/4", "version": 4, "serial": 4}) as (rt, rd):
        on_old = FakeReplica(rt, "throughput-0")
        assert recv(on_old.sock) == P.UpdateWeights("/ckpt/4", 4, 4)  # what the file says
        holder = holding(rt, 1, "/ckpt/5", 5, 5)
        got = [recv(on_old.sock) for _ in range(2)]  # its probe, and version 5
        assert P.UpdateWeights("/ckpt/5", 5, 5) in got
        first = recv(holder.sock)
        assert isinstance(first, P.Generate) and first.job == "__probe__"  # no reload: it holds them
        wait_for(lambda: json.loads(rd.router_weights.read_text())["version"] == 5, 10, "weights.json at 5")
        late = FakeReplica(rt, "throughput-2")
        assert recv(late.sock) == P.UpdateWeights("/ckpt/5", 5, 5)
        # A client's update is the run's, whatever a replica registering later holds.
        client = rt.socket()
        client.send_multipart(P.encode(P.UpdateWeights("/ckpt/3", 3)))  # a rollback
        assert P.UpdateWeights("/ckpt/3", 3, 6) in [recv(late.sock) for _ in range(2)]
        again = holding(rt, 3, "/ckpt/5", 5, 5)
        assert recv(again.sock) == P.UpdateWeights("/ckpt/3", 3, 6)
        # A replica holding one handed out under a serial above the run's (by a router that died before
        # recording it): the client's next update is numbered above it, so no two checkpoints share one.
        ahead = holding(rt, 4, "/ckpt/7", 7, 8)
        assert recv(ahead.sock) == P.UpdateWeights("/ckpt/3", 3, 6)
        client.send_multipart(P.encode(P.UpdateWeights("/ckpt/9", 9)))
        assert P.UpdateWeights("/ckpt/9", 9, 9) in [recv(ahead.sock) for _ in range(2)]
        for s in (on_old.sock, holder.sock, late.sock, again.sock, ahead.sock, client):
            s.close(0)


@pytest.mark.timeout(60)
def test_a_restarted_router_keeps_a_rollback_a_replica_missed(tmp_path: Path) -> None:
    """A client rolled the run back from version 5 to 3 (the sixth update, recorded), and the router died
    before a replica that missed the rollback (draining, or its load failed) loaded 3. The replica
    registers with the restarted router holding 5, a higher version than the file's but handed out
    before it: the router keeps 3 and tells it to load 3 (a version comparison would have made 5 the
    run's again, and every replica would have generated on the weights the trainer rolled back from)."""
    from tests.helpers.router import recv

    with restarted_router(tmp_path, {"path": "/ckpt/3", "version": 3, "serial": 6}) as (rt, rd):
        behind = holding(rt, 0, "/ckpt/5", 5, 5)
        assert recv(behind.sock) == P.UpdateWeights("/ckpt/3", 3, 6)
        up_to_date = holding(rt, 1, "/ckpt/3", 3, 6)
        first = recv(up_to_date.sock)
        assert isinstance(first, P.Generate) and first.job == "__probe__"  # it holds the run's: no reload
        assert json.loads(rd.router_weights.read_text())["version"] == 3
        for s in (behind.sock, up_to_date.sock):
            s.close(0)


@pytest.mark.timeout(60)
def test_a_replica_that_registers_again_after_a_failed_load_is_handed_the_weights(tmp_path: Path) -> None:
    """Its engine restarted after a failed load (it holds nothing now) and it registers again before the
    router dropped it: the failed acknowledgement of its earlier registration must not count as this
    one's, which would leave it without the run's weights until the next update."""
    from tests.helpers.router import recv

    with fake_router(tmp_path) as (rt, replica, client):
        client.send_multipart(P.encode(P.UpdateWeights("/ckpt/1", 1)))
        assert replica.recv() == P.UpdateWeights("/ckpt/1", 1, 1)
        replica.send(P.WeightsUpdated(1, replica.replica_id, error="OSError: stale file handle"))
        assert isinstance(recv(client), P.WeightsUpdated)  # the failure, answered
        replica.send(replica.register)
        got = [replica.recv() for _ in range(2)]  # the weights, and its probe
        assert P.UpdateWeights("/ckpt/1", 1, 1) in got

@contextlib.contextmanager
def restarted_router(tmp_path: Path, recorded: dict[str, Any]):  # type: ignore[no-untyped-def]
    """A router (in this process) started on a run dir whose ``weights.json`` says ``recorded``, as a
    restarted router of the run is; yields it and the run dir."""
    from tests.helpers.router import RouterThread
    from toolkit.config import compose_config
    from toolkit.core.rundir import RunDir
    from toolkit.launch.validation import validate

    cfg = compose_config(["groups=single", "router.heartbeat_s=5"])
    validate(cfg)
    rd = RunDir(tmp_path / "run")
    rd.make()
    rd.router_weights.write_text(json.dumps(recorded))
    rt = RouterThread(cfg, rd.root)
    try:
        yield rt, rd
    finally:
        rt.close()


def holding(rt, index: int, path: str, version: int, serial: int):  # type: ignore[no-untyped-def]
    """A fake replica that registers holding checkpoint ``path`` as ``version``, handed out as ``serial``."""
    from tests.helpers.router import FakeReplica

    replica = FakeReplica.__new__(FakeReplica)
    replica.replica_id, replica.sock = f"throughput-{index}@testhost:1", rt.socket(f"throughput-{index}@testhost:1")
    replica.send(P.Register(replica.replica_id, "throughput", max_inflight=4,
                            weights=P.UpdateWeights(path, version, serial)))
    return replica


@pytest.mark.timeout(60)
def test_a_replica_whose_engine_dies_loading_still_gives_the_update_its_failure(tmp_path: Path) -> None:
    """A checkpoint vLLM cannot read kills the engine mid-load: the requests in it end ``engine_dead``
    (the replica leaves service) before its failed acknowledgement arrives. The answer waits for that
    acknowledgement and carries its failure, rather than counting the replicas serving now (none)."""
    from tests.helpers.router import quiet, recv, status

    with fake_router(tmp_path, ("router.heartbeat_s=0.2", "router.missed_heartbeats=100")) as (rt, replica, client):
        client.send_multipart(P.encode(gen("r1")))
        running = replica.recv()
        assert isinstance(running, P.Generate)
        client.send_multipart(P.encode(P.UpdateWeights(str(tmp_path), 1)))
        assert isinstance(replica.recv(), P.UpdateWeights)
        replica.send(P.Result(running.request_id, status="engine_dead", error="engine died loading",
                              replica_id=replica.replica_id))
        wait_for(lambda: status(rt).ready == 0, 10, "the replica out of service")
        assert quiet(client, 0.5)  # sweeps pass (every 0.1 s): the asked replica has not answered yet
        replica.send(P.WeightsUpdated(1, replica.replica_id, error="RuntimeError: bad checkpoint"))
        answer = recv(client)
        assert isinstance(answer, P.WeightsUpdated) and answer.version == 1 and answer.replicas == 0
        assert replica.replica_id in answer.error and "bad checkpoint" in answer.error
