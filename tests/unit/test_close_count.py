"""``rollout.close=count`` on one rank, its sessions stand-ins the test ends at will: a step closes on
its count, the rest carry on and land once each, staleness drops or restarts, zero-variance groups are
filtered and replaced, a step with no starts left closes short."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from toolkit.config import GroupFilter, RolloutConfig, StaleAction
from toolkit.rollout.close import CloseOnCount, Landed
from toolkit.session.columns import to_table
from toolkit.session.requests import RequestLog
from toolkit.session.sample import Sample

pytestmark = pytest.mark.unit


class Sessions:
    """Sessions that end when the test says, with the reward and weight versions it gives."""

    def __init__(self) -> None:
        self.waiting: dict[tuple[int, int, int], asyncio.Future[tuple[float, list[int]]]] = {}
        self.started: list[tuple[int, int, int]] = []
        self.told: list[tuple[int, str]] = []
        """The SessionDones the closer sent: (the step it landed in, session id)."""

    async def landed(self, step: int, session_id: str) -> None:
        self.told.append((step, session_id))

    async def run(self, step: int, index: int, attempt: int) -> list[Sample]:
        key = (step, index, attempt)
        self.started.append(key)
        fut = self.waiting[key] = asyncio.get_running_loop().create_future()
        try:
            reward, versions = await fut
        except asyncio.CancelledError:
            del self.waiting[key]  # stopped (its requests leave the engines)
            raise
        s = Sample.start(index, f"job/{step}/{index}", [1, 2, 3])
        s.reward, s.weight_versions = reward, versions
        s.tokens.append(7)
        s.loss_mask.append(1)
        s.rollout_logprobs.append(-0.5)
        s.generated_tokens = s.num_turns = 1
        return [s]

    def end(self, step: int, index: int, attempt: int = 0, reward: float = 1.0, versions: tuple[int, ...] = (0,)) -> None:
        self.waiting.pop((step, index, attempt)).set_result((reward, list(versions)))

    def running(self) -> list[tuple[int, int, int]]:
        return sorted(self.waiting)


def closer(sessions: Sessions, n: int = 8, group: int = 1, **rollout: Any) -> CloseOnCount:
    cfg: Any = SimpleNamespace(sessions_per_step=n, job="job", rollout=RolloutConfig(close="count", **rollout))
    return CloseOnCount(cfg, 0, 1, group, sessions.run, ["throughput"], RequestLog, 0, sessions.landed)


def rows(landed: Landed) -> list[dict[str, Any]]:
    return to_table(landed.builder.columns(), ["throughput"]).to_pylist()


async def settle() -> None:
    """Let every task run until it waits on a session (cancelling one takes a few turns of the loop)."""
    for _ in range(20):
        await asyncio.sleep(0)


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_a_step_closes_on_its_count_and_carries_the_rest_into_the_step_they_end_in() -> None:
    async def go() -> None:
        s = Sessions()
        c = closer(s, n=4, over_sample=0.5)
        step0 = asyncio.create_task(c.collect(0))
        await settle()
        assert s.running() == [(0, i, 0) for i in range(6)]  # 4 * 1.5 in flight
        for i in (5, 0, 3):
            s.end(0, i)
        await settle()
        assert not step0.done()
        assert s.running() == [(0, i, 0) for i in (1, 2, 4, 6, 7, 8)]  # each one that landed replaced at once
        s.end(0, 2)
        landed = await step0
        assert sorted(r["index"] for r in rows(landed)) == [0, 2, 3, 5]
        assert landed.counts["carried_out"] == 6 and landed.in_flight == [(0, i, 0) for i in (1, 4, 6, 7, 8, 9)]
        # Between steps a carried session ends: it lands in the next step, carried across one boundary.
        s.end(0, 4)
        await settle()
        step1 = asyncio.create_task(c.collect(1))
        await settle()
        assert s.running() == [*[(0, i, 0) for i in (1, 6, 7, 8, 9)], (1, 0, 0)]
        s.end(0, 1)
        await settle()  # it lands, and a group is started in its place
        for i in (0, 1):
            s.end(1, i)
        landed = await step1
        got = {(r["started_step"], r["index"]): r for r in rows(landed)}
        assert sorted(got) == [(0, 1), (0, 4), (1, 0), (1, 1)]
        assert got[(0, 1)]["carried"] == got[(0, 4)]["carried"] == 1 and got[(1, 0)]["carried"] == 0
        assert got[(0, 1)]["staleness"] == 1  # no weights_dir: a step behind the step it began in
        assert landed.counts["carried_in"] == 2 and landed.counts["group_starts"] == 4
        # The router hears of each counted session with the step it landed in (what the flip counts).
        assert sorted(s.told) == sorted([(0, f"job/0/{i}") for i in (0, 2, 3, 5)]
                                        + [(1, "job/0/1"), (1, "job/0/4"), (1, "job/1/0"), (1, "job/1/1")])
        await c.aclose()
        assert not c.running

    run(go())


@pytest.mark.parametrize("action", [StaleAction.drop, StaleAction.restart])
def test_a_session_carried_past_max_staleness_stops_at_the_step_it_can_no_longer_land_in(action: StaleAction) -> None:
    async def go() -> None:
        s = Sessions()
        c = closer(s, n=2, over_sample=0.5, max_staleness=1, stale=action)
        step0 = asyncio.create_task(c.collect(0))
        await settle()
        s.end(0, 0)
        s.end(0, 1)
        assert [r["index"] for r in rows(await step0)] == [0, 1]  # session 2 carried on, 3 and 4 started
        step1 = asyncio.create_task(c.collect(1))
        await settle()
        s.end(0, 3)
        s.end(0, 4)
        assert sorted(r["index"] for r in rows(await step1)) == [3, 4]  # carried once: within k = 1
        # Step 2 begins: session 0/2 began two steps ago, past k = 1 wherever it lands: it stops now.
        step2 = asyncio.create_task(c.collect(2))
        await settle()
        assert (0, 2, 0) not in s.running()
        if action == StaleAction.restart:
            assert (0, 2, 1) in s.running()  # from its first turn, with request ids of its own
            s.end(0, 2, attempt=1)
            s.end(1, 0)
        else:
            s.end(1, 0)
            s.end(1, 1)
        landed = await step2
        out = {(r["started_step"], r["index"]): r for r in rows(landed)}
        if action == StaleAction.drop:
            assert out[(0, 2)]["status"] == "stale" and "max_staleness" in out[(0, 2)]["error"]
            assert out[(0, 2)]["tokens"] == [] and landed.counts["dropped_stale"] == 1
            assert sum(r["status"] == "completed" for r in out.values()) == 2  # the count, without it
        else:
            assert out[(0, 2)]["status"] == "completed" and out[(0, 2)]["staleness"] == 0
            assert out[(0, 2)]["carried"] == 2 and landed.counts["restarted_stale"] == 1
        await c.aclose()

    run(go())


def test_a_session_whose_weights_fell_too_far_behind_is_dropped_as_it_lands() -> None:
    async def go() -> None:
        s = Sessions()
        c = closer(s, n=2, over_sample=0.5, max_staleness=1, weights_dir="/w")
        step0 = asyncio.create_task(c.collect(0))
        await settle()
        s.end(0, 0, versions=(2,))  # the engines are at version 2 now
        s.end(0, 2, versions=(0, 1))  # its oldest token is version 0: two behind
        s.end(0, 1, versions=(2,))
        landed = await step0
        out = {r["index"]: r for r in rows(landed)}
        assert out[2]["status"] == "stale" and out[2]["staleness"] == 2 and out[2]["tokens"] == [1, 2, 3, 7]
        assert landed.counts["dropped_stale"] == 1 and landed.counts["tokens_discarded"] == 1
        assert [out[i]["status"] for i in (0, 1)] == ["completed", "completed"]
        await c.aclose()

    run(go())


def test_staleness_counts_weight_versions_when_the_trainer_publishes_them() -> None:
    async def go() -> None:
        s = Sessions()
        c = closer(s, n=1, over_sample=1.0, max_staleness=1, weights_dir="/w")
        step0 = asyncio.create_task(c.collect(0))
        await settle()
        s.end(0, 0, versions=(0,))
        await step0
        step1 = asyncio.create_task(c.collect(1))
        await settle()
        s.end(0, 1, versions=(0, 1))  # carried: its oldest token is version 0, one behind the newest
        landed = await step1
        [row] = rows(landed)
        assert row["staleness"] == 1 and row["status"] == "completed"
        await c.aclose()

    run(go())


def test_a_group_that_ends_between_steps_is_judged_against_the_weights_the_next_step_runs_with() -> None:
    """Rank 0 waits for the weights step 1 needs (version 2) while a carried group ends: it lands once step
    1 begins, two versions behind the weights it runs with, not none behind the newest its rank had seen."""
    async def go() -> None:
        s = Sessions()
        c = closer(s, n=2, over_sample=0.5, max_staleness=1, weights_dir="/w")
        step0 = asyncio.create_task(c.collect(0, 0))
        await settle()
        s.end(0, 0, versions=(0,))
        s.end(0, 1, versions=(0,))
        await step0
        await settle()
        started = len(s.started)
        s.end(0, 2, versions=(0,))  # between the steps
        await settle()
        assert len(s.started) == started and not s.told[2:]  # not landed yet: no step is open
        step1 = asyncio.create_task(c.collect(1, 2))
        await settle()
        s.end(0, 3, versions=(2,))  # carried too, on the new weights only
        s.end(0, 4, versions=(2,))
        landed = await step1
        out = {(r["started_step"], r["index"]): r for r in rows(landed)}
        assert out[(0, 2)]["status"] == "stale" and out[(0, 2)]["staleness"] == 2, out
        assert landed.counts["dropped_stale"] == 1
        assert [out[(0, i)]["status"] for i in (3, 4)] == ["completed", "completed"]
        await c.aclose()

    run(go())


def test_zero_variance_groups_are_filtered_and_replaced_then_the_step_closes_short() -> None:
    async def go() -> None:
        s = Sessions()
        c = closer(s, n=4, group=2, filter_groups=GroupFilter.zero_variance, max_group_starts_per_step=3)
        step0 = asyncio.create_task(c.collect(0))
        await settle()
        assert s.running() == [(0, i, 0) for i in range(4)]  # two groups of two
        s.end(0, 0, reward=1.0)
        s.end(0, 1, reward=0.0)  # group 0: useful
        s.end(0, 2, reward=1.0)
        s.end(0, 3, reward=1.0)  # group 1: every reward equal
        await settle()
        assert s.running() == [(0, 4, 0), (0, 5, 0)]  # group 2 in its place
        s.end(0, 4, reward=0.5)
        s.end(0, 5, reward=0.5)  # filtered too, and no start is left: the step closes short
        landed = await step0
        status = {r["index"]: r["status"] for r in rows(landed)}
        assert status == {0: "completed", 1: "completed", 2: "filtered", 3: "filtered", 4: "filtered", 5: "filtered"}
        assert landed.counts["filtered_groups"] == 2 and landed.counts["closed_short"] == 1
        assert landed.counts["group_starts"] == 3
        await c.aclose()

    run(go())


def test_a_session_that_raises_a_toolkit_failure_fails_the_step() -> None:
    async def go() -> None:
        async def broken(step: int, index: int, attempt: int) -> list[Sample]:
            raise RuntimeError("router gone")

        cfg: Any = SimpleNamespace(sessions_per_step=2, job="job", rollout=RolloutConfig(close="count"))
        c = CloseOnCount(cfg, 0, 1, 1, broken, ["throughput"], RequestLog, 0, Sessions().landed)
        with pytest.raises(RuntimeError, match="router gone"):
            await c.collect(0)
        await c.aclose()

    run(go())


def test_ranks_split_the_count_and_the_groups_in_flight() -> None:
    s = Sessions()
    cfg: Any = SimpleNamespace(sessions_per_step=10, job="job", rollout=RolloutConfig(close="count", over_sample=0.25))
    parts = [CloseOnCount(cfg, r, 3, 1, s.run, ["t"], RequestLog, 0, s.landed) for r in range(3)]
    assert [p.quota for p in parts] == [4, 3, 3] and sum(p.target for p in parts) == 13


def test_a_group_member_without_tokens_does_not_turn_its_groups_staleness_into_steps() -> None:
    """A member failed at its start has no weight versions: the group's staleness is its others'
    versions, not the steps since it began (which, with a trainer a version behind the steps, would drop
    a group within the bound)."""
    async def go() -> None:
        s = Sessions()
        c = closer(s, n=2, group=2, over_sample=1.0, max_staleness=1, weights_dir="/w")
        step0 = asyncio.create_task(c.collect(0))
        await settle()
        s.end(0, 0, versions=(0,))
        s.end(0, 1, versions=(0,))
        await step0
        for step in (1, 2):  # two steps close on other groups while the group of sessions 2 and 3 runs on
            nxt = asyncio.create_task(c.collect(step))
            await settle()
            for started, index, _ in s.running():
                if index not in (2, 3):
                    s.end(started, index, versions=(0,))
            await nxt
        step3 = asyncio.create_task(c.collect(3))
        await settle()
        s.end(0, 2, versions=())  # failed at its start: no tokens
        s.end(0, 3, versions=(0,))
        for started, index, _ in s.running():
            s.end(started, index, versions=(0,))
        landed = await step3
        out = {(r["started_step"], r["index"]): r for r in rows(landed)}
        assert out[(0, 3)]["status"] == "completed" and out[(0, 3)]["staleness"] == 0
        await c.aclose()

    run(go())
