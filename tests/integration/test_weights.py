"""Weight reloads with real router and sim replica processes: every replica acknowledges, results
carry versions, a restarted router adopts the latest weights, and a launch loads step checkpoints.
The router's side with fake replicas: tests/unit/test_weights.py."""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.helpers.aio import with_client
from tests.helpers.procs import launch, wait_for
from tests.helpers.requests import gen as _gen
from toolkit.client import RouterClient, router_status

FAST = ["engine.time_scale=0.05", "router.heartbeat_s=0.2"]
gen = functools.partial(_gen, max_tokens=16)


def test_reload_reaches_every_replica_and_versions_every_result(make_run, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    # drain: the request in the engine finishes on the old weights (pause: tests/integration/test_update_mode.py).
    cfg, rd, stack = make_run([*FAST, "rollout.update_mode=drain", "router.probe_timeout_s=0.5"])
    stack.start(timeout_s=30)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()

    async def body(c: RouterClient) -> None:
        before, _ = await c.generate(gen("before"))
        assert before.status == "ok" and before.weight_version == 0
        # One request in the engine when the update arrives, one sent right after it.
        inflight = asyncio.create_task(c.generate(gen("inflight", max_tokens=200)))
        await asyncio.sleep(0.05)
        update = asyncio.create_task(c.update_weights(str(ckpt), 7))
        await asyncio.sleep(0.05)
        after_task = asyncio.create_task(c.generate(gen("after")))
        ack = await update
        assert ack.replicas == 3 and ack.version == 7 and not ack.error
        (old, _), (new, _) = await asyncio.gather(inflight, after_task)
        assert old.status == "ok" and old.weight_version == 0
        assert new.status == "ok" and new.weight_version == 7
        outs = await asyncio.gather(*(c.generate(gen(f"s{i}", session=f"s{i}")) for i in range(30)))
        assert {res.weight_version for res, _ in outs} == {7}
        again = await c.update_weights(str(ckpt), 7)  # idempotent: acknowledged at once
        assert again.replicas == 3

    asyncio.run(with_client(rd, body))

    # A replica that registers now is handed the weights before its readiness probe.
    stack.start_replica("throughput", 2)
    wait_for(lambda: (st := router_status(stack.frontend, 1.0)) is not None and st.groups["throughput"].ready == 3,
             30, "the third throughput replica")

    async def late(c: RouterClient) -> None:
        outs = await asyncio.gather(*(c.generate(gen(f"l{i}", session=f"l{i}", group="throughput"))
                                      for i in range(40)))
        assert {res.weight_version for res, _ in outs} == {7}
        assert any(res.replica_id.startswith("throughput-2@") for res, _ in outs)

    asyncio.run(with_client(rd, late))

    # One that cannot load them (the trainer's cleanup took the checkpoint) stays out of service, not
    # serving the model's own weights, and is asked again until it can.
    def status():  # type: ignore[no-untyped-def]
        return router_status(stack.frontend, 1.0).groups["throughput"]  # type: ignore[union-attr]

    ckpt.rmdir()
    stack.start_replica("throughput", 3)
    wait_for(lambda: status().stale_weights == 1, 30, "the fourth replica's failed load")
    assert status().registered == 4 and status().ready == 3
    ckpt.mkdir()
    wait_for(lambda: status().ready == 4, 30, "the fourth replica, once the checkpoint is back")
    assert status().stale_weights == 0


@pytest.mark.mpi
@pytest.mark.slow
def test_launch_loads_step_checkpoints_and_parquet_carries_versions(tmp_path: Path) -> None:
    weights = tmp_path / "weights"
    (weights / "step_00001").mkdir(parents=True)
    (weights / "step_00001" / "config.json").write_text("{}")  # copied by hand (the sim loads any directory)
    run = tmp_path / "run"
    out = launch([f"hydra.run.dir={run}", "engine.time_scale=0.2", "sessions_per_step=8",
                  f"rollout.weights_dir={weights}"])
    assert out.returncode == 0, out.stdout + out.stderr
    step0 = pq.read_table(run / "steps" / "step_00000.parquet").to_pylist()
    step1 = pq.read_table(run / "steps" / "step_00001.parquet").to_pylist()
    assert all(r["weight_versions"] == [0] for r in step0)
    assert all(r["weight_versions"] == [1] for r in step1)


def test_a_restarted_router_adopts_the_latest_weights(make_run, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    import zmq

    from toolkit.router.server import Router

    cfg, rd, stack = make_run(FAST)
    stack.start(timeout_s=30)
    asyncio.run(with_client(rd, lambda c: c.update_weights(str(tmp_path), 5)))
    ctx = zmq.Context()
    router = Router(cfg, rd, ctx)  # what a new router process of this run starts with
    try:
        latest = router.weights.latest
        assert latest is not None and (latest.path, latest.version) == (str(tmp_path), 5)
    finally:
        router.close()
        ctx.term()
