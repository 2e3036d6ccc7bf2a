"""Trackers in real launches: a resume of a finished run logs the step no tracker got; W&B (offline)
and TensorBoard hold every step report. The trackers on in-process objects: tests/unit/test_trackers.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.procs import launch
from toolkit.core.rundir import RunDir
from toolkit.report.trackers import flatten


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_resuming_a_finished_run_logs_the_steps_no_tracker_got(tmp_path: Path) -> None:
    """The launch ended after the last step's report, before it logged it: a resume with every step done
    still gives the trackers that step."""
    pytest.importorskip("tensorboardX")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    args = [f"hydra.run.dir={run}", "engine.time_scale=0.05", "steps=2", "sessions_per_step=4",
            "report.trackers=[tensorboard]"]
    out = launch(args)
    assert out.returncode == 0, out.stdout + out.stderr
    RunDir(run).trackers_logged.write_text(json.dumps({"tensorboard": 0}))  # step 1 was never logged
    for f in (run / "trackers" / "tensorboard").iterdir():
        f.unlink()
    out = launch([*args, "resume=true"])
    assert out.returncode == 0 and "already done" in out.stdout, out.stdout + out.stderr
    events = EventAccumulator(str(run / "trackers" / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("wall_s")] == [1]
    assert json.loads(RunDir(run).trackers_logged.read_text()) == {"tensorboard": 1}


@pytest.mark.mpi
@pytest.mark.slow
def test_wandb_offline_and_tensorboard_hold_every_step_report(tmp_path: Path) -> None:
    pytest.importorskip("wandb")
    pytest.importorskip("tensorboardX")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    out = launch([f"hydra.run.dir={run}", "engine.time_scale=0.2", "steps=3", "sessions_per_step=16",
                  "report.trackers=[wandb,tensorboard]", "report.wandb_mode=offline", "seed=5"])
    assert out.returncode == 0, out.stdout + out.stderr
    steps = json.loads((run / "report.json").read_text())["steps"]
    assert [s["step"] for s in steps] == [0, 1, 2]
    # TensorBoard: one scalar per figure per step, equal to the step report's.
    events = EventAccumulator(str(run / "trackers" / "tensorboard"))
    events.Reload()
    for key in ("wall_s", "bound_s", "generated_tokens", "bound.critical_path_s", "tail.moves"):
        got = [(e.step, e.value) for e in events.Scalars(key)]
        want = [(s["step"], pytest.approx(flatten(s)[key], rel=1e-6)) for s in steps]
        assert got == want, key
    assert "config/text_summary" in events.Tags()["tensors"]
    # W&B offline (no network): the run's record file holds each step's figures and the config.
    (record,) = (run / "trackers" / "wandb").glob("offline-run-*/run-*.wandb")
    data = record.read_bytes()
    for s in steps:
        assert json.dumps(s["wall_s"]).encode() in data and json.dumps(s["generated_tokens"]).encode() in data
    assert b"bound.critical_path_s" in data and b"sessions_per_step" in data
