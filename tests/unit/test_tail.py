"""Tail routing without processes: the flip count, validation at setup, a step report waiting for a
flip the last session made. With a real router and sim replicas: tests/integration/test_tail.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException

from toolkit.config import ConfigError, compose_config, flip_count
from toolkit.launch.composition import check_overrides
from toolkit.launch.validation import validate


@pytest.mark.parametrize(("threshold", "n", "expected"), [(0.95, 128, 122), (0.9, 32, 29), (1.0, 7, 7),
                                                          (0.95, 100, 95), (0.01, 10, 1)])
def test_flip_count(threshold: float, n: int, expected: int) -> None:
    assert flip_count(threshold, n) == expected == max(1, math.ceil(round(threshold * n, 9)))


def test_each_tail_validation_error_is_reported_at_setup() -> None:
    bad = {
        "tail.threshold=0": "tail.threshold",
        "tail.threshold=1.01": "tail.threshold",
        "tail.group=nope": "tail.group",
    }
    for override, field in bad.items():
        with pytest.raises(ConfigError) as info:
            validate(compose_config(["tail.threshold=0.9", override]))
        assert field in {e.field for e in info.value.errors}, override
    with pytest.raises(ConfigError) as info:
        validate(compose_config(["groups=single", "tail.threshold=0.9", "tail.group=throughput"]))
    assert "besides the tail group" in str(info.value)
    # Everything at once.
    with pytest.raises(ConfigError) as info:
        validate(compose_config(["tail.threshold=2", "groups.tail.replicas=0", "job="]))
    assert {"tail.threshold", "groups.tail.replicas", "job"} <= {e.field for e in info.value.errors}
    # How moves take their context, and trades: each bad value named, with what is allowed.
    with pytest.raises(ConfigError) as info:
        check_overrides(["tail.move=teleport", "tail.trade_margin=-5"])  # a bad choice, with the rest
    found = {(e.field, e.value) for e in info.value.errors}
    assert found == {("tail.move", "teleport"), ("tail.trade_margin", -5)}
    with pytest.raises(ConfigError, match="cannot receive a request's KV") as info:
        validate(compose_config(["tail.move=kv", "engine=vllm", "engine.model=/m"]))
    validate(compose_config(["tail.move=kv", "tail.policy=age", "tail.trade_margin=0"]))
    # There is always a router: the structured config refuses to drop it, at composition.
    with pytest.raises(ConfigCompositionException, match="router=null") as composed:
        compose_config(["tail.threshold=0.9", "router=null"])
    assert "not Optional" in str(composed.value.__cause__)


def test_the_step_report_waits_for_a_flip_the_last_session_made(tmp_path: Path) -> None:
    """tail.threshold=1: the step's last SessionDone flips it as the ranks finish; rank 0's report
    reads the sentinel afresh and waits for the router's write instead of missing the flip."""
    import threading

    from toolkit.core.rundir import RunDir, atomic_write
    from toolkit.rollout.coordination import TailWatch

    rd = RunDir(tmp_path)
    watch = TailWatch(rd, "j", enabled=True)
    assert watch.flip_of(3, wait_s=0.0) is None  # before the flip
    flip = {"job": "j", "step": 3, "time": 1.0, "count": 8, "n_sessions": 8, "group": "tail"}
    writer = threading.Timer(0.3, lambda: atomic_write(rd.sentinel("j"), json.dumps(flip)))
    writer.start()
    try:
        assert watch.flip_of(3, wait_s=30) == flip
    finally:
        writer.cancel()
    assert watch.flip_of(4, wait_s=0.1) is None  # another step's sentinel is not this step's flip
