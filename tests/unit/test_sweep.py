"""Sweep summaries and exit codes from run dirs written by the test (sweeps that launch:
tests/integration/test_sweep.py)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from rich.console import Console

from toolkit.report.sweep import collect, short_names, summary_table, write_summary


def _fake_run(root: Path, name: str, overrides: list[str], report: dict | None) -> None:
    run = root / name
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    if report is not None:
        (run / "report.json").write_text(json.dumps(report))


def test_summary_keeps_the_swept_values_and_marks_runs_without_a_report(tmp_path: Path) -> None:
    step = {"wall_s": 2.0, "prefix_hit_rate": 0.5, "tokens_per_s": 100.0,
            "flip": {"count": 9, "time_s": 1.5, "spillover": 0.25}}
    _fake_run(tmp_path, "0", ["steps=2", "router.policy=least_loaded"], {"status": "ok", "steps": [step, step]})
    _fake_run(tmp_path, "1", ["steps=2", "router.policy=round_robin"], None)
    _fake_run(tmp_path, "10", ["steps=2", "router.policy=power_of_two"],
              {"status": "ok", "steps": [{**step, "flip": None, "wall_s": 4.0}]})
    rows = collect(tmp_path)
    assert [r["run"] for r in rows] == ["0", "1", "10"]  # job order, not text order
    assert [r["overrides"] for r in rows] == ["router.policy=least_loaded", "router.policy=round_robin",
                                              "router.policy=power_of_two"]
    assert rows[0]["step_time_s"] == 2.0 and rows[0]["flip_count"] == 9 and rows[0]["spillover"] == 0.25
    assert rows[1]["status"] == "no report" and rows[1]["step_time_s"] is None
    assert rows[2]["flip_count"] is None and rows[2]["step_time_s"] == 4.0
    path = write_summary(tmp_path, rows)
    back = list(csv.DictReader(path.open()))
    assert back[1]["status"] == "no report" and back[1]["step_time_s"] == ""
    assert [r["router.policy"] for r in back] == ["least_loaded", "round_robin", "power_of_two"]  # full names
    # An 80-column terminal: each swept value whole in its own column, headed by the key's last part;
    # a count as an integer.
    console = Console(width=80, record=True)
    console.print(summary_table(rows, "sweep summary"))
    text = console.export_text()
    assert "…" not in text and "policy" in text
    assert all(v in text for v in ("least_loaded", "round_robin", "power_of_two"))
    assert " 9 " in text and "9.0" not in text


def test_a_sweep_whose_points_ran_elsewhere_exits_with_their_reports_worst(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """hydra-submitit-launcher runs each point in a job of its own, where a failed point returns normally
    (the others run on): the sweep's exit code comes from the reports the summary reads."""
    from omegaconf import OmegaConf

    from toolkit.report import sweep

    monkeypatch.setattr(sweep, "SWEEP_EXIT", [0])
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}})
    _fake_run(tmp_path, "0", ["seed=1"], {"status": "ok", "steps": []})
    sweep.SweepSummary().on_multirun_end(config)
    assert sweep.SWEEP_EXIT == [0]
    _fake_run(tmp_path, "1", ["seed=2"], {"status": "failed", "steps": []})
    sweep.SweepSummary().on_multirun_end(config)
    assert sweep.SWEEP_EXIT == [1]


def test_swept_keys_get_the_shortest_headers_that_tell_them_apart() -> None:
    keys = ["tail.threshold", "groups.tail.replicas", "groups.throughput.replicas", "seed"]
    assert short_names(keys) == {"tail.threshold": "threshold", "groups.tail.replicas": "tail.replicas",
                                 "groups.throughput.replicas": "throughput.replicas", "seed": "seed"}


def test_a_sweep_in_a_reused_directory_ranks_its_own_jobs_not_those_left_there(tmp_path: Path) -> None:
    """Hydra does not clear a sweep directory: the callback takes the jobs that ended in its sweep."""
    from hydra.core.utils import JobReturn
    from omegaconf import OmegaConf

    from toolkit.report.sweep import SweepJobs

    step = {"wall_s": 1.0}
    for name, policy in (("0", "least_loaded"), ("1", "round_robin"), ("2", "power_of_two")):  # an earlier sweep
        _fake_run(tmp_path, name, [f"router.policy={policy}"], {"status": "ok", "steps": [step]})
    jobs = SweepJobs()
    for name in ("0", "1"):  # this sweep's two jobs, which wrote over the first two
        jobs.on_job_end(OmegaConf.create({}), JobReturn(hydra_cfg=OmegaConf.create(
            {"hydra": {"runtime": {"output_dir": str(tmp_path / name)}}})))
    assert [r["run"] for r in jobs.rows(tmp_path)] == ["0", "1"]
    assert [r["run"] for r in SweepJobs().rows(tmp_path)] == ["0", "1", "2"]  # no job seen: every run there


def test_a_plan_sweep_ranks_the_points_that_would_stop_last_and_draws_a_choice_by_its_values(tmp_path: Path) -> None:
    from toolkit.plan.sweep import plan_rows, plan_table, plot, verdict

    def point(name: str, policy: str, step_s: float, stopped: str = "") -> None:
        summary = {"step_time_s": step_s, "failed_share": 0.5 if stopped else 0.0, "stopped": stopped}
        _fake_run(tmp_path, name, ["steps=2", f"router.policy={policy}"],
                  {"status": "stopped" if stopped else "ok", "steps": [], "summary": summary})

    point("0", "least_loaded", 2.0)
    point("1", "round_robin", 1.0, stopped="step 0: 16 of 32 sessions failed")
    point("2", "power_of_two", 3.0)
    rows = plan_rows(tmp_path, collect(tmp_path))
    assert [r["swept"]["router.policy"] for r in rows] == ["least_loaded", "power_of_two", "round_robin"]
    line = verdict(rows)
    assert line.startswith("best: router.policy=least_loaded at 2.00s") and "1 would stop" in line
    console = Console(width=80, record=True)
    console.print(plan_table(rows))
    text = console.export_text()
    assert " 3x " in text and "50%" in text
    path = plot(tmp_path, rows)
    assert path is not None and path.stat().st_size > 0  # values that are not numbers: one place each
