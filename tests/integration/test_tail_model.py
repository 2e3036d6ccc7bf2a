"""The fleet model's quick benchmark run (both workloads, every design): a whole benchmark's smoke run,
kept beside the other benchmarks' (tests/integration/test_bench.py) out of the unit tier's two minutes.
The model's properties: tests/unit/test_tail_model.py."""

from __future__ import annotations

import pytest

from toolkit.bench import tail_model as tm


@pytest.mark.slow
def test_the_quick_run_reports_every_design_for_both_workloads() -> None:
    r = tm.run(quick=True)
    for key in ("designs", "moderate_tail"):
        assert set(r[key]) == {d.name for d in tm.DESIGNS}
        for fig in r[key].values():
            assert fig["step_time_s"] > 0 and fig["bound_ratio"] >= 1 and 0 < fig["prefix_hit"] < 1
