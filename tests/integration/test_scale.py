"""Elastic groups: ``python -m toolkit.launch.scale`` on a running run (real launch, router, sim replicas)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.outputs import check_outputs
from tests.helpers.procs import assert_no_process_left, finish, start_launch, wait_for
from toolkit.config import compose_config, save_run_config
from toolkit.core.errors import ConfigError, ToolkitError
from toolkit.core.rundir import RunDir
from toolkit.launch.scale import _parse, request


def _scale(run: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "toolkit.launch.scale", str(run), *args], capture_output=True, text=True,
                          timeout=150)


def test_scale_requests_are_checked_before_they_reach_the_run(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        _parse(["throughput=4", "tail", "x=-1"])
    assert [e.field for e in err.value.errors] == ["tail", "x=-1"]
    rd = RunDir(tmp_path)
    rd.make()
    save_run_config(compose_config([]), rd.config)
    with pytest.raises(ConfigError) as err:
        request(tmp_path, {"throughput": 2, "bogus": 1, "tail": -1})
    assert {e.field for e in err.value.errors} == {"bogus", "tail"}
    assert "one of the run's groups ['tail', 'throughput']" in str(err.value)
    with pytest.raises(ToolkitError, match="no launch is running"):
        request(tmp_path, {"throughput": 2})
    assert not rd.scale_request.exists()


def _steps_done(run: Path) -> int:
    return len(list((run / "steps").glob("step_*.json")))


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_scaling_a_group_up_and_down_mid_run_loses_and_duplicates_no_session(tmp_path: Path) -> None:
    # More steps than the test needs, however slow this machine: it stops the run (SIGUSR1: the step
    # in flight finishes) once two steps have ended after the last scaling.
    run = tmp_path / "run"
    proc = start_launch([f"hydra.run.dir={run}", "engine.time_scale=0.5", "steps=500", "sessions_per_step=32",
                         "cluster.signal_grace_s=120"])
    try:
        wait_for(lambda: (run / "steps" / "step_00000.json").exists(), 120, "the first step")
        up = _scale(run, "throughput=4", "--wait", "120")
        assert up.returncode == 0, up.stdout + up.stderr
        assert "throughput: target 4, started 4, ready 4, draining 0" in up.stdout
        # Down mid-step: the three highest replicas drain, what they hold migrates to throughput-0.
        down = _scale(run, "throughput=1", "--wait", "120")
        assert down.returncode == 0, down.stdout + down.stderr
        assert "throughput: target 1, started 1, ready 1, draining 0" in down.stdout
        # No tail group from here: what was on its way there runs on the throughput group.
        finished = _scale(run, "tail=0", "throughput=2", "--finish", "--wait", "120")
        assert finished.returncode == 0, finished.stdout + finished.stderr
        after = _steps_done(run)
        wait_for(lambda: _steps_done(run) >= after + 2, 120, "two more steps without a tail group")
        proc.send_signal(signal.SIGUSR1)
    finally:
        output = finish(proc, 240)
    assert proc.returncode == 75, output  # stopped by the signal, resumable
    done = _steps_done(run)
    steps = check_outputs(run, steps=done, sessions=32, status="interrupted")  # every session exactly once
    report = json.loads((run / "report.json").read_text())
    s = report["summary"]
    assert (s["replicas_added"], s["replicas_removed"], s["replica_restarts"]) == (3, 4, 0), s
    kinds = [e["kind"] for e in report["interruptions"]]
    assert kinds.count("replica_added") == 3 and kinds.count("replica_removed") == 4
    assert sum(len(st["interruptions"]) for st in steps) >= 1
    assert report["router"].get("duplicates", 0) == 0  # no client had to resend: no answer was lost
    assert all(st["requests_by_status"].keys() == {"ok"} for st in steps), [st["requests_by_status"] for st in steps]
    assert_no_process_left(run)
