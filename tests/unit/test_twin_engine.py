"""The twin's engine (``toolkit/plan/engine.py``) against the sim engine itself: both run in the same
virtual-time loop on constructed cases (one request, a full batch, arrivals mid-stretch, an abort, a
moved request's KV), and every request must end at the same virtual time with the same tokens. The
one-request case is also checked against times added up by hand from the sim's step model."""

from __future__ import annotations

import asyncio
import dataclasses
import operator
from dataclasses import dataclass
from typing import Any

import pytest

from toolkit.config import SimEngineConfig
from toolkit.core.protocol import Generate, Result, Sampling
from toolkit.engine.plans import plan_output
from toolkit.engine.sim import SimEngine
from toolkit.engine.step_model import step_seconds
from toolkit.plan.engine import MovedPlans, TwinEngine
from toolkit.plan.loop import FAR_S, Stalled, VirtualLoop

# Context reads matter (kv_bytes_per_token), prefill matters, and one step is ~10 ms.
CFG = SimEngineConfig(step_overhead_s=0.002, weight_bytes=16e9, hbm_bandwidth=2e12, kv_bytes_per_token=4e6,
                      prefill_tokens_per_s=20000.0, max_num_seqs=3, output_len_median=20.0, output_len_sigma=0.8,
                      kv_cache_tokens=100_000)


def req(i: int, prompt_len: int = 40, max_tokens: int = 64, kv_tokens: int = 0) -> Generate:
    prompt = [(7 * i + j) % 500 + 1 for j in range(prompt_len)]
    return Generate(request_id=f"r{i}", session_id=f"s{i}", prompt_token_ids=prompt,
                    sampling=Sampling(max_tokens=max_tokens, seed=i), kv_tokens=kv_tokens)


@dataclass
class Event:
    at: float
    kind: str  # submit | abort
    msg: Generate | None = None
    rid: str = ""


def run_sim(events: list[Event], cfg: SimEngineConfig = CFG) -> dict[str, tuple[float, Result]]:
    loop = VirtualLoop()
    engine = SimEngine(cfg)
    done: dict[str, tuple[float, Result]] = {}

    async def one(msg: Generate) -> None:
        res = await engine.generate(msg)
        done[msg.request_id] = (loop.time(), res)

    async def main() -> None:
        engine._task = loop.create_task(engine._run())  # start() would add a signal handler: no self-pipe here
        tasks = []
        for e in sorted(events, key=lambda e: e.at):
            if e.at > loop.time():  # what happens at one instant happens in one turn of the loop
                await asyncio.sleep(e.at - loop.time())
            if e.kind == "submit":
                assert e.msg is not None
                tasks.append(loop.create_task(one(e.msg)))
            else:
                await engine.abort(e.rid)
        await asyncio.gather(*tasks)
        engine._task.cancel()

    try:
        loop.run(main())
    finally:
        loop.close()
    return done


def run_twin(events: list[Event], cfg: SimEngineConfig = CFG) -> dict[str, tuple[float, Result]]:
    loop = VirtualLoop()
    done: dict[str, tuple[float, Result]] = {}
    engine = TwinEngine(cfg, loop, lambda res: done.__setitem__(res.request_id, (loop.time(), res)))
    def happen(at: float) -> None:  # in order: timers due at one instant leave asyncio's heap in any order
        for e in events:
            if e.at == at:
                engine.submit(e.msg) if e.kind == "submit" else engine.abort(e.rid)

    for at in sorted({e.at for e in events}):
        loop.call_at(at, happen, at)

    async def main() -> None:
        while len(done) < sum(e.kind == "submit" for e in events):
            await asyncio.sleep(0.001)

    try:
        loop.run(main())
    finally:
        loop.close()
    return done


def same(a: dict[str, tuple[float, Result]], b: dict[str, tuple[float, Result]]) -> None:
    assert a.keys() == b.keys()
    for rid in a:
        (ta, ra), (tb, rb) = a[rid], b[rid]
        assert (rid, ra.status, ra.output_token_ids, ra.cached_tokens) == (rid, rb.status, rb.output_token_ids,
                                                                          rb.cached_tokens)
        # The sim's answer reaches its caller a loop turn after the step (its future's callback).
        assert tb == pytest.approx(ta, abs=1e-9), rid


def test_one_request_ends_when_the_sims_steps_added_up_by_hand_say() -> None:
    msg = req(1)
    n = len(plan_output(CFG, msg)[0])
    p = len(msg.prompt_token_ids)
    by_hand = sum(step_seconds(CFG, p + i, p if i == 0 else 0) for i in range(n))
    twin = run_twin([Event(0.0, "submit", msg)])
    assert twin["r1"][0] == pytest.approx(by_hand, rel=1e-12)
    assert len(twin["r1"][1].output_token_ids) == n
    same(run_sim([Event(0.0, "submit", msg)]), twin)


def test_a_full_batch_admits_the_waiting_at_the_boundary_where_a_place_frees() -> None:
    events = [Event(0.0, "submit", req(i)) for i in range(7)]  # max_num_seqs=3: four wait
    sim, twin = run_sim(events), run_twin(events)
    same(sim, twin)
    assert max(t for t, _ in twin.values()) > 2 * min(t for t, _ in twin.values())


def test_arrivals_mid_stretch_join_at_the_next_step_boundary() -> None:
    events = [Event(0.0, "submit", req(0, max_tokens=200)), Event(0.0313, "submit", req(1)),
              Event(0.05, "submit", req(2, prompt_len=300)), Event(0.0501, "submit", req(3)),
              Event(0.4, "submit", req(4)), Event(0.41, "submit", req(5))]
    same(run_sim(events), run_twin(events))


def test_an_abort_mid_stretch_keeps_the_tokens_of_the_steps_done_and_the_others_go_on() -> None:
    events = [Event(0.0, "submit", req(0, max_tokens=300)), Event(0.0, "submit", req(1, max_tokens=300)),
              Event(0.0, "submit", req(2)), Event(0.0, "submit", req(3)),
              Event(0.0777, "abort", rid="r0"), Event(0.1, "abort", rid="r3")]
    sim, twin = run_sim(events), run_twin(events)
    same(sim, twin)
    assert twin["r0"][1].status == "cancelled" and 0 < len(twin["r0"][1].output_token_ids)


def test_a_moved_requests_kv_lands_after_its_link_time_and_counts_as_neither_hit_nor_miss() -> None:
    base = req(0)
    moved = Generate(request_id="m", session_id="s0", prompt_token_ids=base.prompt_token_ids + [9] * 60,
                     sampling=Sampling(max_tokens=64, seed=3), kv_tokens=80)
    events = [Event(0.0, "submit", base), Event(0.02, "submit", moved), Event(0.021, "submit", req(5))]
    same(run_sim(events), run_twin(events))


def test_a_twin_waiting_on_nothing_that_will_happen_says_it_stalled() -> None:
    loop = VirtualLoop()
    try:
        with pytest.raises(Stalled):
            loop.run(loop.create_future())
    finally:
        loop.close()


def test_a_moved_requests_plan_is_its_first_legs_rest_on_engines_of_the_same_config() -> None:
    """``MovedPlans`` gives a continuation what ``plan_output`` computes for it, from the first leg's plan;
    an engine of another config plans again; a finished request's plan is gone."""
    calls: list[str] = []

    def counted(cfg: SimEngineConfig, msg: Generate) -> tuple[list[int], list[float], str]:
        calls.append(msg.request_id)
        return plan_output(cfg, msg)

    plans = MovedPlans(counted)
    first = req(3, max_tokens=200)
    tokens, logprobs, finish = plans(CFG, first)
    k = 5
    assert len(tokens) > k
    cont = Generate(request_id="r3", session_id="s3", prompt_token_ids=first.prompt_token_ids + tokens[:k],
                    sampling=Sampling(max_tokens=200 - k, seed=3), resumed_tokens=k)
    same_config = dataclasses.replace(CFG, tensor_parallel_size=2)  # plans alike (a tail group's engine)
    assert plans(same_config, cont) == plan_output(CFG, cont) == (tokens[k:], logprobs[k:], finish)
    assert calls == ["r3"]  # planned once
    other = dataclasses.replace(CFG, vocab_size=999)
    plans(other, cont)
    plans.finished("r3")
    plans(CFG, cont)
    assert calls == ["r3", "r3", "r3"]  # another config, then a finished request: planned again


def test_the_virtual_loops_timers_run_in_time_order_ties_as_set_and_cancelled_ones_never() -> None:
    """Its own timer heap (``(when, n, handle)``): the clock jumps to each timer's time exactly; timers due at
    the same time run in the order they were set; a cancelled one never runs, also once so many are
    cancelled that the heap is rebuilt; ``call_soon`` callbacks run before a later timer."""
    loop = VirtualLoop()
    ran: list[tuple[float, object]] = []

    def note(tag: object) -> None:
        ran.append((loop.time(), tag))

    async def main() -> None:
        for i in range(300):  # 300 timers at 5 s, most of them cancelled: the heap is rebuilt
            h = loop.call_at(5.0, note, ("tie", i))
            if i % 3:
                h.cancel()
        loop.call_later(0.25, note, "a")
        loop.call_at(7.5, note, "c")
        loop.call_at(0.25, note, "b")  # the same time as "a", set after it
        loop.call_soon(note, "now")
        await asyncio.sleep(10)

    loop.run(main())
    loop.close()
    ties = [(t, tag) for t, tag in ran if isinstance(tag, tuple)]
    assert ties == [(5.0, ("tie", i)) for i in range(0, 300, 3)]
    assert [x for x in ran if not isinstance(x[1], tuple)] == [(0.0, "now"), (0.25, "a"), (0.25, "b"), (7.5, "c")]
    assert loop.now == 10.0


def test_timers_set_far_ahead_run_in_the_same_order_as_near_ones() -> None:
    """Timers due ``FAR_S`` or more past when they were set wait in a heap of their own: they still run at
    their time, ties with near ones in the order they were all set (a far one set first runs first), a
    cancelled one never, and a loop with nothing else to do jumps to the first of them, a day at a time."""
    loop = VirtualLoop()
    ran: list[tuple[float, str]] = []

    def note(tag: str) -> None:
        ran.append((loop.time(), tag))

    async def main() -> None:
        loop.call_at(100.0, note, "far first")  # far: set 100 s ahead
        loop.call_at(100.0 + FAR_S, note, "far, cancelled").cancel()
        loop.at(100.0, note, "far second")
        await asyncio.sleep(50.0)
        loop.at(100.0, note, "near, set last")  # 50 s ahead: near, and the same time as the far ones
        loop.later(1.0, note, "near")
        await asyncio.sleep(60.0)
        loop.call_later(3 * 86400.0, note, "days")  # far, with nothing else due before it
        await asyncio.sleep(3 * 86400.0 + 1.0)

    loop.run(main())
    loop.close()
    assert ran == [(51.0, "near"), (100.0, "far first"), (100.0, "far second"), (100.0, "near, set last"),
                   (110.0 + 3 * 86400.0, "days")]


def test_the_virtual_loops_own_callbacks_keep_call_soons_order_and_a_raise_ends_the_run() -> None:
    """``soon`` (the twin's links and engines) and ``call_soon`` share one queue, in the order they were
    called; a cancelled handle never runs; one that raises ends ``run`` with its exception."""
    loop = VirtualLoop()
    ran: list[str] = []

    async def main() -> None:
        loop.soon(ran.append, "a")
        loop.call_soon(ran.append, "b")
        loop.call_soon(ran.append, "never").cancel()
        loop.soon(ran.append, "c")
        loop.call_soon(loop.soon, ran.append, "e")  # a turn later
        loop.soon(ran.append, "d")
        await asyncio.sleep(1)

    loop.run(main())
    assert ran == ["a", "b", "c", "d", "e"]
    ran.clear()

    async def timers() -> None:  # ``at``/``later`` and ``call_at``/``call_later``: one heap, ties in call order
        t = loop.now
        loop.later(2, ran.append, "2a")
        loop.call_at(t + 2, ran.append, "2b")
        loop.at(t + 1, ran.append, "1")
        loop.later(1.5, ran.append, "never").cancel()
        loop.at(t + 2, ran.append, "2c")
        await asyncio.sleep(3)

    loop.run(timers())
    assert ran == ["1", "2a", "2b", "2c"]

    for schedule in (lambda: loop.soon(operator.truediv, 1, 0), lambda: loop.later(0.5, operator.truediv, 1, 0)):
        async def raises(schedule: Any = schedule) -> None:
            schedule()
            await asyncio.sleep(1)

        with pytest.raises(ZeroDivisionError):
            loop.run(raises())
    loop.close()
