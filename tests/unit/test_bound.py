"""The step's lower bound (toolkit/rollout/bound.py) on constructed request logs, against the sim's
own time model summed step by step."""

from __future__ import annotations

import numpy as np
import pytest

from toolkit.config import compose_config, group_engine
from toolkit.core.protocol import GroupStatus, Result
from toolkit.engine.step_model import step_seconds
from toolkit.rollout.bound import step_bound
from toolkit.session.requests import RequestLog


def alone(c, prompt: int, cached: int, out: int) -> float:  # type: ignore[no-untyped-def]
    """One request alone, step by step as the sim runs it: the prefill rides on the first step."""
    return sum(step_seconds(c, prompt + k, prompt - cached if k == 0 else 0) for k in range(out))


def log_of(calls: list[tuple[int | tuple[int, int], float, list[tuple[int, int, int]]]]) -> dict[str, np.ndarray]:
    """Requests as (session, sent_at, [(prompt, cached, output), ...] sent together); a session is its index
    in step 0, or (the step it began in, its index there)."""
    log = RequestLog()
    for session, sent, reqs in calls:
        started, index = session if isinstance(session, tuple) else (0, session)
        for prompt, cached, out in reqs:
            log.add(Result("r", output_token_ids=[7] * out, cached_tokens=cached), None, prompt, sent, sent + 1.0,
                    index, started)
    return log.columns(["tail", "throughput"])


def test_the_critical_path_is_the_longest_session_alone_on_the_fastest_group() -> None:
    cfg = compose_config(["engine.time_scale=1.0"])  # throughput: TP-1, tail: TP-2
    tail = group_engine(cfg, "tail")
    req = log_of([
        (0, 0.0, [(100, 0, 50)]), (0, 2.0, [(160, 140, 400)]),  # two turns, one after the other
        (1, 0.0, [(100, 0, 300), (100, 0, 20)]),                # a call with n = 2: counts once
        (2, 0.0, [(50, 0, 10)]),
    ])
    b = step_bound(cfg, req, wall_s=10.0)
    assert b is not None
    # Prefill counts only what a turn adds to its session's context: 0 for the first turn, 160 - 150
    # for the second (cached or not in this run: the bound does not depend on the schedule's hits).
    want = alone(tail, 100, 100, 50) + alone(tail, 160, 150, 400)
    assert b["bound"]["critical_path_s"] == pytest.approx(want, rel=1e-9)
    assert b["bound"]["critical_session"] == 0 and b["bound"]["limited_by"] == "critical_path"
    assert b["bound_s"] == b["bound"]["critical_path_s"] and b["bound_ratio"] == pytest.approx(10.0 / b["bound_s"])
    # Slower engines in time_scale: everything scales with it.
    half = step_bound(compose_config(["engine.time_scale=0.5"]), req, wall_s=10.0)
    assert half is not None and half["bound_s"] == pytest.approx(b["bound_s"] / 2)


def test_a_session_carried_from_an_earlier_step_is_not_the_steps_own_of_the_same_index() -> None:
    """A step closed on a count runs sessions carried from earlier steps beside its own: index 0 of step 3
    and index 0 of step 4 are two sessions, side by side, not two turns of one."""
    cfg = compose_config(["engine.time_scale=1.0"])
    tail = group_engine(cfg, "tail")
    b = step_bound(cfg, log_of([((3, 0), 0.0, [(100, 0, 300)]), ((4, 0), 0.5, [(100, 0, 200)])]), wall_s=10.0)
    assert b is not None
    assert b["bound"]["critical_path_s"] == pytest.approx(alone(tail, 100, 100, 300), rel=1e-9)
    assert b["bound"]["critical_session"] == 0


def test_many_short_sessions_on_one_replica_are_bound_by_throughput() -> None:
    cfg = compose_config(["groups=single", "groups.throughput.replicas=1", "engine.time_scale=1.0",
                          "engine.max_num_seqs=8"])
    c = group_engine(cfg, "throughput")
    req = log_of([(i, 0.0, [(20, 0, 30)]) for i in range(64)])
    b = step_bound(cfg, req, wall_s=5.0)
    assert b is not None and b["bound"]["limited_by"] == "throughput"
    # 64 x 30 tokens in full batches of 8: the weight reads shared, every token's own KV (first turns:
    # no prefill counted).
    per_token = step_seconds(c, 0) / 8 + (20 + 29 / 2) * c.kv_bytes_per_token / c.hbm_bandwidth
    assert b["bound_s"] == pytest.approx(64 * 30 * per_token, rel=1e-9)
    assert b["bound"]["critical_path_s"] == pytest.approx(alone(c, 20, 20, 30), rel=1e-9)
    # Two replicas halve it; the critical path stays.
    two = step_bound(compose_config(["groups=single", "groups.throughput.replicas=2", "engine.time_scale=1.0",
                                     "engine.max_num_seqs=8"]), req, wall_s=5.0)
    assert two is not None and two["bound"]["throughput_s"] == pytest.approx(b["bound_s"] / 2)
    # So do two serving at the step's end when the config says one (toolkit.launch.scale added one).
    scaled = step_bound(cfg, req, wall_s=5.0, measured={"throughput": GroupStatus(registered=2, ready=2)})
    assert scaled is not None and scaled["bound"]["throughput_s"] == pytest.approx(b["bound_s"] / 2)


def test_requests_that_never_ran_cost_nothing() -> None:
    cfg = compose_config(["engine.time_scale=1.0"])
    ran = [(0, 0.0, [(100, 0, 50)])]
    refused = [(1, 0.0, [(60000, 0, 0)])]  # a client error: no engine ever saw it
    assert step_bound(cfg, log_of(ran + refused), 1.0) == step_bound(cfg, log_of(ran), 1.0)


def test_no_bound_without_a_time_model_or_without_tokens() -> None:
    req = log_of([(0, 0.0, [(10, 0, 5)])])
    assert step_bound(compose_config(["engine=vllm", "model=tiny"]), req, 1.0) is None
    assert step_bound(compose_config([]), log_of([(0, 0.0, [(10, 0, 0)])]), 1.0) is None


def test_other_engines_are_bound_by_the_speeds_the_router_measured() -> None:
    from toolkit.core.protocol import GroupStatus

    cfg = compose_config(["engine=vllm", "model=tiny"])
    req = log_of([(0, 0.0, [(10, 0, 100)]), (0, 1.0, [(120, 0, 300)]), (1, 0.0, [(10, 0, 50), (10, 0, 80)])])
    groups = {"throughput": GroupStatus(peak_tokens_per_s=1000.0, peak_request_tokens_per_s=40.0),
              "tail": GroupStatus(peak_tokens_per_s=500.0, peak_request_tokens_per_s=100.0)}
    b = step_bound(cfg, req, 20.0, groups)
    assert b is not None and b["bound"]["source"] == "measured"
    assert b["bound"]["critical_path_s"] == pytest.approx(400 / 100.0)  # session 0 at the fastest per-request rate
    assert b["bound"]["throughput_s"] == pytest.approx(530 / 1500.0)
    assert b["bound_s"] == pytest.approx(4.0) and b["bound_ratio"] == pytest.approx(5.0)
    assert step_bound(cfg, req, 20.0, {"tail": GroupStatus()}) is None  # nothing measured yet


def test_an_agents_time_between_its_calls_is_on_its_critical_path() -> None:
    # Session 0: two calls, each answered 1 s after it was sent; its harness takes 5 s between them.
    req = log_of([(0, 0.0, [(100, 0, 50)]), (0, 6.0, [(160, 140, 60)]), (1, 0.0, [(100, 0, 10)])])
    env = step_bound(compose_config(["engine.time_scale=1.0"]), req, wall_s=20.0)
    agent = step_bound(compose_config(["engine.time_scale=1.0", "workload=agent"]), req, wall_s=20.0)
    assert env is not None and agent is not None
    assert agent["bound"]["critical_path_s"] == pytest.approx(env["bound"]["critical_path_s"] + 5.0)
    assert agent["bound"]["critical_session"] == 0


def test_the_throughput_bound_at_max_inflight_is_at_most_as_good_as_at_full_batches() -> None:
    req = log_of([(i, 0.0, [(100, 0, 200)]) for i in range(64)])
    b = step_bound(compose_config(["engine.time_scale=1.0"]), req, wall_s=20.0)
    assert b is not None
    assert b["bound"]["throughput_at_max_inflight_s"] > b["bound"]["throughput_s"] > 0
