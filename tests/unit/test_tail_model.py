"""The tail bench's designs for the fleet twin (``toolkit/bench/tail_model.py``): each is a setting of
the router's that composes and validates, so the bench runs what a user can run, nothing else."""

from __future__ import annotations

import pytest

from toolkit.bench import tail_model as tm


@pytest.mark.parametrize("name", sorted(tm.DESIGNS))
def test_every_design_is_a_valid_config_of_the_tail_benchs_workload(name: str) -> None:
    cfg = tm.bench_config(tm.DESIGNS[name], steps=2)
    assert cfg.sessions_per_step == tm.SESSIONS and cfg.steps == 2
