"""Multirun sweeps: the summary table (CSV + console) that the Hydra callback writes at the end."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from tests.helpers.procs import launch
from toolkit.report.sweep import SUMMARY_FILE


@pytest.mark.mpi
@pytest.mark.slow
def test_a_local_sweep_runs_one_after_another_and_writes_the_summary(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    out = launch(["-m", f"hydra.sweep.dir={sweep}", "engine.time_scale=0.2", "steps=1", "sessions_per_step=20",
                  "tail.threshold=0.8,0.9,0.95"], timeout_s=240)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "sweep summary (3 runs)" in out.stdout and "tail.threshold=0.95" in out.stdout
    rows = list(csv.DictReader((sweep / SUMMARY_FILE).open()))
    assert [r["run"] for r in rows] == ["0", "1", "2"]
    assert [r["overrides"] for r in rows] == ["tail.threshold=0.8", "tail.threshold=0.9", "tail.threshold=0.95"]
    assert [float(r["flip_count"]) for r in rows] == [16.0, 18.0, 19.0]  # ceil(threshold * 20)
    for r in rows:
        assert r["status"] == "ok" and r["steps"] == "1"
        assert float(r["step_time_s"]) > 0 and float(r["tokens_per_s"]) > 0
        assert 0 <= float(r["spillover"]) <= 1 and 0 <= float(r["prefix_hit_rate"]) <= 1


@pytest.mark.mpi
@pytest.mark.slow
def test_a_sweep_resumed_with_more_steps_continues_each_run(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    args = ["-m", f"hydra.sweep.dir={sweep}", "engine.time_scale=0.05", "sessions_per_step=8", "seed=0,1"]
    out = launch([*args, "steps=1"])
    assert out.returncode == 0, out.stdout + out.stderr
    (sweep / "1" / "steps" / "step_00000.json").unlink()  # run 1 "was interrupted" in its only step
    out = launch([*args, "steps=2", "resume=true"])
    assert out.returncode == 0, out.stdout + out.stderr
    assert "resuming" in out.stdout and "at step 2 of 2" in out.stdout and "at step 1 of 2" in out.stdout
    for run in ("0", "1"):
        assert sorted(p.name for p in (sweep / run / "steps").glob("*.json")) == ["step_00000.json", "step_00001.json"]
        assert json.loads((sweep / run / "report.json").read_text())["status"] == "ok"


@pytest.mark.mpi
@pytest.mark.slow
def test_a_failed_point_fails_alone_and_the_sweep_exits_with_its_code(tmp_path: Path) -> None:
    """Point 0's failure budget ends its run; point 1 still runs, the summary lists both, and the
    sweep's exit code says one failed (Hydra stops a sweep at a SystemExit, with no summary)."""
    sweep = tmp_path / "sweep"
    out = launch(["-m", f"hydra.sweep.dir={sweep}", "engine.time_scale=0.05", "steps=1", "sessions_per_step=8",
                  "workload.env._target_=tests.helpers.crashing_env.CrashOnSession", "+workload.env.crash_index=3",
                  "~workload.env.max_turns", "~workload.env.observation_tokens", "~workload.env.vocab_size",
                  "rollout.max_failed_fraction=0,0.5"], cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 1, out.stdout + out.stderr
    assert "run failed:" in out.stdout and "sweep summary (2 runs)" in out.stdout
    rows = list(csv.DictReader((sweep / SUMMARY_FILE).open()))
    assert [(r["run"], r["status"]) for r in rows] == [("0", "failed"), ("1", "ok")]
