"""Live progress in a real launch: plain progress lines in a log, between its step lines. The line
itself: tests/unit/test_progress.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.procs import launch


@pytest.mark.mpi
@pytest.mark.slow
def test_launch_in_a_log_prints_progress_lines_between_its_step_lines(tmp_path: Path) -> None:
    run = tmp_path / "run"
    out = launch([f"hydra.run.dir={run}", "engine.time_scale=0.5", "report.log_interval_s=0.2"])
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    progress = [i for i, line in enumerate(lines) if line.startswith("progress: step 1/2 · ")]
    first_step_line = next(i for i, line in enumerate(lines) if line.startswith("step 1/2 · "))
    assert progress and max(progress) < first_step_line  # while step 1 ran, before its step line
    assert all("/32 sessions" in lines[i] and "tok/s" in lines[i] for i in progress)
