"""A replica's heartbeats, in process (a stand-in engine): a beat that fails costs that beat; a replica
that cannot beat at all ends (exit 75: the cluster replaces it) instead of serving unseen."""

from __future__ import annotations

import asyncio
from pathlib import Path

from toolkit.config import compose_config
from toolkit.core import protocol as P
from toolkit.core.rundir import RunDir
from toolkit.engine.base import Engine, EngineGone, EngineInfo
from toolkit.engine.replica import ReplicaServer
from toolkit.launch.validation import validate


class StatsFail(Engine):
    """An engine whose counters raise on the beats listed in ``bad`` (counted from 1)."""

    def __init__(self, bad: set[int]) -> None:
        self.bad, self.calls = bad, 0

    async def start(self) -> EngineInfo:
        return EngineInfo("fake", 100, 100)

    async def generate(self, req: P.Generate) -> P.Result:
        return P.Result(req.request_id)

    async def abort(self, request_id: str) -> None:
        pass

    def stats(self) -> P.ReplicaStats:
        self.calls += 1
        if self.calls in self.bad:
            raise ZeroDivisionError("division by zero")
        return P.ReplicaStats()

    async def close(self) -> None:
        pass


def _beats(tmp_path: Path, bad: set[int], calls: int) -> tuple[list[P.Message], BaseException | None]:
    """The messages of a replica's heartbeats until its engine's counters were read ``calls`` times, or
    until the heartbeats ended (within 30 s either way)."""
    cfg = compose_config(["router.heartbeat_s=0.01", "router.missed_heartbeats=3"])
    validate(cfg)
    engine = StatsFail(bad)
    srv = ReplicaServer(cfg, RunDir(tmp_path / "run"), "throughput", 0, engine)
    sent: list[P.Message] = []

    async def send(msg: P.Message) -> None:
        sent.append(msg)

    srv._send = send  # type: ignore[method-assign]

    async def main() -> None:
        task = asyncio.create_task(srv._heartbeats())
        async with asyncio.timeout(30):
            while engine.calls < calls and not task.done():
                await asyncio.sleep(0.01)
        task.cancel()

    try:
        asyncio.run(main())
    finally:
        srv.ctx.term()
    return sent, srv._fatal


def test_a_failed_beat_costs_that_beat(tmp_path: Path) -> None:
    sent, fatal = _beats(tmp_path, {2, 4, 5}, 8)
    assert fatal is None and sum(isinstance(m, P.Heartbeat) for m in sent) >= 5


def test_a_replica_that_cannot_beat_ends(tmp_path: Path) -> None:
    sent, fatal = _beats(tmp_path, set(range(3, 1000)), 1000)
    assert isinstance(fatal, EngineGone) and "failed 3 times in a row" in str(fatal)
    assert sum(isinstance(m, P.Heartbeat) for m in sent) == 2
