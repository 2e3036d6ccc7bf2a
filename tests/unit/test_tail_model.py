"""The tail bench's fleet model (``toolkit/bench/tail_model.py``): it keeps every token, it agrees with
the step report's bound, and nothing it models beats that bound."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from toolkit.bench import tail_model as tm
from toolkit.config import group_engine
from toolkit.core.rundir import RunDir
from toolkit.engine.sim import step_seconds


def test_a_session_alone_on_the_tail_replica_takes_its_critical_path_plus_the_prefill_it_pays() -> None:
    """The bound counts a session's turns decoded alone on the fastest group, and no prefill for its
    first prompt; the model, run with one session that the oracle starts on the tail replica, takes
    exactly that plus the prefill the bound leaves out."""
    cfg = tm.bench_config()
    prompts, lengths = np.array([300]), np.array([[700, 40, 1200]])
    oracle = next(d for d in tm.DESIGNS if d.name == "oracle")
    step = tm.Step(cfg, oracle, prompts, lengths)
    out = step.run()
    tail = group_engine(cfg, cfg.tail.group)
    # Its first prompt is prefilled whole (the replica is cold); a later turn's context is cached in
    # whole blocks of what the turn before ended with, so a part block is prefilled again with the
    # new observation tokens the bound counts.
    ends = [300 + 700, 300 + 700 + 24 + 40]
    extra = 300 + sum(e % tail.block_size for e in ends)
    prefill = extra * (step_seconds(tail, 0, 1) - step_seconds(tail, 0)) * cfg.engine.time_scale
    bound = out["wall_s"] / out["bound_ratio"]
    assert out["wall_s"] == pytest.approx(bound + prefill, rel=1e-9)
    assert {r[0] for r in step.rows} == {0} and [r[2] for r in step.rows] == [700, 40, 1200]


@pytest.mark.parametrize("design", tm.DESIGNS, ids=lambda d: d.name)
def test_every_design_emits_every_token_once_and_never_beats_the_bound(design: tm.Design) -> None:
    cfg = tm.bench_config()
    for seed in range(2):
        prompts, lengths = tm.workload(cfg, seed)
        step = tm.Step(cfg, design, prompts, lengths)
        out = step.run()
        rows = np.array(step.rows)
        # One token per running turn per engine step, none to a turn that moved away mid-step.
        assert step.emitted == lengths.sum()
        for s in range(len(prompts)):
            assert rows[rows[:, 0] == s][:, 2].tolist() == lengths[s].tolist()
        assert out["bound_ratio"] >= 1.0
        # 144 slots for 128 sessions: the router's bounded-load hashing always finds one.
        assert out["waits"] == 0
        if design.policy in ("age", "rank") or design.reveal is not None:
            assert out["moves"] > 0  # the workload has long runners to move
        else:
            assert out["moves"] == 0


def test_a_full_fleet_makes_turns_wait_and_serves_them_oldest_first() -> None:
    """With fewer slots than sessions, turns wait; a freed slot goes to the oldest waiting turn, not to
    the next turn of the session that freed it."""
    cfg = tm.bench_config()
    cfg.groups["throughput"].max_inflight = 8
    off = next(d for d in tm.DESIGNS if d.name == "off")
    prompts, lengths = tm.workload(cfg, 0)
    step = tm.Step(cfg, off, prompts, lengths)
    out = step.run()
    assert out["waits"] > 0 and step.emitted == lengths.sum()
    first = sorted((t for t in step.finished if t.turn == 0), key=lambda t: t.session)
    started = [t.dispatched for t in first]
    assert started.count(0.0) == 2 * 8 + cfg.groups["tail"].max_inflight  # the fleet's slots
    waited = [d for d in started if d]
    assert waited == sorted(waited)  # sent in session order at t=0: placed in that order
    # No turn is placed before one sent earlier that still waits (a next turn never jumps the queue).
    sent = np.array([t.sent for t in step.finished])
    placed = np.array([t.dispatched for t in step.finished])
    jumped = (sent[:, None] > sent[None, :]) & (placed[:, None] < placed[None, :])
    assert not jumped.any()


def test_rank_swaps_the_tail_replicas_lowest_for_a_session_with_more_work_left() -> None:
    """With room for one on the tail replica and an exact predictor, the first long turn goes there;
    when a longer one starts on the bulk, the two trade places, and every token is still emitted once."""
    cfg = tm.bench_config()
    cfg.groups["tail"].max_inflight = 1
    design = next(d for d in tm.DESIGNS if d.name == "rank_foresight0")
    prompts, lengths = np.array([100, 100]), np.array([[600, 1, 1], [100, 2000, 1]])
    step = tm.Step(cfg, design, prompts, lengths)
    step.run()
    assert step.emitted == lengths.sum()
    ended = {(t.session, t.turn): t.replica.group for t in step.finished if t.replica is not None}
    assert ended[(1, 1)] == "tail"  # moved there, and never swapped out: nothing outranks it
    assert ended[(0, 0)] == "throughput"  # moved there first, then swapped back for session 1
    assert step.moves == 3


def _running(step: tm.Step) -> list:  # type: ignore[type-arg]
    """Every placed turn running on its replica (as after their first engine step)."""
    for r in step.replicas:
        r.running += [t for t, _ in r.admit]
        r.admit = []
    return sorted((t for r in step.replicas for t in r.running), key=lambda t: t.session)


def test_age_swap_trades_the_tail_replicas_resident_of_least_work_for_a_long_runner() -> None:
    """The tail replica (room for one) holds a session's last turn, just begun; a first turn on the bulk
    has run 1,000 tokens, past the long-turn limit, with two turns to follow: they trade places."""
    from toolkit.router.tail.base import MoveLimits

    cfg = tm.bench_config()
    cfg.groups["tail"].max_inflight = 1
    design = next(d for d in tm.DESIGNS if d.name == "age_swap")
    step = tm.Step(cfg, design, np.array([100, 100]), np.array([[5, 5, 5], [2000, 5, 5]]))
    resident, runner = _running(step)
    assert resident.replica is step.tail and runner.replica in step.bulk  # nothing finished: the first goes there
    resident.turn, runner.produced = 2, 1000
    step._rank(MoveLimits(50, None))
    assert runner.replica is step.tail and resident.replica in step.bulk and step.moves == 2
    # One that is not past the limit stays, whatever its session has left.
    step2 = tm.Step(cfg, design, np.array([100, 100]), np.array([[5, 5, 5], [2000, 5, 5]]))
    resident, young = _running(step2)
    resident.turn, young.produced = 2, 40
    step2._rank(MoveLimits(50, None))
    assert young.replica in step2.bulk and step2.moves == 0


def test_age_behind_starts_the_next_turn_of_a_session_behind_the_step_on_the_tail_replica() -> None:
    cfg = tm.bench_config()
    design = next(d for d in tm.DESIGNS if d.name == "age_behind0.5")
    step = tm.Step(cfg, design, np.array([100] * 4), np.full((4, 3), 5))
    step.record.by_session = {"0": [5, 5], "1": [5, 5], "2": [5], "3": [5]}
    from toolkit.bench.tail_events import _Turn

    assert step._behind(_Turn(3, 1, 100, 5, 0.0))  # 2 of 4 sessions have finished their second turn
    assert not step._behind(_Turn(0, 2, 100, 5, 0.0))  # nobody has finished a third
    assert not step._behind(_Turn(3, 0, 100, 5, 0.0))  # a first turn is never behind


def test_age_kv_swap_carries_both_requests_kv_so_neither_replica_prefills_them() -> None:
    from toolkit.router.tail.base import MoveLimits

    cfg = tm.bench_config()
    cfg.groups["tail"].max_inflight = 1
    design = next(d for d in tm.DESIGNS if d.name == "age_kv_swap")
    step = tm.Step(cfg, design, np.array([100, 100]), np.array([[5, 5, 5], [2000, 5, 5]]))
    resident, runner = _running(step)
    resident.turn, runner.produced = 2, 1000
    step._rank(MoveLimits(50, None))
    assert runner.replica is step.tail and resident.replica in step.bulk and step.moves == 2
    # Each lands with nothing to prefill, once its KV has crossed the link.
    assert step.tail.admit == [(runner, 1)] and runner.kv_ready > step.now
    assert (resident, 1) in resident.replica.admit and resident.kv_ready > step.now


def test_oracle_reveal_tells_the_longest_sessions_apart_only_once_few_first_turns_run() -> None:
    """The tail replica (room for one) takes the first turn that comes; the oracle knows session 1 is the
    longest but moves it there, trading places with session 0, only once at most one first turn runs."""
    cfg = tm.bench_config()
    cfg.groups["tail"].max_inflight = 1
    design = tm.Design("reveal", "oracle", kv=True, reveal=1)
    step = tm.Step(cfg, design, np.array([100, 100, 100]), np.array([[900, 5, 5], [1000, 800, 800], [50, 5, 5]]))
    step.favoured = {1}
    first, longest, other = _running(step)
    assert first.replica is step.tail and longest.replica in step.bulk
    step._reveal(1)
    assert longest.replica in step.bulk and step.moves == 0  # three first turns run: it cannot tell yet
    first.turn = other.turn = 1  # now only the longest session's first turn runs
    step._reveal(1)
    assert longest.replica is step.tail and first.replica in step.bulk and step.moves == 2
    assert step.tail.admit == [(longest, 1)]  # its KV travelled: nothing to prefill


def test_oracle_reveal_starts_the_longest_sessions_later_turns_on_the_tail_replica() -> None:
    cfg = tm.bench_config()
    step = tm.Step(cfg, tm.Design("reveal", "oracle", kv=True, reveal=1), np.array([100] * 3), np.full((3, 3), 5))
    step.favoured = {1}
    from toolkit.bench.tail_events import _Turn

    assert step._target(_Turn(1, 1, 100, 5, 0.0)) is step.tail
    assert step._target(_Turn(2, 1, 100, 5, 0.0)) in step.bulk  # not among the longest


def test_a_runs_steps_replay_with_each_sessions_own_turns(tmp_path: Path) -> None:
    """``run_workload`` reads a step's sessions back from its Parquet file (a turn is a run of the loss
    mask); a session with fewer turns than the step's most runs only its own in the model."""
    run = RunDir(tmp_path)
    run.steps.mkdir(parents=True)
    masks = [[1] * 5 + [0] * 3 + [1] * 7, [1] * 4, [0] * 6]  # two turns; one; none (failed before a token)
    pq.write_table(pa.table({"prompt_length": [100, 50, 80], "loss_mask": masks}), run.step_parquet(3))
    prompts, lengths = tm.run_workload(run.step_parquet(3))
    assert prompts.tolist() == [100, 50, 80] and lengths.tolist() == [[5, 7], [4, 0], [0, 0]]
    for design in tm.TWINS.values():
        step = tm.Step(tm.bench_config(), design, prompts, lengths)
        step.run()
        assert step.emitted == 16 and sorted((r[0], r[2]) for r in step.rows) == [(0, 5), (0, 7), (1, 4)]
    twin = tm.twin(tm.bench_config(), run, [3], tm.TWINS)
    assert twin["steps"] == 1 and set(twin["speedup"]) == {"age", "age+kv", "age+trade+kv"}
