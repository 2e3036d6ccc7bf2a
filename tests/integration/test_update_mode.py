"""``rollout.update_mode``: weight updates that abort nothing, and the versions of every turn's tokens.

- Real router and sim replicas (``make_run``): an update while long requests run. ``pause``: they
  go on across it, each dispatched once, finishing with its whole budget and listing both versions
  in order; ``drain``: they finish on the old weights. Requests sent after the update list the new one.
- The replica in process with fake engines: one that cannot update in place drains instead (and says
  so once); for one that keeps no account of versions, the replica lists those it saw.
- ``launch`` with the sim (``mpi``): a checkpoint that appears in ``rollout.weights_dir`` mid-run, and
  an update pushed while a step runs: no request fails, each row's versions and per-turn versions are right.
"""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.helpers.aio import with_client
from tests.helpers.procs import finish, ranks_started, start_launch, wait_for
from tests.helpers.requests import gen as request
from toolkit import samples
from toolkit.client import RouterClient, router_status
from toolkit.core import protocol as P
from toolkit.core.rundir import RunDir
from toolkit.weights import publish

# Every request runs to its budget (lognormal lengths far above it), at >= 10 ms per engine step.
LONG = ["router.heartbeat_s=0.2", "engine.time_scale=1.0", "engine.step_overhead_s=0.01",
        "engine.output_len_median=1000000"]
BUDGET = 300


def gen(rid: str, max_tokens: int = BUDGET) -> P.Generate:
    return request(rid, max_tokens=max_tokens)


async def generating(stack, tokens: int) -> None:  # type: ignore[no-untyped-def]
    """Until the engines report ``tokens`` generated (heartbeats), the readiness probes aside."""
    while True:
        st = await asyncio.to_thread(router_status, stack.frontend, 1.0)
        if st is not None and sum(g.generated_tokens for g in st.groups.values()) >= tokens:
            return
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("mode", ["pause", "drain"])
def test_an_update_with_requests_in_flight_aborts_nothing(make_run, tmp_path: Path, mode: str) -> None:  # type: ignore[no-untyped-def]
    cfg, rd, stack = make_run([*LONG, f"rollout.update_mode={mode}"])
    stack.start(timeout_s=30)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()

    async def body(c: RouterClient) -> None:
        inflight = [asyncio.create_task(c.generate(gen(f"in{i}"))) for i in range(6)]
        await generating(stack, 6 * 5)  # they are in the engines, far from their budget
        update = asyncio.create_task(c.update_weights(str(ckpt), 7))
        await asyncio.sleep(0.05)
        after = [asyncio.create_task(c.generate(gen(f"after{i}", 20))) for i in range(3)]
        ack = await update
        assert (ack.version, ack.replicas, ack.error) == (7, 3, "")
        for res, route in await asyncio.gather(*inflight):
            assert res.status == "ok" and res.finish_reason == "length", res
            assert len(res.output_token_ids) == len(res.logprobs) == BUDGET
            assert route is not None and route.dispatches == 1  # never aborted, retried nor moved
            assert res.weight_versions == ([0, 7] if mode == "pause" else [0]), res.weight_versions
            assert res.weight_version == res.weight_versions[-1]
        for res, route in await asyncio.gather(*after):
            assert res.status == "ok" and route is not None and route.dispatches == 1
            assert res.weight_versions == [7] and res.weight_version == 7

    asyncio.run(with_client(rd, body, timeout_s=120))


# ---- launch ------------------------------------------------------------------------------------
RUN = ["sessions_per_step=8", "rollout.update_mode=pause", "router.heartbeat_s=0.2"]


def rows_of(run: Path, step: int) -> list[dict]:  # type: ignore[type-arg]
    rows = pq.read_table(run / "steps" / f"step_{step:05d}.parquet").to_pylist()
    for r in rows:
        assert r["status"] in ("completed", "truncated"), r
        # The row's versions are its turns' versions in order of first use, each once.
        flat = [v for turn in r["turn_weight_versions"] for v in turn]
        assert r["weight_versions"] == list(dict.fromkeys(flat)) and len(r["turn_weight_versions"]) == r["num_turns"]
    return rows


def dirs(tmp_path: Path) -> tuple[Path, Path, Path]:
    """The run dir, the weights dir, and a checkpoint to publish (the sim loads any directory)."""
    source = tmp_path / "checkpoint"
    source.mkdir()
    (source / "config.json").write_text("{}")
    return tmp_path / "run", tmp_path / "weights", source


def all_ok(run: Path, step: int) -> None:
    rep = json.loads((run / "steps" / f"step_{step:05d}.json").read_text())
    assert set(rep["requests_by_status"]) == {"ok"}, rep["requests_by_status"]


def publish_version_1_during(run: Path, weights: Path, source: Path, overrides: list[str], when) -> None:  # type: ignore[no-untyped-def]
    """A two-step launch that publishes ``source`` as version 1 once ``when()`` returns; it must succeed."""
    proc = start_launch([f"hydra.run.dir={run}", *RUN, "steps=2", f"rollout.weights_dir={weights}", *overrides])
    try:
        when()
        publish(weights, 1, source)
    finally:
        output = finish(proc, 180)
    assert proc.returncode == 0, output


@pytest.mark.mpi
@pytest.mark.slow
def test_launch_a_checkpoint_appearing_mid_run_in_pause_mode(tmp_path: Path) -> None:
    run, weights, source = dirs(tmp_path)
    # Step 1 waits for version 1 (on-policy), which is published while step 0 runs.
    publish_version_1_during(run, weights, source, ["engine.time_scale=0.5", "rollout.max_staleness=0",
                                                    "rollout.weights_timeout_s=120"],
                             lambda: wait_for(lambda: ranks_started(run), 120, "the ranks"))
    for step in (0, 1):
        all_ok(run, step)
        for r in rows_of(run, step):
            assert r["weight_versions"] == [step] and {v for t in r["turn_weight_versions"] for v in t} == {step}


@pytest.mark.mpi
@pytest.mark.slow
def test_launch_one_step_behind_loads_a_checkpoint_published_while_the_step_runs(tmp_path: Path) -> None:
    run, weights, source = dirs(tmp_path)
    # max_staleness=1: step 1 begins on version 0 without waiting; version 1, published once step 1's
    # requests are generating, is loaded by the replicas in the middle of the step (update_mode=pause).
    def step1_generating() -> None:
        samples.wait_step(run, 0, timeout_s=180, poll_s=0.05)
        frontend = c_frontend(run)

        def generating() -> bool:
            st = router_status(frontend, 1.0)
            return st is not None and st.inflight > 0 and any(g.generated_tokens > 0 for g in st.groups.values())

        wait_for(generating, 60, "step 1's requests")

    publish_version_1_during(run, weights, source, [*LONG[1:], "workload.max_tokens=400", "rollout.max_staleness=1"],
                             step1_generating)
    for step in (0, 1):
        all_ok(run, step)
    assert all(r["weight_versions"] == [0] for r in rows_of(run, 0))
    rep = json.loads((run / "steps" / "step_00001.json").read_text())
    assert rep["weights"]["version"] == 0
    assert [u["version"] for u in rep["weights"]["updates"]] == [1], rep["weights"]
    assert rep["weights"]["updates"][0]["path"] == str(weights / "step_00001")
    turns = {tuple(t) for r in rows_of(run, 1) for t in r["turn_weight_versions"]}
    assert (0, 1) in turns and turns <= {(0,), (0, 1), (1,)}, turns


@pytest.mark.mpi
@pytest.mark.slow
def test_launch_an_update_pushed_while_a_step_runs_aborts_nothing(tmp_path: Path) -> None:
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    ckpt.mkdir()
    proc = start_launch([f"hydra.run.dir={run}", *RUN, "steps=2", "engine.time_scale=1.0"])
    acks: list[P.WeightsUpdated] = []

    def trainer() -> None:
        # A trainer that pushes its weights itself (RouterClient.update_weights) while step 0 runs.
        wait_for(lambda: ranks_started(run) and (run / "router.json").exists(), 120, "the ranks")

        async def push(c: RouterClient) -> None:
            while True:
                st = await asyncio.to_thread(router_status, c_frontend(run), 1.0)
                if st is not None and st.inflight > 0 and sum(g.generated_tokens for g in st.groups.values()) > 50:
                    break
                await asyncio.sleep(0.05)
            acks.append(await c.update_weights(str(ckpt), 1))

        asyncio.run(with_client(RunDir(run), push, timeout_s=120))

    t = threading.Thread(target=trainer, daemon=True)
    t.start()
    try:
        t.join(180)
    finally:
        output = finish(proc, 180)
    assert proc.returncode == 0, output
    assert acks and acks[0].error == "" and acks[0].replicas == 3
    for step in (0, 1):
        all_ok(run, step)
    step0, step1 = rows_of(run, 0), rows_of(run, 1)
    assert all(r["weight_versions"] == [1] for r in step1)
    turns = [t for r in step0 for t in r["turn_weight_versions"]]
    assert set(map(tuple, turns)) <= {(0,), (0, 1), (1,)}
    assert (0, 1) in set(map(tuple, turns)), "no turn ran across the update"
    # Versions never go back within a session.
    for r in step0:
        flat = [v for t in r["turn_weight_versions"] for v in t]
        assert flat == sorted(flat)


def c_frontend(run: Path) -> str:
    return json.loads((run / "router.json").read_text())["frontend"]
