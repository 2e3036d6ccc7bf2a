"""The tail bench's fleet model (``toolkit/bench/tail_model.py``): it keeps every token, it agrees with
the step report's bound, and nothing it models beats that bound."""

from __future__ import annotations

import numpy as np
import pytest

from toolkit.bench import tail_model as tm
from toolkit.config import group_engine
from toolkit.engine.sim import step_seconds


def test_a_session_alone_on_the_tail_replica_takes_its_critical_path_plus_its_first_prefill() -> None:
    """The bound counts a session's turns decoded alone on the fastest group, and no prefill for its
    first prompt; the model, run with one session that the oracle starts on the tail replica, takes
    exactly that plus the first prompt's prefill (the replica is cold)."""
    cfg = tm.bench_config()
    prompts, lengths = np.array([300]), np.array([[700, 40, 1200]])
    oracle = next(d for d in tm.DESIGNS if d.name == "oracle")
    step = tm._Step(cfg, oracle, prompts, lengths)
    out = step.run()
    tail = group_engine(cfg, cfg.tail.group)
    prefill = 300 * (step_seconds(tail, 0, 1) - step_seconds(tail, 0)) * cfg.engine.time_scale
    bound = out["wall_s"] / out["bound_ratio"]
    assert out["wall_s"] == pytest.approx(bound + prefill, rel=1e-9)
    assert {r[0] for r in step.rows} == {0} and [r[2] for r in step.rows] == [700, 40, 1200]


@pytest.mark.parametrize("design", tm.DESIGNS, ids=lambda d: d.name)
def test_every_design_finishes_every_turn_whole_and_never_beats_the_bound(design: tm.Design) -> None:
    cfg = tm.bench_config()
    for seed in range(2):
        prompts, lengths = tm.workload(cfg.engine, seed, 2048)
        step = tm._Step(cfg, design, prompts, lengths)
        out = step.run()
        rows = np.array(step.rows)
        assert len(rows) == lengths.size and rows[:, 2].sum() == lengths.sum()  # no token lost or added
        assert out["bound_ratio"] >= 1.0
        # A session's turns run one after another: each is sent when the one before it ended.
        for s in range(len(prompts)):
            mine = rows[rows[:, 0] == s]
            assert (mine[1:, 3] >= mine[:-1, 4]).all()
        if design.policy in ("age", "peek"):
            assert out["moves"] > 0  # the workload has long runners to move
        else:
            assert out["moves"] == 0


def test_the_quick_run_reports_every_design_for_both_workloads() -> None:
    r = tm.run(quick=True)
    for key in ("designs", "moderate_tail"):
        assert set(r[key]) == {d.name for d in tm.DESIGNS}
        assert r[key]["off"]["speedup"] == 1.0
        for fig in r[key].values():
            assert fig["step_time_s"] > 0 and fig["bound_ratio"] >= 1 and 0 < fig["prefix_hit"] < 1
