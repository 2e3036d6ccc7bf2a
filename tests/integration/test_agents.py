"""``workload=agent`` end to end: launch, real MPI ranks serving gateways, sim replicas, real harnesses
(the ``openai`` SDK in the rank's loop, and a separate program per session)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.helpers.procs import assert_no_process_left, launch
from toolkit.router.tail import flip_count

pytestmark = [pytest.mark.mpi, pytest.mark.slow]
pytest.importorskip("openai")

REPO = Path(__file__).resolve().parents[2]
FAST = ["workload=agent", "engine.time_scale=0.2", "steps=1"]


def test_failing_agents_fail_only_their_samples_and_http_sessions_flip_at_the_exact_count(tmp_path: Path) -> None:
    run = tmp_path / "run"
    out = launch([f"hydra.run.dir={run}", *FAST, "workload.agent._target_=tests.helpers.agents_for_tests.flaky",
                  "sessions_per_step=12", "workload.env_timeout_s=6", "tail.threshold=0.75",
                  "rollout.max_failed_fraction=0.5", "workload.record_messages=true"], cwd=REPO)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = {r["index"]: r for r in pq.read_table(run / "steps" / "step_00000.parquet").to_pylist()}
    assert sorted(rows) == list(range(12))
    assert rows[3]["status"] == "failed" and "agent raised RuntimeError: agent crashed on session 3" in rows[3]["error"]
    assert rows[5]["status"] == "failed" and "timed out after workload.env_timeout_s = 6.0s" in rows[5]["error"]
    assert rows[6]["status"] == "failed" and "the gateway answered 400" in rows[6]["error"]
    for i, r in rows.items():
        if i in (3, 5, 6):
            continue
        assert r["status"] == "completed" and r["num_turns"] == 3 and r["reward"] == 1.0, (i, r["error"])
        assert sum(r["loss_mask"]) == r["generated_tokens"] > 0 and r["branch"] == 0
        roles = [m["role"] for m in json.loads(r["messages"])]
        assert roles == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
    report = json.loads((run / "steps" / "step_00000.json").read_text())
    assert report["flip"]["count"] == report["flip"]["expected_count"] == flip_count(0.75, 12)
    assert report["sessions_by_status"] == {"completed": 9, "failed": 3}
    assert sorted(p.name for p in (run / "gateways").iterdir()) == ["rank-00000.json", "rank-00001.json"]
    assert_no_process_left(run)


def test_a_harness_program_per_session_and_the_failure_budget(tmp_path: Path) -> None:
    run = tmp_path / "run"
    out = launch([f"hydra.run.dir={run}", *FAST, "sessions_per_step=4",
                  "workload.agent._target_=toolkit.rollout.agents.run_command",
                  f"+workload.agent.command=[{sys.executable},tests/helpers/harness_cli.py]",
                  "rollout.max_failed_fraction=0.2"], cwd=REPO)
    # Session 1's harness exits 3: one failed sample in four is over a budget of 20%.
    assert out.returncode == 1, out.stdout + out.stderr
    text = out.stdout + out.stderr
    assert "step 0: 1 of 4 sessions failed (25.0%), more than rollout.max_failed_fraction = 0.2" in text
    assert "harness " in text and "exited with 3: harness: cannot start the sandbox" in text
    rows = {r["index"]: r for r in pq.read_table(run / "steps" / "step_00000.parquet").to_pylist()}
    assert rows[1]["status"] == "failed"
    assert all(rows[i]["status"] == "completed" and rows[i]["reward"] == 0.25 and rows[i]["num_turns"] == 2
               for i in (0, 2, 3))
    assert_no_process_left(run)


@pytest.mark.parametrize("example", ["openai_agent", "anthropic_agent"])
def test_the_examples_run_as_readme_shows(tmp_path: Path, example: str) -> None:
    pytest.importorskip("anthropic")
    run = tmp_path / "run"
    out = launch([f"hydra.run.dir={run}", *FAST, "sessions_per_step=6",
                  f"workload.agent._target_=examples.{example}.solve"], cwd=REPO)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = pq.read_table(run / "steps" / "step_00000.parquet").to_pylist()
    assert len(rows) == 6 and all(r["status"] == "completed" and r["num_turns"] >= 2 for r in rows), \
        [(r["status"], r["error"]) for r in rows]
    assert_no_process_left(run)


def test_with_curve_only_the_runs_agents_get_in(tmp_path: Path) -> None:
    """Where the router uses CURVE, the gateways admit only the run's token, which the ranks hand to
    their agents through OPENAI_API_KEY: the run's own agents complete, the token file is private. The
    agent is async behind a plain decorator, which the rank takes for sync: it still completes."""
    import stat

    run = tmp_path / "run"
    out = launch([f"hydra.run.dir={run}", *FAST, "sessions_per_step=4", "router.curve=true",
                  "workload.agent._target_=tests.helpers.agents_for_tests.decorated_openai_tools",
                  "+workload.agent.check_outsider=true"],
                 cwd=REPO)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = pq.read_table(run / "steps" / "step_00000.parquet").to_pylist()
    assert all(r["status"] == "completed" and r["num_turns"] == 3 for r in rows), [r["error"] for r in rows]
    assert stat.S_IMODE((run / "keys" / "gateway.token").stat().st_mode) == 0o600
    assert_no_process_left(run)
