"""``python -m toolkit.plan`` as a user runs it (README's commands): one config, a sweep with its table,
CSV and plot, a replay of a finished run, and a config it cannot run refused at once."""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
from pathlib import Path

from tests.helpers.procs import launch

SMALL = ["sessions_per_step=16", "steps=2", "workload.max_tokens=256"]


def plan(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "toolkit.plan", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def test_one_config_writes_its_predictions(tmp_path: Path) -> None:
    proc = plan([f"hydra.run.dir={tmp_path / 'one'}", *SMALL], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((tmp_path / "one" / "report.json").read_text())
    assert len(report["steps"]) == 2 and report["summary"]["step_time_s"] > 0
    assert "step time (mean)" in proc.stdout


def test_a_sweep_ranks_its_points_and_names_the_setting_that_mattered(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    proc = plan(["-m", "--plot", f"hydra.sweep.dir={sweep}", *SMALL, "groups.tail.replicas=1,2",
                 "groups.throughput.replicas=1,2"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = list(csv.DictReader((sweep / "plan_summary.csv").open()))
    assert len(rows) == 4 and [int(r["rank"]) for r in rows] == [1, 2, 3, 4]
    times = [float(r["step_time_s"]) for r in rows]
    assert times == sorted(times)
    assert "made the most difference" in proc.stdout and (sweep / "plan_sweep.png").stat().st_size > 0


def test_a_finished_run_replays_under_other_settings(tmp_path: Path) -> None:
    run = tmp_path / "run"
    done = launch([f"hydra.run.dir={run}", "engine.time_scale=0.05", "router.heartbeat_s=0.2", *SMALL])
    assert done.returncode == 0, done.stderr[-2000:]
    proc = plan([f"replay={run}", f"hydra.run.dir={tmp_path / 'replayed'}", "tail.policy=count"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    replayed = json.loads((tmp_path / "replayed" / "report.json").read_text())["steps"]
    real = json.loads((run / "report.json").read_text())["steps"]
    assert [s["generated_tokens"] for s in replayed] == [s["generated_tokens"] for s in real]
    assert f"replayed: 32 sessions as {run} recorded them\n" in proc.stdout


def test_a_run_of_groups_closed_on_a_count_in_shards_replays_its_sessions_and_draws_the_rest(tmp_path: Path) -> None:
    """A run whose steps close on a count (sessions carried to the next step, over-sampled ones never
    finished), of GRPO groups filtered on their rewards, written in shards: each session it recorded is
    replayed under its (started step, index) with its tokens, turns and reward, the others come from the
    run's own workload, and none fails."""
    run = tmp_path / "run"
    counted = ["rollout.close=count", "rollout.over_sample=0.5", "+workload.prompts.samples_per_prompt=4",
               "rollout.filter_groups=zero_variance", "rollout.output=shards"]
    done = launch([f"hydra.run.dir={run}", "engine.time_scale=0.05", "router.heartbeat_s=0.2", *SMALL, *counted])
    assert done.returncode == 0, done.stderr[-2000:]
    proc = plan([f"replay={run}", f"hydra.run.dir={tmp_path / 'replayed'}", "groups.tail.replicas=2"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((tmp_path / "replayed" / "report.json").read_text())
    assert len(report["steps"]) == 2 and report["summary"]["failed_share"] == 0
    assert all(set(s["sessions_by_status"]) <= {"completed", "truncated", "filtered"} for s in report["steps"])
    from toolkit.plan.replay import Recorded

    recorded = Recorded(run)
    assert len(recorded.sessions) >= 32 and report["steps"][1]["carried_in"] > 0
    same = re.search(rf"replayed: (\d+) sessions as {re.escape(str(run))} recorded them", proc.stdout)
    assert same is not None and int(same.group(1)) >= 32, proc.stdout


def test_the_plans_own_options_are_checked_before_anything_runs(tmp_path: Path) -> None:
    for args, says in ((["replay="], "replay=RUN_DIR"), (["--plot", *SMALL], "with -m"),
                       ([f"replay={tmp_path / 'nothing'}"], "no overrides.yaml")):
        proc = plan(args, tmp_path)
        assert proc.returncode == 2 and says in proc.stdout, (args, proc.stdout)
    assert "replay=RUN_DIR" in plan(["--help"], tmp_path).stdout


def test_a_config_the_twin_cannot_run_fails_at_once_naming_it(tmp_path: Path) -> None:
    proc = plan([f"hydra.run.dir={tmp_path / 'bad'}", "rollout.weights_dir=/tmp/w", *SMALL], tmp_path)
    assert proc.returncode == 2
    assert "rollout.weights_dir" in proc.stdout and not (tmp_path / "bad" / "report.json").exists()
