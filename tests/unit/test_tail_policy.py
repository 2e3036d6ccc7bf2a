"""Tail policies and the router's tail routing, on constructed timelines (no processes): which turn
starts on the tail group, which running request moves, in what order and into how much room."""

from __future__ import annotations

import heapq
import random
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from toolkit.config import Config, compose_config
from toolkit.core.protocol import Generate, Sampling
from toolkit.core.rundir import FileWriter, RunDir
from toolkit.router.policy import ConsistentHash
from toolkit.router.pool import BULK, ReplicaPool
from toolkit.router.queue import Request, hinted
from toolkit.router.replica import Replica
from toolkit.router.speed import SpeedMeter
from toolkit.router.tail.age import AgePolicy
from toolkit.router.tail.base import EVERYTHING, MoveLimits, StepRecord
from toolkit.router.tail.count import CountPolicy
from toolkit.router.tail.predict import PredictPolicy
from toolkit.router.tail.routing import TICK_REPLICAS, TICK_S, TailRouting, reserved_group


def tail_cfg(*overrides: str):  # type: ignore[no-untyped-def]
    return compose_config(list(overrides)).tail


def record(lengths: list[int], step: int = 0) -> StepRecord:
    rec = StepRecord(step)
    for i, n in enumerate(lengths):
        rec.finished(f"s{i}", "", n)
    return rec


def test_the_quantile_is_of_the_finished_turns_so_far() -> None:
    rec = record([50, 10, 40, 20, 30])
    assert rec.lengths.sorted() == [10, 20, 30, 40, 50]
    assert (rec.quantile(0.0), rec.quantile(0.5), rec.quantile(0.9), rec.quantile(0.99)) == (10, 30, 50, 50)


def test_age_moves_a_request_past_the_long_turn_of_the_step_and_never_before_it_is_known() -> None:
    age = AgePolicy(tail_cfg("tail.policy=age", "tail.long_quantile=0.5", "tail.long_min_finished=4"))
    rec = record([100, 200, 300])
    assert age.long_turn(rec) is None and age.move_limits(rec) is None  # 3 finished < long_min_finished
    rec.finished("s9", "", 400)
    assert age.long_turn(rec) == 300  # the median of 100..400 by nearest rank
    limits = age.move_limits(rec)
    assert limits is not None and limits.priority(300) is None and limits.priority(301) == 301
    fixed = AgePolicy(tail_cfg("tail.policy=age", "tail.long_tokens=50")).move_limits(StepRecord(0))
    assert fixed is not None and fixed.priority(51) == 51 and fixed.priority(50) is None  # needs nothing finished


def test_hints_move_nothing_in_a_step_that_has_sent_none() -> None:
    age = AgePolicy(tail_cfg("tail.policy=age"))
    rec = StepRecord(1, last_long=600)
    assert age.move_limits(rec) is None  # nothing finished, no hint seen: no tick scans the requests
    rec.hinted = True
    assert age.move_limits(rec) == MoveLimits(age=None, hint=600)


def test_a_hint_rules_a_running_turn_until_it_is_outrun_then_its_age_does() -> None:
    limits = MoveLimits(age=300, hint=600)
    assert limits.priority(10, hint=1000) == 990  # hinted long: it moves young, by what is left
    assert limits.priority(10, hint=500) is None  # 490 to come is no long turn
    assert limits.priority(400, hint=1000) == 600  # 600 to come is one
    assert limits.priority(450, hint=500) is None  # older than 300, but its hint says it ends in 50
    assert limits.priority(400, hint=900) == 400  # 500 to come: no long turn, no end either; its age rules
    assert limits.priority(600, hint=500) == 600  # it outran its hint: its age rules
    assert limits.priority(301) == 301 and limits.priority(300) is None  # no hint: its age rules
    assert MoveLimits(age=None, hint=600).priority(10_000) is None
    assert MoveLimits(age=300, hint=None).priority(10, hint=5000) is None  # no limit for hints yet
    assert EVERYTHING.priority(0) == 0 and EVERYTHING.priority(3, hint=10) == 7  # after a flip: all


def test_predict_starts_a_session_on_the_tail_after_its_own_or_its_siblings_long_turns() -> None:
    pred = PredictPolicy(tail_cfg("tail.policy=predict", "tail.long_quantile=0.75", "tail.long_min_finished=4"))
    rec = StepRecord(0)
    for sid, key, n in [("a", "p0", 10), ("b", "p0", 20), ("c", "p1", 30), ("d", "p1", 900)]:
        rec.finished(sid, key, n)
    assert pred.long_turn(rec) == 900
    rec.finished("e", "p2", 1000)  # 10, 20, 30, 900, 1000: the 0.75 quantile is 900
    assert pred.start_on_tail(rec, "e", "p2")  # its own turn was long
    assert not pred.start_on_tail(rec, "d", "p1")  # 900 is not above 900
    assert pred.start_on_tail(rec, "f", "p2")  # a sibling of e: its prompt's turns average 1000
    assert not pred.start_on_tail(rec, "g", "p0") and not pred.start_on_tail(rec, "h", "")
    rec.on_tail.add("h")
    assert pred.start_on_tail(rec, "h", "")  # it ran there: it stays for its prefix cache
    assert not CountPolicy(tail_cfg("tail.threshold=0.9")).start_on_tail(rec, "e", "p2")  # count: only the flip


def test_a_turn_hinted_long_starts_on_the_tail_against_the_last_steps_long_turn() -> None:
    age = AgePolicy(tail_cfg("tail.policy=age", "tail.long_quantile=0.5", "tail.long_min_finished=2"))
    rec = StepRecord(1, last_long=600)
    rec.finished("a", "", 10)
    rec.finished("b", "", 20)  # this step's early finishers are short: its own limit would be 20
    assert age.long_hint(rec) == 600
    assert age.start_on_tail(rec, "s", "", hint=600) and not age.start_on_tail(rec, "s", "", hint=599)
    assert not age.start_on_tail(rec, "s", "")  # no hint
    assert age.long_hint(record([10, 20, 30])) == 20  # no last step: this one's so far
    assert age.long_hint(StepRecord(0)) is None and not age.start_on_tail(StepRecord(0), "s", "", hint=10**6)
    fixed = AgePolicy(tail_cfg("tail.policy=age", "tail.long_tokens=50"))
    assert fixed.start_on_tail(StepRecord(0, last_long=600), "s", "", hint=50)  # long_tokens rules
    pred = PredictPolicy(tail_cfg("tail.policy=predict"))
    assert pred.start_on_tail(rec, "s", "", hint=700)
    assert not CountPolicy(tail_cfg("tail.threshold=0.9")).start_on_tail(rec, "s", "", hint=700)


def test_a_steps_first_turns_fill_the_tail_room_until_one_ends_or_a_hint_is_seen() -> None:
    age = AgePolicy(tail_cfg("tail.policy=age"))
    pred = PredictPolicy(tail_cfg("tail.policy=predict"))
    rec = StepRecord(1, last_long=600)
    assert age.start_on_tail(rec, "s", "") and pred.start_on_tail(rec, "s", "")  # else the room idles
    assert not age.start_on_tail(rec, "s", "", hint=10)  # a hinted turn is judged by its hint
    rec.finished("a", "", 10)  # from the first turn that ends, only what the step showed counts
    assert not age.start_on_tail(rec, "s", "") and not pred.start_on_tail(rec, "s", "")
    hinted = StepRecord(1, last_long=600)
    hinted.hinted = True  # where turns carry hints, they pick the turns that start there
    assert not age.start_on_tail(hinted, "s", "")
    assert not CountPolicy(tail_cfg("tail.threshold=0.9")).start_on_tail(StepRecord(0), "s", "")


def replica(n: int, group: str, slots: int) -> Replica:
    return Replica(f"{group}-{n}@h:{n}", f"id-{group}{n}".encode(), group, slots, 10_000, 1000)


def request(rid: str, session: str, step: int = 0, group: str | None = None, seq: int = 0, hint: int = 0,
            job: str = "j") -> Request:
    msg = Generate(rid, job=job, session_id=session, step=step, prompt_token_ids=[1, 2, 3],
                   sampling=Sampling(max_tokens=5000), group=group, expected_tokens=hint)
    return Request(msg, b"", b"client", job, seq, 0.0)


@pytest.fixture
def files() -> Iterator[FileWriter]:
    w = FileWriter()
    yield w
    w.close()


class Fleet:
    """A pool of two throughput replicas (4 slots) and one tail replica (2 slots), with tail routing."""

    def __init__(self, tmp: Path, files: FileWriter, *overrides: str, cfg: Config | None = None) -> None:
        cfg = cfg or compose_config(["router.policy=consistent_hash", *overrides])
        self.pool = ReplicaPool(cfg.router, 0, reserved_group(cfg.tail))
        self.tail = TailRouting(cfg.tail, RunDir(tmp / "run"), files, self.pool)
        self.tp = [replica(0, "throughput", 4), replica(1, "throughput", 4)]
        self.fast = replica(0, "tail", 2)
        for r in (*self.tp, self.fast):
            self.pool.add(r)
            self.pool.set_ready(r)
            r.speed.update(0.0, 0, 0)
        self.tail.step_begin("j", 0, 8)

    def run(self, req: Request, r: Replica, now: float = 0.0) -> None:
        self.pool.take_slot(r, req)
        req.replica = r.replica_id
        self.tail.dispatched(req, r, now)

    def heartbeat(self, r: Replica, now: float, generated: int) -> None:
        r.speed.update(now, generated, len(r.inflight))


def test_age_moves_the_oldest_long_runners_first_and_only_into_room(tmp_path: Path, files: FileWriter) -> None:
    f = Fleet(tmp_path, files, "tail.policy=age", "tail.long_tokens=100")
    assert f.pool.reserved == "tail" and f.tail.targets(request("x", "x")) == ("tail", BULK)  # the step's start
    f.tail.records["j"].finished("z", "", 10)  # a turn ended: from now on the tail takes long runners only
    assert f.tail.targets(request("x", "x")) == (BULK, None)
    a, b = f.tp
    early = [request(f"e{i}", f"e{i}", seq=i) for i in range(2)]  # dispatched at 0
    for req in early:
        f.run(req, a, 0.0)
    late = [request(f"l{i}", f"l{i}", seq=10 + i) for i in range(3)]
    f.heartbeat(a, 1.0, 0)
    for req in late:
        f.run(req, b, 1.0)
    f.heartbeat(b, 1.0, 0)
    # a: 2 running for 1 s at 60 tokens/s each -> 120 tokens each by t=2; b's began at t=1.
    f.heartbeat(a, 2.0, 240)
    f.heartbeat(b, 2.0, 150)  # 50 tokens each
    assert f.tail.to_move(2.0) == list(zip(early, [a, a], strict=True))  # over 100 tokens: a's two
    assert f.tail.room() == 0 and f.tail.to_move(2.5) == []  # the tail's 2 slots are spoken for
    # Extrapolated between heartbeats: by t=4, b's requests are at 50 + 2 * 50 = 150 tokens.
    for req in early:  # the moved requests run on the tail replica now: their room is theirs
        assert f.pool.release_slot(a, req)
        f.run(req, f.fast, 2.1)
    assert f.tail.room() == 0
    assert f.pool.release_slot(f.fast, early[0])
    moved = f.tail.to_move(4.0)
    assert [req.request_id for req, _ in moved] == ["l0"]  # one slot: the oldest (lowest seq) of equals
    assert f.tail.targets(request("l0/1", "l0")) == (BULK, None)  # it prefers the tail: no room left there
    rec = f.tail.records["j"]
    assert rec.on_tail == {"e0", "e1"}  # ran there: their later turns prefer the tail group (l0 once it runs)


def _scan_every_request(tail: TailRouting, pool: ReplicaPool, now: float) -> list[tuple[Request, Replica]]:
    """What ``to_move`` chooses, the plain way: every running request's priority, the ``room`` largest."""
    assert tail.policy is not None
    found = []
    for r in pool.all():
        if r.group == tail.group or not r.serving:
            continue
        for req in r.inflight.values():
            rec = tail.records.get(req.msg.job)
            if rec is None or rec.step != req.msg.step:
                continue  # not its job's current step: nothing is known of it
            limits = tail.policy.move_limits(rec)
            assert limits is not None
            if req.msg.group is not None or req.migrating or req.deaths or req.client_aborted:
                continue
            tokens = len(req.prefix_tokens) + r.speed.tokens_since(req.est_mark, now)
            p = limits.priority(tokens, hinted(req.msg))
            if p is not None:
                found.append((p, -req.seq, req, r))
    return [(req, r) for _, _, req, r in heapq.nlargest(tail.room(), found, key=lambda f: (f[0], f[1]))]


def _random_fleet(cfg, run_dir: RunDir, files: FileWriter, rng: random.Random,  # type: ignore[no-untyped-def]
                  slots: int) -> tuple[ReplicaPool, TailRouting, list[Replica]]:
    """Four throughput replicas of ``slots`` and a tail replica of 1-6, ready, jobs "j" and "k" at step 0
    with one session finished each, of another length (their long turns differ without
    ``tail.long_tokens``); the pool, the tail routing and the throughput replicas."""
    pool = ReplicaPool(cfg.router, 0, reserved_group(cfg.tail))
    tail = TailRouting(cfg.tail, run_dir, files, pool)
    tps = [replica(i, "throughput", slots) for i in range(4)]
    for r in (*tps, replica(0, "tail", rng.randint(1, 6))):
        pool.add(r)
        pool.set_ready(r)
        r.speed.update(0.0, 0, 0)
    for job, length in (("j", 100), ("k", 250)):  # their long turns (tail.long_min_finished=1)
        tail.step_begin(job, 0, 64)
        tail.records[job].finished("z", "", length)
    return pool, tail, tps


def _random_request(rid: str, seq: int, rng: random.Random, step: int = 0, plain_only: bool = False) -> Request:
    """A request of session ``rid``: mostly without a hint, sometimes one that moved here already (neither
    with ``plain_only``); mostly of job "j", some of job "k", some of a job or step the router knows
    nothing of."""
    job = rng.choice(["j"] * 6 + ["k"] * 3 + ["x"])
    step = step if rng.random() < 0.9 else step + 1
    req = request(rid, rid, step=step, seq=seq, hint=0 if plain_only else rng.choice([0, 0, 0, 150, 3000]), job=job)
    if not plain_only and rng.random() < 0.15:
        req.prefix_tokens = list(range(rng.randint(1, 300)))  # moved here once already
    return req


def test_the_moves_are_those_a_scan_of_every_running_request_chooses(tmp_path: Path, files: FileWriter) -> None:
    """``to_move`` looks only at the heads of each replica's requests without a hint or a move (a merge):
    on random fleets (requests dispatched at the same instant, hints, moved requests, rates that change
    between heartbeats, 1-6 slots of room) it picks exactly what scanning every request picks."""
    rng = random.Random(11)
    cfg = compose_config(["router.policy=consistent_hash", "tail.policy=age", "tail.long_min_finished=1"])
    for trial in range(200):
        pool, tail, tps = _random_fleet(cfg, RunDir(tmp_path / f"run{trial}"), files, rng, slots=16)
        seqs = iter(rng.sample(range(10_000), 64))
        for r in tps:
            t, generated = 0.0, 0
            for k in range(rng.randint(0, 16)):
                t += rng.choice([0.0, 0.0, 0.5, 1.0])  # several dispatched at the same instant
                req = _random_request(f"{r.replica_id}/{k}", next(seqs), rng, plain_only=trial % 3 == 0)
                pool.take_slot(r, req)
                tail.dispatched(req, r, t)
                generated += rng.randint(0, 400)
                r.speed.update(t + 0.25, generated, len(r.inflight))
        now = rng.uniform(9.0, 20.0)
        expected = _scan_every_request(tail, pool, now)
        assert tail.to_move(now) == expected, trial


def test_the_moves_stay_those_of_a_scan_tick_after_tick_as_requests_come_go_and_start_moving(
        tmp_path: Path, files: FileWriter) -> None:
    """Over 30 ticks of random dispatches and results, moves under way and clients' aborts (which change
    while a request runs), every tick of ``to_move`` picks exactly what a scan of every request picks
    (a cache of each replica's sorted requests between ticks was tried against it: it caught a stale
    cache and a missed abort)."""
    rng = random.Random(5)
    cfg = compose_config(["router.policy=consistent_hash", "tail.policy=age", "tail.long_min_finished=1"])
    seqs = iter(range(1_000_000))
    for trial in range(25):
        pool, tail, tps = _random_fleet(cfg, RunDir(tmp_path / f"run{trial}"), files, rng, slots=8)
        live: list[tuple[Request, Replica]] = []
        generated = dict.fromkeys(tps, 0)
        t = 0.0
        for tick in range(30):
            for _ in range(rng.randint(0, 8)):
                if live and rng.random() < 0.4:
                    req, r = live.pop(rng.randrange(len(live)))
                    pool.release_slot(r, req)  # its Result
                    continue
                r = rng.choice(tps)
                if r.has_room:
                    k = next(seqs)
                    req = _random_request(f"q{k}", k, rng, plain_only=trial % 3 == 0)
                    pool.take_slot(r, req)
                    tail.dispatched(req, r, t)  # several at the same instant
                    live.append((req, r))
            for req, _ in live:
                if rng.random() < 0.03:
                    req.client_aborted = True
            t += rng.choice([0.05, 0.5, 2.0])
            for r in tps:
                generated[r] += rng.randint(0, 300)
                r.speed.update(t, generated[r], len(r.inflight))
            expected = _scan_every_request(tail, pool, t)
            moved = tail.to_move(t)
            assert moved == expected, (trial, tick)
            for req, _ in moved:
                req.migrating = "tail"  # under way: it stays in its slot until its partial Result
            tail.inbound.clear()  # the tail group's room back for the next tick


def test_hints_choose_which_running_requests_move_first(tmp_path: Path, files: FileWriter) -> None:
    f = Fleet(tmp_path, files, "tail.policy=age", "tail.long_tokens=100")
    a, b = f.tp
    # "end" came first: without its hint it would go before "old" (the same age, the older request).
    ending, old, young = request("end", "end", seq=0, hint=160), request("old", "old", seq=1), request(
        "young", "young", seq=2, hint=5000)
    f.run(old, a, 0.0)
    f.run(ending, a, 0.0)
    f.heartbeat(a, 1.0, 0)
    f.heartbeat(b, 1.0, 0)
    f.run(young, b, 1.0)
    f.heartbeat(a, 2.0, 300)  # 150 tokens each by t=2
    f.heartbeat(b, 2.0, 10)  # young: 10 tokens, 4,990 to come by its hint
    moved = f.tail.to_move(2.0)
    # young first (most to come), then old by its age; "end" is as old, but its hint says 10 to go.
    assert [req.request_id for req, _ in moved] == ["young", "old"]


def test_requests_that_name_a_group_or_moved_already_stay(tmp_path: Path, files: FileWriter) -> None:
    f = Fleet(tmp_path, files, "tail.policy=age", "tail.long_tokens=1")
    a = f.tp[0]
    named, moving, dead = request("n", "n", group="throughput"), request("m", "m"), request("d", "d")
    moving.migrating = "drain"
    dead.deaths = ("a: test",)
    for req in (named, moving, dead):
        f.run(req, a, 0.0)
    f.heartbeat(a, 1.0, 300)
    assert f.tail.to_move(1.0) == []
    other_step = request("o", "o", step=3)  # not the job's current step: nothing is known of it
    f.run(other_step, f.tp[1], 0.0)
    f.heartbeat(f.tp[1], 1.0, 300)
    assert f.tail.to_move(1.0) == []


def test_count_moves_nothing_before_the_flip_and_everything_after_it_with_migrate_inflight(tmp_path: Path, files: FileWriter) -> None:
    f = Fleet(tmp_path, files, "tail.policy=count", "tail.threshold=0.25", "tail.migrate_inflight=true")
    assert f.pool.reserved is None and f.tail.targets(request("x", "x"))[0] is None
    a = f.tp[0]
    reqs = [request(f"r{i}", f"r{i}", seq=i) for i in range(3)]
    for req in reqs:
        f.run(req, a, 0.0)
    f.heartbeat(a, 1.0, 3000)
    assert f.tail.to_move(1.0) == []
    assert not f.tail.session_done("j", 0, "s0") and f.tail.session_done("j", 0, "s1")  # 2 of 8 = 0.25
    assert f.tail.targets(request("y", "y"))[0] == "tail"
    assert len(f.tail.to_move(1.0)) == 2  # the tail group's room, not all three at once


def test_a_predicted_session_falls_back_to_the_bulk_when_the_tail_is_full(tmp_path: Path, files: FileWriter) -> None:
    f = Fleet(tmp_path, files, "tail.policy=predict", "tail.long_tokens=100")
    rec = f.tail.records["j"]
    rec.finished("s", "", 500)
    assert f.tail.targets(request("s/1", "s")) == ("tail", BULK)
    for i in range(2):
        f.run(request(f"t{i}", f"t{i}", group="tail"), f.fast)
    assert f.tail.targets(request("s/1", "s")) == (BULK, None)  # no room: it starts on the bulk


def test_the_last_steps_long_turn_judges_the_hints_of_the_next(tmp_path: Path, files: FileWriter) -> None:
    f = Fleet(tmp_path, files, "tail.policy=age", "tail.long_quantile=0.5", "tail.long_min_finished=2")
    assert f.tail.targets(request("h/0", "h", hint=10**6)) == (BULK, None)  # nothing known yet
    rec = f.tail.records["j"]
    for i, n in enumerate([100, 300, 500, 700]):
        rec.finished(f"s{i}", "", n)
    f.tail.step_begin("j", 1, 8)
    assert f.tail.records["j"].last_long == 500
    f.tail.records["j"].finished("z", "", 10)  # past the step's start, where any turn fills the room
    assert f.tail.targets(request("h/1", "h", step=1, hint=501)) == ("tail", BULK)
    assert f.tail.targets(request("k/1", "k", step=1, hint=499)) == (BULK, None)
    assert f.tail.targets(request("n/1", "n", step=1)) == (BULK, None)  # no hint
    capped = request("c/1", "c", step=1, hint=10**6)
    capped.msg.sampling = Sampling(max_tokens=30)
    assert f.tail.targets(capped) == (BULK, None)  # its budget is 30 tokens, whatever its hint says
    f.tail.step_begin("j", 2, 8)  # a step that finished too little to judge keeps the limit before it
    assert f.tail.records["j"].last_long == 500


@pytest.mark.parametrize(("speeds", "expect_more"), [((100.0, 300.0), 1)])
def test_the_ring_follows_speed_at_step_boundaries_only_when_it_changed(speeds: tuple[float, float],
                                                                         expect_more: int) -> None:
    rs = [replica(0, g, 64) for g in ("a", "b")]  # two groups: a ring follows the speeds of groups
    ring = ConsistentHash(rs, load_factor=100.0)
    before = {s: ring.choose(f"s{s}", 0, rs) for s in range(2000)}
    for r, rate in zip(rs, speeds, strict=True):
        r.speed = SpeedMeter()
        r.speed.peak_tokens_per_s = rate
    ring.reweight()
    after = {s: ring.choose(f"s{s}", 0, rs) for s in range(2000)}
    share = sum(1 for r in after.values() if r is rs[expect_more]) / len(after)
    # ~3/4 of the sessions map to the 3x faster replica: its 96 points of 128 hold 3/4 of the ring give or
    # take 0.04 (one standard deviation of where the points fall), so within three of them (not 1/2).
    assert 0.62 < share < 0.88
    # Only sessions that moved toward the faster replica changed (consistent hashing).
    assert all(after[s] is rs[expect_more] for s in after if after[s] is not before[s])
    rs[0].speed.peak_tokens_per_s = 110.0  # a 10% change: the ring stays as it is
    ring.reweight()
    assert {s: ring.choose(f"s{s}", 0, rs) for s in range(2000)} == after


def test_replicas_of_one_group_share_its_weight_on_the_ring() -> None:
    rs = [replica(0, "g", 64), replica(1, "g", 64), replica(2, "g", 64), replica(0, "f", 64)]
    for r, rate in zip(rs, (100.0, 300.0, 0.0, 400.0), strict=True):
        r.speed = SpeedMeter()
        r.speed.peak_tokens_per_s = rate
    ring = ConsistentHash(rs, load_factor=100.0)
    ring.reweight()
    # g's mean peak is 200 (its third replica has none yet and takes the group's), f's 400; mean 250.
    assert ring.weights == pytest.approx({"g-0@h:0": 0.8, "g-1@h:1": 0.8, "g-2@h:2": 0.8, "f-0@h:0": 1.6})
    shares = Counter(ring.choose(f"s{s}", 0, rs).replica_id for s in range(8000))
    g = [shares[r.replica_id] / 8000 for r in rs[:3]]
    assert max(g) - min(g) < 0.06  # about 0.2 each: the peaks of 100 and 300 do not tell them apart
    assert 0.34 < shares["f-0@h:0"] / 8000 < 0.46  # 1.6 of 4


def test_a_request_s_tokens_are_estimated_from_heartbeats() -> None:
    m = SpeedMeter()
    m.update(0.0, 0, 2)
    assert m.tokens_since(0.0, 5.0) == 0.0  # no rate known yet
    m.update(1.0, 200, 2)  # 2 running: 100 tokens each
    assert m.per_request_total == 100.0
    assert m.tokens_since(0.0, 1.5) == pytest.approx(150.0)  # carried on at 100 tokens/s
    assert m.tokens_since(0.5, 1.0) == pytest.approx(50.0)  # half the interval
    # Dispatched at 1.9 while the last rate said 100/s; the interval turns out slower (10 tokens over
    # 1.5 running): the request's count is read off the real interval, never below zero.
    assert m.tokens_since(1.9, 1.95) == pytest.approx(5.0)
    m.update(2.0, 210, 1)
    assert m.tokens_since(1.9, 2.0) == pytest.approx(10 / 1.5 * 0.1)
    m.update(3.0, 410, 1)  # 200 tokens, 1 running
    assert m.tokens_since(1.9, 3.0) == pytest.approx(10 / 1.5 * 0.1 + 200)
    m.update(4.0, 50, 1)  # the engine restarted: its counter went back; no rate carried on
    assert m.tokens_since(3.0, 9.0) == pytest.approx(0.0)


def known(router, replica_id: str) -> Replica:  # type: ignore[no-untyped-def]
    r = router.pool.known(replica_id.encode())
    assert r is not None
    return r


def router_with_a_move(tmp_path: Path):  # type: ignore[no-untyped-def]
    """A router in this process (no engines: replicas are registered by hand, their messages sent by
    the test) with one long runner moving to a busy tail replica."""
    import time

    import zmq

    from toolkit.core import protocol as P
    from toolkit.router.server import Router

    cfg = compose_config(["tail.policy=age", "tail.long_tokens=10", "groups.tail.max_inflight=1",
                          "groups.throughput.replicas=1", "report.metrics=false"])
    rd = RunDir(tmp_path / "run")
    rd.make()
    ctx = zmq.Context()
    router = Router(cfg, rd, ctx)
    router.bind("127.0.0.1")
    for rid, group, slots in (("tp0", "throughput", 8), ("tl0", "tail", 1)):
        router.membership.register(rid.encode(), P.Register(rid, group, {}, "m", slots, 10_000, 1000))
        router.pool.set_ready(known(router, rid))
        router.membership.heartbeat(rid.encode(), P.Heartbeat(rid))
    tp, tl = known(router, "tp0"), known(router, "tl0")
    router.tail.step_begin("j", 0, 4)
    router.tail.records["j"].finished("z", "", 5)  # past the step's start: only long runners go to the tail

    def submit(rid: str, group: str | None = None, deadline: float = 0.0) -> None:
        msg = P.Generate(rid, job="j", session_id=rid, step=0, prompt_token_ids=[1, 2, 3],
                         sampling=P.Sampling(max_tokens=500), group=group, deadline=deadline)
        router.submit(b"client", msg, P._encoder.encode(msg))
        router.dispatch()

    submit("long", deadline=time.time() + 60)
    assert "long" in tp.inflight
    t = router.live["long"].est_mark
    tp.speed.update(t + 1.0, 100, 1)  # a heartbeat a second later: about 100 tokens, past long_tokens
    for req, r in router.tail.to_move(t + 1.0):  # what move_long_runners does, at that time
        router.migrations.start(req, r, "age", "tail")
    assert router.live["long"].migrating == "age" and router.tail.inbound == {"long"}
    submit("busy", group="tail")  # the tail replica's one slot is taken meanwhile
    assert "busy" in tl.inflight
    return router, ctx, tp, tl


def test_a_moved_request_waiting_for_room_expires_cleanly_and_frees_nothing_twice(tmp_path: Path) -> None:
    from toolkit.core import protocol as P

    router, ctx, tp, tl = router_with_a_move(tmp_path)
    try:
        part = P.Result("long", "cancelled", list(range(5, 25)), [-0.1] * 20, "abort", "tp0", "throughput")
        router.on_backend(b"tp0", *P.encode(part))  # continues, queued for the busy tail
        req = router.live["long"]
        assert req.replica is None and router.queue.size == 1 and not tp.inflight
        router._expire(req.msg.deadline + 1.0)  # its deadline (the continuation keeps it) passed while it waited
        assert "long" not in router.live and router.queue.size == 0 and not router.tail.inbound
        done = P.Result("busy", "ok", [1], [-0.1], "stop", "tl0", "tail")
        router.on_backend(b"tl0", *P.encode(done))
        router.dispatch()
        assert not tl.inflight and router.pool.spare_slots("tail") == 1  # nothing stale sent, no slot leaked
    finally:
        router.close()
        ctx.term()


def test_a_move_whose_replica_dies_gives_back_the_tail_room(tmp_path: Path) -> None:
    router, ctx, tp, tl = router_with_a_move(tmp_path)
    try:
        router.membership.drop(tp, "test: its engine died")  # before the partial Result came back
        req = router.live["long"]
        assert len(req.deaths) == 1 and not req.migrating and not router.tail.inbound
    finally:
        router.close()
        ctx.term()


def test_a_request_that_cannot_go_on_elsewhere_never_moves(tmp_path: Path, files: FileWriter) -> None:
    from toolkit.core.protocol import Structured

    f = Fleet(tmp_path, files, "tail.policy=age", "tail.long_tokens=10")
    a = f.tp[0]
    plain = request("p", "p", seq=2)
    # A continuation would restart the grammar after half a JSON value, or carry one of n samples.
    schema = request("s", "s", seq=0)
    schema.msg = Generate("s", job="j", session_id="s", step=0, prompt_token_ids=[1, 2, 3],
                          sampling=Sampling(max_tokens=5000, structured=Structured(choice=["yes", "no"])))
    two = request("n", "n", seq=1)
    two.msg = Generate("n", job="j", session_id="n", step=0, prompt_token_ids=[1, 2, 3],
                       sampling=Sampling(max_tokens=5000, n=2))
    for req in (schema, two, plain):
        f.run(req, a, 0.0)
    f.heartbeat(a, 1.0, 300)  # 100 tokens each, the two older ones first in line
    assert [req.request_id for req, _ in f.tail.to_move(1.0)] == ["p"]


def test_a_move_whose_abort_came_after_the_last_token_ends_ok_as_a_finished_turn(tmp_path: Path) -> None:
    from toolkit.core import protocol as P

    router, ctx, tp, tl = router_with_a_move(tmp_path)
    try:
        # The engine had produced the whole budget when the Abort reached it: nothing is left to continue.
        part = P.Result("long", "cancelled", [5] * 500, [-0.1] * 500, "abort", "tp0", "throughput")
        router.on_backend(b"tp0", *P.encode(part))
        res = P.decode_as(P.Result, router.answered.result("long") or b"")
        assert (res.status, res.finish_reason, len(res.output_token_ids), len(res.logprobs)) == ("ok", "length", 500, 500)
        assert "long" not in router.live and router.queue.size == 0 and not router.tail.inbound
        assert router.tail.records["j"].lengths.sorted() == [5, 500]  # the long turn counts for the step's quantile
    finally:
        router.close()
        ctx.term()


def test_work_left_is_what_the_last_step_expects_of_the_turn_and_of_the_sessions_turns_to_come() -> None:
    from toolkit.router.tail.trade import WorkLeft

    last = StepRecord(0)
    for session, turns in {"a": [100, 300], "b": [200, 600, 1000], "c": [400]}.items():
        for n in turns:
            last.finished(session, "", n)
    wl = WorkLeft.of(last)
    assert wl is not None and wl.mean == 2600 / 6
    # 250 tokens in: the longer turns were 300, 400, 600, 1000 -> 575 on average, 325 to come; a
    # session with one turn done: of those that ran more than one (2 and 3 turns), 0.5 more after this.
    assert wl(250, 1) == pytest.approx(325 + 0.5 * 2600 / 6)
    assert wl(250, 2) == pytest.approx(325)  # only b ran three turns: none after its third
    assert wl(5000, 3) == 0  # past everything the last step saw
    assert WorkLeft.of(StepRecord(0)) is None and WorkLeft.of(None) is None


def _trade_fleet(tmp_path: Path, files: FileWriter, margin: int) -> tuple[Fleet, list[Request], list[Request]]:
    """The job's step 0 saw sessions of three turns of 100 to 1,000 tokens; in step 1 the tail replica
    (2 places) holds two requests of 50 tokens, one in its session's last turn, and a long runner of
    300 tokens runs on the bulk in its session's first turn."""
    f = Fleet(tmp_path, files, "tail.policy=age", "tail.long_tokens=200", f"tail.trade_margin={margin}")
    rec = f.tail.records["j"]
    for i, n in enumerate([100, 200, 300, 400, 500, 1000] * 2):
        rec.finished(f"s{i % 4}", "", n)
    f.tail.step_begin("j", 1, 8)
    rec = f.tail.records["j"]
    rec.finished("z", "", 10)  # a turn of step 1 has ended: the tail takes long runners only
    rec.by_session.update({"last": [100, 100]})
    residents = [request("first", "first", step=1, seq=0), request("last", "last", step=1, seq=1)]
    for req in residents:
        f.run(req, f.fast, 0.0)
    runner = request("long", "long", step=1, seq=2)
    f.run(runner, f.tp[0], 0.0)
    f.heartbeat(f.fast, 1.0, 100)
    f.heartbeat(f.tp[0], 1.0, 300)
    return f, residents, [runner]


def test_a_long_runner_trades_places_with_the_tail_resident_of_least_work_left(tmp_path: Path, files: FileWriter) -> None:
    f, (first, last), (runner,) = _trade_fleet(tmp_path, files, 100)
    assert f.tail.room() == 0 and f.tail.to_move(1.0) == []  # full: nothing moves into room
    assert f.tail.to_trade(1.0) == [(runner, f.tp[0], last, f.fast)]  # the session in its last turn leaves
    # The runner holds the place "last" leaves: none is free for anything else until then, nor after.
    assert f.tail.room() == -1 and "long" in f.tail.inbound
    assert "last" not in f.tail.records["j"].on_tail and "first" in f.tail.records["j"].on_tail
    runner.migrating = last.migrating = "trade"
    assert f.tail.to_trade(1.0) == []  # both on their way: nothing more to trade


def test_no_trade_below_the_margin_in_a_jobs_first_step_or_after_the_flip(tmp_path: Path, files: FileWriter) -> None:
    f, _, _ = _trade_fleet(tmp_path, files, 10**6)
    assert f.tail.to_trade(1.0) == []  # the runner's lead is less than the margin
    first = Fleet(tmp_path / "first", files, "tail.policy=age", "tail.long_tokens=200", "tail.trade_margin=0")
    for i in range(2):
        first.run(request(f"t{i}", f"t{i}", seq=i), first.fast, 0.0)
    first.run(request("long", "long", seq=3), first.tp[0], 0.0)
    first.heartbeat(first.tp[0], 1.0, 1000)
    assert first.tail.to_trade(1.0) == []  # the job's first step: no last step to go on
    f2, _, _ = _trade_fleet(tmp_path / "flip", files, 0)
    f2.tail.flip.threshold = 0.1
    f2.tail.session_done("j", 1, "x")
    assert f2.tail.flipped("j", 1) and f2.tail.to_trade(1.0) == []


def _trades_by_scan(tail: TailRouting, now: float) -> list[tuple[Request, Replica, Request, Replica]]:
    """What ``to_trade`` chooses for job "j", the plain way: every running request priced and sorted."""
    rec, (_, work_left) = tail.records["j"], tail.work_left["j"]
    limits = tail.policy.move_limits(rec) if tail.policy is not None else None
    assert limits is not None and tail.tc.trade_margin is not None
    runners, residents = [], []
    for r in tail.pool.all():
        on_tail = r.group == tail.group
        for req in r.inflight.values():
            m = req.msg
            if (m.job != "j" or m.step != rec.step or req.migrating or req.deaths or req.client_aborted
                    or (m.group is not None and not (on_tail and req.moves))):
                continue
            tokens = len(req.prefix_tokens) + r.speed.tokens_since(req.est_mark, now)
            if not on_tail and limits.priority(tokens, hinted(m)) is None:
                continue
            work = work_left(tokens, len(rec.by_session.get(m.session_id, ())))
            (residents if on_tail else runners).append((work, req.seq, req, r))
    runners.sort(key=lambda w: (-w[0], w[1]))
    residents.sort(key=lambda w: (w[0], w[1]))
    out = []
    for (work, _, req, r), (least, _, out_req, t) in zip(runners, residents, strict=False):
        if work <= least + tail.tc.trade_margin:
            break
        out.append((req, r, out_req, t))
    return out


def test_the_trades_are_those_a_scan_of_every_running_request_chooses(tmp_path: Path, files: FileWriter) -> None:
    """``to_trade`` stops pricing a replica's requests without a hint or a move at the first that is not
    a long runner (those dispatched after it have generated no more): on random fleets (hints, moved
    requests, several dispatched at one instant, clients' aborts) it trades exactly what a scan of
    every running request trades."""
    rng = random.Random(3)
    seqs = iter(range(1_000_000))
    configs = [compose_config(["router.policy=consistent_hash", "tail.policy=age", "tail.long_tokens=100",
                               f"tail.trade_margin={margin}"]) for margin in (0, 50, 400)]
    for trial in range(150):
        f = Fleet(tmp_path / f"t{trial}", files, cfg=rng.choice(configs))
        f.tp = [*f.tp, replica(2, "throughput", 16), replica(3, "throughput", 16)]
        for r in f.tp[2:]:
            f.pool.add(r)
            f.pool.set_ready(r)
            r.speed.update(0.0, 0, 0)
        rec = f.tail.records["j"]
        for i in range(12):
            rec.finished(f"s{i % 5}", "", rng.randint(20, 2000))
        f.tail.step_begin("j", 1, 64)
        f.tail.records["j"].finished("z", "", 10)
        for k in range(f.fast.max_inflight):  # the tail group full
            f.run(_random_request(f"res{trial}/{k}", next(seqs), rng, step=1), f.fast, rng.choice([0.0, 0.5]))
        f.heartbeat(f.fast, 1.0, rng.randint(0, 400))
        for r in f.tp:
            t, generated = 0.0, 0
            while r.has_room and rng.random() < 0.9:
                t += rng.choice([0.0, 0.0, 0.5, 1.0])
                req = _random_request(f"{r.replica_id}/{trial}/{t}/{len(r.inflight)}", next(seqs), rng, step=1)
                req.client_aborted = rng.random() < 0.05
                f.run(req, r, t)
                generated += rng.randint(0, 400)
                f.heartbeat(r, t + 0.25, generated)
        now = rng.uniform(6.0, 15.0)
        expected = _trades_by_scan(f.tail, now)
        assert f.tail.to_trade(now) == expected, trial


@pytest.mark.parametrize(("move", "kv"), [("recompute", 0), ("kv", 5), ("auto", 5)])
def test_a_continuation_brings_its_whole_context_as_kv_only_with_tail_move_kv(
        tmp_path: Path, files: FileWriter, move: str, kv: int) -> None:
    from toolkit.config import moves_carry_kv
    from toolkit.core.protocol import Result
    from toolkit.router.migration import Migrations
    from toolkit.router.queue import FairQueue
    from toolkit.router.timeline import Timeline

    queue = FairQueue()
    migrations = Migrations(moves_carry_kv(compose_config([f"tail.move={move}"])), lambda ident, msg: None, queue,
                            Timeline(RunDir(tmp_path / "run"), files))
    req = request("r", "s")
    req.ids_below = 9  # its prompt's ids were checked against a vocabulary of 9
    migrations.resume(req, Result("r", status="cancelled", output_token_ids=[7, 8]), "age")
    assert req.msg.prompt_token_ids == [1, 2, 3, 7, 8] and req.msg.resumed_tokens == 2
    assert req.msg.kv_tokens == kv and queue.size == 1 and migrations.events == {"migrated:age": 1}
    assert req.ids_below == 9  # within it: no second check
    migrations.resume(req, Result("r", status="cancelled", output_token_ids=[9]), "age")
    assert req.ids_below == 0  # checked again where the continuation goes


def test_auto_moves_carry_kv_only_when_every_engine_can_receive_it() -> None:
    from toolkit.config import moves_carry_kv

    assert moves_carry_kv(compose_config([]))  # the sim everywhere
    assert not moves_carry_kv(compose_config(["engine=vllm", "engine.model=/m"]))
    assert not moves_carry_kv(compose_config(["tail.move=recompute"]))


def test_ticks_come_less_often_past_tick_replicas_in_proportion(tmp_path: Path, files: FileWriter) -> None:
    """A tick prices every replica's oldest request: up to TICK_REPLICAS replicas it comes every TICK_S,
    past them less often in proportion to the fleet, so that the ticks cost the router no more a second
    than TICK_REPLICAS replicas make them cost."""
    f = Fleet(tmp_path, files, "tail.policy=age")
    assert f.tail.tick_s() == TICK_S  # three replicas
    for n in range(3, TICK_REPLICAS):
        f.pool.add(replica(n, "throughput", 4))
    assert len(f.pool.all()) == TICK_REPLICAS and f.tail.tick_s() == TICK_S
    for n in range(TICK_REPLICAS, 8 * TICK_REPLICAS):
        f.pool.add(replica(n, "throughput", 4))
    assert f.tail.tick_s() == pytest.approx(8 * TICK_S)


def test_lengths_rank_like_a_sorted_list_as_they_grow() -> None:
    import random

    from toolkit.router.tail.lengths import Lengths

    rng = random.Random(5)
    lengths, ref = Lengths(), []
    assert len(lengths) == 0 and not lengths and lengths.sorted() == []
    for top in (3, 1000, 1024, 5000, 70_000):  # past the first size, then twice more
        for _ in range(300):
            v = rng.randint(0, top)
            lengths.add(v)
            ref.append(v)
        ref.sort()
        assert len(lengths) == len(ref) and lengths.sorted() == ref
        assert [lengths.kth(k) for k in range(len(ref))] == ref
    for bad in (-1, len(ref)):
        with pytest.raises(IndexError):
            lengths.kth(bad)
    with pytest.raises(ValueError, match="not negative"):
        lengths.add(-3)
