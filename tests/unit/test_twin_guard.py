"""A guard for routing changes: the twin runs the headline workload (the tail bench's, 12 steps) on the
default fleet and policy, and fails if the predicted mean step time is more than 2% worse than the
figure stored in ``tests/helpers/data/twin_headline.json``. A change that means to move it updates
that file, with the reason in the commit. The twin is deterministic: the same config gives the same
virtual times on any machine."""

from __future__ import annotations

import json

from tests.helpers.paths import DATA
from toolkit.config import compose_config
from toolkit.launch.validation import validate
from toolkit.plan.summary import summarize
from toolkit.plan.twin import Twin

TOLERANCE = 0.02


def test_the_default_policy_keeps_its_predicted_step_time_on_the_headline_workload() -> None:
    stored = json.loads((DATA / "twin_headline.json").read_text())
    cfg = compose_config(stored["overrides"])
    validate(cfg)
    predicted = summarize(Twin(cfg).run())["step_time_s"]
    assert predicted <= stored["step_time_s"] * (1 + TOLERANCE), (
        f"the default policy's predicted step time on the headline workload is {predicted:.4f}s, "
        f"{predicted / stored['step_time_s'] - 1:+.1%} against the stored {stored['step_time_s']}s; "
        "if the change means it, update tests/helpers/data/twin_headline.json and say why in the commit")
