"""The tail bench's designs run by the fleet twin, quick (both workloads, every design, two rooms): a
whole benchmark's smoke run, kept beside the other benchmarks' out of the unit tier's two minutes."""

from __future__ import annotations

import pytest

from toolkit.bench import tail_model as tm


@pytest.mark.slow
def test_the_quick_run_reports_every_design_for_both_workloads() -> None:
    r = tm.run(quick=True)
    for key in ("designs", "moderate_tail"):
        assert set(r[key]) == set(tm.DESIGNS)
        for fig in r[key].values():
            assert fig["step_time_s"] > 0 and fig["bound_ratio"] >= 1 and 0 < fig["prefix_hit"] < 1
        assert r[key]["off"]["moves_per_step"] == 0 and r[key]["age"]["moves_per_step"] > 0
    assert set(r["rooms"]) == {"16", "24"}
