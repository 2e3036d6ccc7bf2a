"""Experiment trackers (``report.trackers``): every step report in a W&B offline run and a TensorBoard
event file, the run's config with them; a missing library is a setup error naming the package."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from toolkit.core.errors import ConfigError
from toolkit.core.rundir import RunDir
from toolkit.launch.composition import check_overrides
from toolkit.report.trackers import Tracker, Trackers, flatten


def test_a_step_report_flattens_to_its_numbers() -> None:
    rep = {"step": 3, "wall_s": 2.5, "sessions": 32, "bound": {"critical_path_s": 1.5, "limited_by": "critical_path"},
           "groups": {"tail": {"requests": 7, "prefix_hit_rate": None}}, "flip": None, "ok": True,
           "latency_s": {"p50": float("nan")}, "list": [1, 2]}
    assert flatten(rep) == {"step": 3.0, "wall_s": 2.5, "sessions": 32.0, "bound.critical_path_s": 1.5,
                            "groups.tail.requests": 7.0, "ok": 1.0}


def test_unknown_trackers_and_missing_libraries_fail_at_setup(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("toolkit.report.trackers.PACKAGES", {"wandb": ("no_such_module_here", "wandb")})
    with pytest.raises(ConfigError) as info:
        check_overrides(["report.trackers=[wandb,mlflow,wandb]", "report.wandb_mode=maybe"])  # a bad choice, with the rest
    text = str(info.value)
    assert "report.trackers[0] = 'wandb': its library is not installed: pip install wandb" in text
    assert "report.trackers[1] = 'mlflow': one of ['wandb']" in text
    assert "report.trackers" in text and "each tracker once" in text and "report.wandb_mode = 'maybe'" in text


class Flaky(Tracker):
    def __init__(self) -> None:
        self.logged: list[int] = []
        self.closed = False

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if step == 1:
            raise OSError("disk full")
        self.logged.append(step)

    def close(self) -> None:
        self.closed = True


def test_a_tracker_that_fails_is_dropped_and_the_others_go_on(tmp_path: Path) -> None:
    trackers = Trackers([], RunDir(tmp_path), {}, {})
    flaky, steady = Flaky(), Flaky()
    steady.log = lambda step, metrics: steady.logged.append(step)  # type: ignore[method-assign]
    trackers.trackers = {"flaky": flaky, "steady": steady}
    for step in range(3):
        trackers.log({"step": step, "wall_s": 1.0})
    assert flaky.logged == [0] and steady.logged == [0, 1, 2] and list(trackers.trackers) == ["steady"]
    trackers.close()
    assert steady.closed and not flaky.closed


def test_a_resumed_run_logs_the_steps_its_previous_launch_missed_and_no_other(tmp_path: Path) -> None:
    """The previous launch logged steps 0-1 and ended after step 2's report, before it looked at it:
    the resumed launch's trackers get step 2 (once), then its own steps."""
    reports = [{"step": s, "wall_s": float(s)} for s in range(3)]
    first = Flaky()
    first.log = lambda step, metrics: first.logged.append(step)  # type: ignore[method-assign]
    trackers = Trackers([], RunDir(tmp_path), {}, {})
    trackers.trackers = {"tb": first}
    for rep in reports[:2]:
        trackers.log(rep)
    again = Flaky()
    again.log = lambda step, metrics: again.logged.append(step)  # type: ignore[method-assign]
    resumed = Trackers([], RunDir(tmp_path), {}, {})
    resumed.trackers = {"tb": again}
    resumed.catch_up(reports)
    resumed.log({"step": 3, "wall_s": 3.0})
    assert first.logged == [0, 1] and again.logged == [2, 3]
    assert json.loads(RunDir(tmp_path).trackers_logged.read_text()) == {"tb": 3}


def test_a_launch_stopped_inside_one_trackers_log_has_the_others_log_it_once(tmp_path: Path) -> None:
    """The stop signal lands inside the second tracker's ``log``: the first one, which logged the step,
    is recorded, so the resumed launch logs the step to the second only."""
    first, second = Flaky(), Flaky()
    first.log = lambda step, metrics: first.logged.append(step)  # type: ignore[method-assign]

    def stopped(step: int, metrics: dict[str, float]) -> None:
        raise KeyboardInterrupt  # launch turns its stop signals into this

    second.log = stopped  # type: ignore[method-assign]
    trackers = Trackers([], RunDir(tmp_path), {}, {})
    trackers.trackers = {"tb": first, "wandb": second}
    with pytest.raises(KeyboardInterrupt):
        trackers.log({"step": 0, "wall_s": 1.0})
    again_first, again_second = Flaky(), Flaky()
    resumed = Trackers([], RunDir(tmp_path), {}, {})
    resumed.trackers = {"tb": again_first, "wandb": again_second}
    resumed.catch_up([{"step": 0, "wall_s": 1.0}])
    assert first.logged == [0] and again_first.logged == [] and again_second.logged == [0]


def test_a_tracker_that_hangs_in_close_is_left_behind(tmp_path: Path) -> None:
    """wandb.finish can hang on an upload: the launch's exit (and a requeue in Slurm's grace) goes on."""
    import threading

    release = threading.Event()
    hung, other = Flaky(), Flaky()
    hung.close = lambda: release.wait(60)  # type: ignore[method-assign]
    trackers = Trackers([], RunDir(tmp_path), {}, {})
    trackers.trackers = {"hung": hung, "other": other}
    try:
        trackers.close(timeout_s=0.2)
        assert other.closed and trackers.trackers == {}
    finally:
        release.set()


def test_a_tracker_that_cannot_open_is_dropped_and_the_run_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """W&B without a login on a compute node: said once; the run (its fleet already up) is not ended."""
    def make(name: str, *_: object) -> Tracker:
        if name == "wandb":
            raise RuntimeError("No API key configured")
        return Flaky()

    monkeypatch.setattr("toolkit.report.trackers._make", make)
    trackers = Trackers(["wandb", "tensorboard"], RunDir(tmp_path), {}, {})
    assert list(trackers.trackers) == ["tensorboard"]
    assert "tracker wandb could not open" in caplog.text and "No API key configured" in caplog.text
