"""The fleet twin (``toolkit/plan/``) on constructed cases: a session's times added up by hand from the
sim's step model, a move to the tail group, a replica lost mid-step, fairness between two jobs, and
a config it cannot run refused with every reason at once."""

from __future__ import annotations

import asyncio

import pytest
from hydra.utils import instantiate

from toolkit.config import compose_config, group_engine
from toolkit.core import clock
from toolkit.core import protocol as P
from toolkit.core.errors import ConfigError
from toolkit.core.rundir import RunDir
from toolkit.engine.step_model import step_seconds
from toolkit.launch.validation import validate
from toolkit.plan.fleet import TwinClient, TwinReplica, Wire
from toolkit.plan.loop import VirtualLoop
from toolkit.plan.twin import EPOCH, Twin
from toolkit.router.server import Router

# Steps of ~10 ms that read context; replicas beat every 0.2 s.
FAST = ["engine.step_overhead_s=0.002", "engine.hbm_bandwidth=2e12", "router.heartbeat_s=0.2"]


def config(*overrides: str):
    cfg = compose_config([*FAST, *overrides])
    validate(cfg)
    return cfg


def test_one_session_ends_when_its_turn_and_the_probe_before_it_say(tmp_path) -> None:
    """One single-turn session on one replica: the probe's step, then the turn's steps."""
    cfg = config("groups=single", "workload=singleturn", "sessions_per_step=1", "steps=1", "ranks=1")
    run = Twin(cfg, tmp_path).run()
    (step,) = run.steps
    e = group_engine(cfg, "throughput")
    probe = step_seconds(e, 3, 3)  # the router's readiness probe: 3 prompt tokens, 1 token out
    n = step["generated_tokens"]
    p = len(instantiate(cfg.workload.prompts).get(0, 0).token_ids)  # the single-turn env sends it as is
    by_hand = probe + sum(step_seconds(e, p + i, p if i == 0 else 0) for i in range(n))
    assert step["wall_s"] == pytest.approx(by_hand, abs=1e-6)
    assert step["sessions_by_status"] == {"completed": 1}
    # With a link latency every message takes it: the turn's Generate and Result cross two links each.
    (slow,) = Twin(cfg, tmp_path / "slow", latency_s=0.05).run().steps
    assert slow["generated_tokens"] == n and slow["wall_s"] >= by_hand + 4 * 0.05 - 1e-9


def test_a_rank_starts_its_sessions_one_after_another() -> None:
    """Three single-turn sessions on one rank that takes 2 s (then 3 s) to start each: the last starts
    at 6 s (9 s), when the others are done (a turn takes well under a second here), and ends the step
    as it would alone: 3 s later for 1 s more a start."""
    cfg = config("groups=single", "workload=singleturn", "sessions_per_step=3", "steps=1", "ranks=1",
                 "workload.max_tokens=64")
    ((a,), (b,)) = (Twin(cfg, session_start_s=s).run().steps for s in (2.0, 3.0))
    assert 6.0 < a["wall_s"] < 7.0 and b["wall_s"] - a["wall_s"] == pytest.approx(3.0, abs=1e-9)
    (at_once,) = Twin(cfg, session_start_s=0.0).run().steps
    assert at_once["wall_s"] < 1.0 and at_once["generated_tokens"] == a["generated_tokens"] == b["generated_tokens"]


def test_long_runners_move_to_the_tail_group_and_end_whole() -> None:
    cfg = config("sessions_per_step=48", "steps=2", "workload.max_tokens=1024", "seed=3")
    run = Twin(cfg).run()
    assert sum((s["tail"] or {}).get("moves", 0) for s in run.steps) > 0
    for s in run.steps:
        assert s["sessions"] == 48 and s["requests_by_status"] == {"ok": s["requests"]}
        # Each answer names the group that gave it, as a replica's does: the groups' requests add up.
        assert sum(g["requests"] for g in s["groups"].values()) == s["requests"]
        assert s["groups"]["tail"]["requests"] > 0 and s["groups"]["tail"]["prefix_hit_rate"] is not None
    assert run.router.get("migrated:age", 0) + run.router.get("migrated:trade", 0) > 0


def test_a_replica_lost_mid_step_loses_no_session_and_costs_time() -> None:
    cfg = config("groups=single", "groups.throughput.replicas=2", "sessions_per_step=32", "steps=1",
                 "workload.max_tokens=512")
    whole = Twin(cfg).run()

    def lose_one(twin: Twin) -> None:
        twin.loop.call_at(0.3, twin.replicas[0].die)

    lost = Twin(cfg, events=lose_one).run()
    (a,), (b,) = whole.steps, lost.steps
    assert b["sessions_by_status"] == {"completed": 32} and b["requests_by_status"] == {"ok": b["requests"]}
    assert b["generated_tokens"] == a["generated_tokens"]  # the same tokens, from the replica left
    assert lost.router["requeued"] > 0 and b["wall_s"] > a["wall_s"]


def test_two_jobs_share_one_slot_turn_about(tmp_path) -> None:
    """One replica, one slot, four requests of job a and four of job b at once: the fair queue serves
    the jobs turn about, each request one step (one token) after the one before."""
    cfg = config("groups=single", "groups.throughput.max_inflight=1")
    e = group_engine(cfg, "throughput")
    loop = VirtualLoop()
    wire = Wire(loop, 0.0)
    done: list[tuple[float, str]] = []

    async def main() -> None:
        replica = TwinReplica(cfg, "throughput", 0, e, wire)
        replica.start()
        wire.start_timers(cfg.router.heartbeat_s)
        clients = {job: TwinClient(i, wire) for i, job in enumerate("ab")}
        await asyncio.sleep(0.1)  # registered and probed

        async def one(job: str, i: int) -> None:
            msg = P.Generate(request_id=f"{job}{i}", job=job, prompt_token_ids=[10 + i, 20, 30, 40],
                             sampling=P.Sampling(max_tokens=1, seed=i))
            await clients[job].generate(msg)
            done.append((loop.time(), msg.request_id))

        await asyncio.gather(*(one(job, i) for job in "ab" for i in range(4)))

    with clock.virtual(loop.time, EPOCH):
        rd = RunDir(tmp_path)
        rd.make()
        router = Router(cfg, rd, links=wire)
        wire.router = router
        try:
            loop.run(main())
        finally:
            router.close()
            loop.close()
    jobs = [rid[0] for _, rid in done]
    assert sorted(jobs) == list("aaaabbbb") and all(x != y for x, y in zip(jobs, jobs[1:], strict=False))
    one_step = step_seconds(e, 4, 4)  # 4 prompt tokens, none cached (the first token differs)
    gaps = [t1 - t0 for (t0, _), (t1, _) in zip(done, done[1:], strict=False)]
    assert gaps == pytest.approx([one_step] * 7, abs=1e-9)


def test_a_config_the_twin_cannot_run_is_refused_naming_every_setting() -> None:
    cfg = compose_config(["engine=vllm", "+workload.agent={_target_:builtins.print}", "rollout.weights_dir=/tmp/w",
                          "rollout.weights_transport=stream"])
    with pytest.raises(ConfigError) as exc:
        Twin(cfg)
    text = str(exc.value)
    assert "groups.throughput engine type" in text and "workload.agent" in text and "rollout.weights_dir" in text
    assert "rollout.weights_transport" in text


def test_a_twin_stops_where_a_real_run_would_past_its_failure_budget() -> None:
    """Requests cut at 0.5 s fail most sessions: a real run ends after the step (every rank checks the
    budget), and so does its twin, saying why; without a budget it runs every step."""
    from toolkit.plan.summary import summarize

    cut = ["steps=3", "rollout.request_timeout_s=0.5"]
    run = Twin(config(*cut)).run()
    assert len(run.steps) == 1 and run.stopped.startswith("step 0: ") and "rollout.max_failed_fraction" in run.stopped
    summary = summarize(run)
    assert summary["failed_share"] > 0.1 and summary["stopped"] == run.stopped
    unbounded = Twin(config(*cut, "rollout.max_failed_fraction=null")).run()
    assert len(unbounded.steps) == 3 and unbounded.stopped == ""


def test_a_message_passed_on_unchanged_arrives_as_what_was_encoded_and_nothing_stays_kept(monkeypatch) -> None:
    """The wire hands a Generate or a Result the router passed on as the object encoded (not decoded
    again): each equals its payload decoded, some are moved legs (merged by the router, so never taken),
    and once the run is over nothing is kept, a replica lost mid-step included."""
    cfg = config("sessions_per_step=48", "steps=2", "workload.max_tokens=1024", "seed=3")
    taken: list[bool] = []
    take = Wire.take

    def checked(self: Wire, payload: bytes):
        msg = take(self, payload)
        if msg is not None:
            taken.append(P.DECODERS[P.TYPE_OF[type(msg)]].decode(payload) == msg)
        return msg

    monkeypatch.setattr(Wire, "take", checked)
    twin = Twin(cfg, events=lambda t: t.loop.call_at(0.3, t.replicas[-1].die))  # a throughput replica
    run = twin.run()
    assert run.router["requeued"] > 0 and run.router.get("migrated:age", 0) > 0
    assert len(taken) > 1.8 * sum(s["requests"] for s in run.steps) and all(taken)
    assert not twin.wire._kept and not twin.wire._of


def test_the_twin_repeats_itself() -> None:
    cfg = config("sessions_per_step=16", "steps=2", "seed=5")
    a, b = Twin(cfg).run(), Twin(cfg).run()
    assert [s["wall_s"] for s in a.steps] == [s["wall_s"] for s in b.steps]


def test_steps_that_close_on_a_count_carry_the_rest_in_the_twin_too() -> None:
    cfg = config("sessions_per_step=16", "steps=3", "rollout.close=count", "rollout.over_sample=0.5")
    run = Twin(cfg).run()
    for s in run.steps:
        assert s["close"] == "count" and s["sessions"] == 16
    assert sum(s["carried_out"] for s in run.steps) > 0 and run.steps[1]["carried_in"] > 0
    # Every session landed at most once, in one step: some of them in a later step than they started in.
    landed = [key for step in run.sessions for key in step]
    assert len(landed) == len(set(landed)) and any(s < k for k, step in enumerate(run.sessions) for s, _ in step)


def test_a_twin_freezes_what_survives_a_young_collection_and_leaves_the_collector_as_it_was() -> None:
    import gc

    from toolkit.plan.twin import YOUNG_GC, _quiet_gc

    threshold, callbacks = gc.get_threshold(), list(gc.callbacks)
    with _quiet_gc():
        frozen = gc.get_freeze_count()
        kept = [[i] for i in range(1000)]  # survivors of the collection below
        gc.collect(0)
        assert gc.get_freeze_count() >= frozen + len(kept)
        assert gc.get_threshold() == (YOUNG_GC, *threshold[1:])
        young = [[i] for i in range(5000)]  # past the usual threshold, not collected
        assert gc.get_count()[0] >= len(young)
        runs: list[int] = []
        gc.callbacks.append(lambda phase, info: runs.append(info["generation"]) if phase == "start" else None)
    # The young generation went to the oldest, uncollected: the old threshold would collect it at once.
    more = [[i] for i in range(10)]
    gc.callbacks.pop()
    assert runs == [] and len(more) + len(young) > 0
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == threshold and gc.callbacks == callbacks
