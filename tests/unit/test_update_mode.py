"""Weight updates at a replica on in-process objects (a fake engine): an engine that cannot update in
place drains, and pause keeps requests in the engine. With a real router and launches:
tests/integration/test_update_mode.py."""

from __future__ import annotations

import asyncio
import functools
import logging
from pathlib import Path

import pytest

from tests.helpers.requests import gen as request
from toolkit.config import compose_config
from toolkit.core import protocol as P
from toolkit.core.rundir import RunDir
from toolkit.engine.base import Engine, EngineInfo
from toolkit.engine.replica import ReplicaServer
from toolkit.launch.validation import validate

BUDGET = 300
gen = functools.partial(request, max_tokens=BUDGET)


# ---- the replica in process, fake engines --------------------------------------------------------
class FakeEngine(Engine):
    """Requests run until ``release`` is set; their Results carry no versions (the replica's part)."""

    def __init__(self, in_place: bool) -> None:
        self.in_place = in_place
        self.release = asyncio.Event()
        self.running = 0
        self.loads: list[tuple[str, int, int]] = []  # (how, version, requests running then)

    async def start(self) -> EngineInfo:
        return EngineInfo("fake", 100, 100)

    async def generate(self, req: P.Generate) -> P.Result:
        self.running += 1
        try:
            await self.release.wait()
        finally:
            self.running -= 1
        return P.Result(req.request_id, output_token_ids=[1, 2])

    async def abort(self, request_id: str) -> None:
        pass

    def stats(self) -> P.ReplicaStats:
        return P.ReplicaStats(running=self.running)

    async def close(self) -> None:
        pass

    async def load_weights(self, path: str, version: int) -> None:
        self.loads.append(("drain", version, self.running))
        self.weight_version = version

    async def update_weights_in_place(self, path: str, version: int) -> None:
        if not self.in_place:
            return await super().update_weights_in_place(path, version)
        self.loads.append(("pause", version, self.running))
        self.weight_version = version


async def until(pred, what: str) -> None:  # type: ignore[no-untyped-def]
    for _ in range(2000):
        if pred():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never: {what}")


def replica_with(engine: Engine, tmp_path: Path, mode: str) -> tuple[ReplicaServer, list[P.Message]]:
    cfg = compose_config([f"rollout.update_mode={mode}"])
    validate(cfg)
    srv = ReplicaServer(cfg, RunDir(tmp_path / "run"), "throughput", 0, engine)
    sent: list[P.Message] = []

    async def send(msg: P.Message) -> None:
        sent.append(msg)

    srv._send = send  # type: ignore[method-assign]
    return srv, sent


async def r1_running(eng: FakeEngine, tmp_path: Path) -> tuple[ReplicaServer, list[P.Message]]:
    """A replica in ``pause`` mode with request r1 running in ``eng``."""
    srv, sent = replica_with(eng, tmp_path, "pause")
    srv.tasks["r1"] = asyncio.create_task(srv._generate(gen("r1")))
    await until(lambda: eng.running == 1, "r1 in the engine")
    return srv, sent


def of(sent: list[P.Message], kind: type) -> list:  # type: ignore[type-arg]
    return [m for m in sent if isinstance(m, kind)]


def test_an_engine_that_cannot_update_in_place_drains_and_says_so_once(tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        eng = FakeEngine(in_place=False)
        srv, sent = await r1_running(eng, tmp_path)
        srv.weights.update(P.UpdateWeights("/ckpt/1", 1))
        await until(lambda: not srv.gate.is_open(), "the gate closed")
        await asyncio.sleep(0.05)
        assert eng.loads == [] and not of(sent, P.WeightsUpdated)  # it waits for r1
        eng.release.set()
        await until(lambda: of(sent, P.WeightsUpdated), "the acknowledgement")
        assert eng.loads == [("drain", 1, 0)]
        [res] = of(sent, P.Result)
        assert res.status == "ok" and res.weight_versions == [0] and res.weight_version == 0
        assert of(sent, P.WeightsUpdated)[0].error == ""
        srv.weights.update(P.UpdateWeights("/ckpt/2", 2))  # no second attempt, no second warning
        await until(lambda: len(of(sent, P.WeightsUpdated)) == 2, "the second acknowledgement")
        assert eng.loads == [("drain", 1, 0), ("drain", 2, 0)]
        srv.ctx.term()

    with caplog.at_level(logging.WARNING, logger="toolkit.engine.replica_weights"):
        asyncio.run(main())
    warned = [r for r in caplog.records if "cannot update weights while requests run" in r.getMessage()]
    assert len(warned) == 1


def test_pause_keeps_requests_in_the_engine_and_the_replica_lists_the_versions_it_saw(tmp_path: Path) -> None:
    async def main() -> None:
        eng = FakeEngine(in_place=True)
        srv, sent = await r1_running(eng, tmp_path)
        srv.weights.update(P.UpdateWeights("/ckpt/3", 3))
        await until(lambda: of(sent, P.WeightsUpdated), "the acknowledgement")
        assert eng.loads == [("pause", 3, 1)] and not of(sent, P.Result)  # acknowledged with r1 running
        srv.tasks["r2"] = asyncio.create_task(srv._generate(gen("r2")))
        await until(lambda: eng.running == 2, "r2 in the engine")
        eng.release.set()
        await until(lambda: len(of(sent, P.Result)) == 2, "both Results")
        got = {r.request_id: (r.weight_versions, r.weight_version) for r in of(sent, P.Result)}
        assert got == {"r1": ([0, 3], 3), "r2": ([3], 3)}
        srv.ctx.term()

    asyncio.run(main())


class StreamingEngine(FakeEngine):
    """Stages a streamed version until ``staged`` is set (or fails it with ``fail``), applies it at once."""

    def __init__(self, fail: str = "") -> None:
        super().__init__(in_place=True)
        self.staged = asyncio.Event()
        self.fail = fail
        self.discarded = 0

    async def stage_stream(self, msg: P.StreamWeights) -> None:
        await self.staged.wait()
        if self.fail:
            raise RuntimeError(self.fail)

    async def apply_stream(self, version: int) -> None:
        self.loads.append(("stream", version, self.running))
        self.weight_version = version

    async def discard_stream(self) -> None:
        self.discarded += 1


@pytest.mark.parametrize("mode", ["pause", "drain"])
def test_a_streamed_version_is_staged_while_requests_enter_and_applied_per_update_mode(tmp_path: Path, mode: str) -> None:
    async def main() -> None:
        eng = StreamingEngine()
        srv, sent = replica_with(eng, tmp_path, mode)
        srv.tasks["r1"] = asyncio.create_task(srv._generate(gen("r1")))
        await until(lambda: eng.running == 1, "r1 in the engine")
        srv.weights.stream(P.StreamWeights(5, b"", "127.0.0.1", 1, serial=2))
        # Staging: the gate stays open, a new request enters the engine.
        srv.tasks["r2"] = asyncio.create_task(srv._generate(gen("r2")))
        await until(lambda: eng.running == 2, "r2 in the engine while the update stages")
        assert srv.gate.is_open() and not of(sent, P.WeightsUpdated)
        eng.staged.set()
        if mode == "pause":  # applied with both running, which go on with version 5
            await until(lambda: of(sent, P.WeightsUpdated), "the acknowledgement")
            assert eng.loads == [("stream", 5, 2)] and not of(sent, P.Result)
            eng.release.set()
        else:  # the gate closes, the running requests finish on version 0, then it applies
            await until(lambda: not srv.gate.is_open(), "the gate closed")
            assert not eng.loads
            eng.release.set()
            await until(lambda: of(sent, P.WeightsUpdated), "the acknowledgement")
            assert eng.loads == [("stream", 5, 0)]
        await until(lambda: len(of(sent, P.Result)) == 2, "both Results")
        want = [0, 5] if mode == "pause" else [0]
        assert {r.request_id: r.weight_versions for r in of(sent, P.Result)} == {"r1": want, "r2": want}
        assert of(sent, P.WeightsUpdated)[0] == P.WeightsUpdated(5, srv.replica_id)
        assert srv.weights.held == P.UpdateWeights("", 5, 2)  # what it registers with from now on
        srv.ctx.term()

    asyncio.run(main())


def test_a_stream_that_fails_to_stage_changes_nothing_and_says_why(tmp_path: Path) -> None:
    async def main() -> None:
        eng = StreamingEngine(fail="LinkBroken: rank 0 went away")
        srv, sent = replica_with(eng, tmp_path, "pause")
        srv.weights.stream(P.StreamWeights(5, b"", "127.0.0.1", 1))
        eng.staged.set()
        await until(lambda: of(sent, P.WeightsUpdated), "the answer")
        [ack] = of(sent, P.WeightsUpdated)
        assert ack.version == 5 and "LinkBroken" in ack.error
        # The engine's failed stage left nothing staged: nothing to discard (vLLM refuses a second one).
        assert eng.loads == [] and eng.discarded == 0 and srv.weights.held is None and srv.gate.is_open()
        srv.ctx.term()

    asyncio.run(main())


def test_a_staged_stream_given_up_at_the_gate_is_discarded(tmp_path: Path) -> None:
    async def main() -> None:
        eng = StreamingEngine()
        srv, sent = replica_with(eng, tmp_path, "drain")
        srv.tasks["r1"] = asyncio.create_task(srv._generate(gen("r1")))
        await until(lambda: eng.running == 1, "r1 in the engine")
        srv.weights.stream(P.StreamWeights(5, b"", "127.0.0.1", 1))
        eng.staged.set()
        await until(lambda: not srv.gate.is_open(), "the gate closed, waiting for r1")
        [task] = [t for t in srv._background if t.get_name() == "stream-5"]
        task.cancel()  # the replica stops before r1 finished
        await asyncio.gather(task, return_exceptions=True)
        assert eng.discarded == 1 and eng.loads == [] and srv.weights.held is None and srv.weights.loading is None
        eng.release.set()
        await until(lambda: of(sent, P.Result), "r1's Result")
        srv.ctx.term()

    asyncio.run(main())


def test_a_stream_of_another_version_while_one_loads_is_refused_not_staged_beside_it(tmp_path: Path) -> None:
    """Two stages at once would end each other's transfer session in vLLM: the second is answered with an
    error at once; the first goes on and lands."""
    async def main() -> None:
        eng = StreamingEngine()
        srv, sent = replica_with(eng, tmp_path, "pause")
        srv.weights.stream(P.StreamWeights(5, b"", "127.0.0.1", 1))
        srv.weights.stream(P.StreamWeights(6, b"", "127.0.0.1", 2))
        await until(lambda: of(sent, P.WeightsUpdated), "the refusal")
        [busy] = of(sent, P.WeightsUpdated)
        assert busy.version == 6 and "still loading weights version 5" in busy.error
        eng.staged.set()
        await until(lambda: len(of(sent, P.WeightsUpdated)) == 2, "version 5's answer")
        assert of(sent, P.WeightsUpdated)[1] == P.WeightsUpdated(5, srv.replica_id) and eng.loads == [("stream", 5, 0)]
        srv.ctx.term()

    asyncio.run(main())
