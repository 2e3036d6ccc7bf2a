"""Steps that close on a count (``rollout.close=count``) with the real router, sim replicas and MPI
ranks: carried sessions land once, in a later step, with their versions per turn; ``max_staleness``
drops or restarts a constructed slow session; zero-variance groups are filtered and replaced; a run
resumed mid-step writes no session twice. The closing logic on its own: tests/unit/test_close_count.py."""

from __future__ import annotations

import collections
import json
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from tests.helpers.procs import finish, launch, start_launch, wait_for
from toolkit.bench.partial import all_equal
from toolkit.core.lifecycle import read_pidfiles

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

ENV = ["workload.env._target_=tests.helpers.partial_env.SlowSessions"]
FAST = ["engine.time_scale=0.2", "router.heartbeat_s=0.2", "groups=single", "rollout.close=count", *ENV]


def steps_of(run: Path) -> tuple[list[list[dict[str, Any]]], list[dict[str, Any]]]:
    n = len(list((run / "steps").glob("step_*.json")))
    rows = [pq.read_table(run / "steps" / f"step_{s:05d}.parquet").to_pylist() for s in range(n)]
    reports = [json.loads((run / "steps" / f"step_{s:05d}.json").read_text()) for s in range(n)]
    return rows, reports


def landed_or_running(rows: list[list[dict[str, Any]]], reports: list[dict[str, Any]],
                      session: tuple[int, int]) -> tuple[int, dict[str, Any]] | None:
    """Where session (started step, index) landed, as (step, row); None if it was still running when the
    run ended (the last report carries it on). Which of the two depends on the machine's speed: a held
    session is released by a step's report and needs its remaining turns before the run's last step
    closes. Anything else (lost, or landed twice) fails."""
    found = [(s, r) for s, step in enumerate(rows) for r in step
             if (r["started_step"], r["index"]) == session]
    if found:
        [one] = found
        return one
    assert session in {(g[0], g[1]) for g in reports[-1]["carried_groups"]}, f"{session} lost"
    return None


def assert_each_session_once(rows: list[list[dict[str, Any]]]) -> None:
    ids = collections.Counter(r["session_id"] for step in rows for r in step)
    assert max(ids.values()) == 1, [k for k, v in ids.items() if v > 1]
    for s, step in enumerate(rows):
        for r in step:
            assert r["session_id"] == f"rollout/{r['started_step']}/{r['index']}"
            assert r["carried"] == s - r["started_step"] >= 0
            # Every generated token in its row once: the mask marks exactly the generated ones.
            assert sum(r["loss_mask"]) == r["generated_tokens"] == sum(1 for m in r["loss_mask"] if m)
            assert len(r["tokens"]) == len(r["loss_mask"]) == len(r["rollout_logprobs"])


@pytest.mark.timeout(300)
def test_a_step_closes_on_its_count_and_carried_sessions_land_later_with_their_versions(tmp_path: Path) -> None:
    weights = tmp_path / "weights"
    for v in (1, 2, 3, 4, 5):  # a checkpoint per step: each step begins on new weights
        (weights / f"step_{v:05d}").mkdir(parents=True)
        (weights / f"step_{v:05d}" / "config.json").write_text("{}")
    run = tmp_path / "run"
    out = launch([f"hydra.run.dir={run}", *FAST, "steps=6", "sessions_per_step=8", "rollout.over_sample=0.5",
                  f"rollout.weights_dir={weights}", "rollout.max_staleness=5",
                  "+workload.env.slow=[0/0,0/5]", f"+workload.env.until={run}/steps/step_00001.json"])
    assert out.returncode == 0, out.stdout + out.stderr
    rows, reports = steps_of(run)
    assert len(rows) == 6 and all(len(step) == 8 for step in rows)  # exactly the count, every step
    assert_each_session_once(rows)
    # Held until step 1 was written: both were running when step 0 closed.
    assert {(0, 0), (0, 5)} <= {(g[0], g[1]) for g in reports[0]["carried_groups"]}
    for landed, r in [x for x in (landed_or_running(rows, reports, (0, i)) for i in (0, 5)) if x]:
        assert landed >= 2 and r["carried"] == landed and r["status"] == "completed"
        # Its turns ran on the weights of the steps they ran in: older first, the step's own last.
        turns = r["turn_weight_versions"]
        assert len(turns) == 3 and turns[0][0] == 0 and turns[-1][-1] >= 1
        # Behind the newest weights the engines held when it landed: at least its own newest turn's.
        versions = r["weight_versions"]
        assert max(versions) - min(versions) <= r["staleness"] <= landed - min(versions)
    for s, report in enumerate(reports):
        assert report["close"] == "count" and report["sessions"] == 8 and not report["closed_short"]
        assert report["carried_in"] == sum(r["carried"] > 0 for r in rows[s])
        assert sum(report["staleness"].values()) == 8 and max(int(k) for k in report["staleness"]) <= 5
        assert len(report["carried_groups"]) == report["carried_out"]
    assert reports[0]["carried_in"] == 0 and sum(r["carried_in"] for r in reports) >= 2


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stale", ["drop", "restart"])
def test_max_staleness_drops_or_restarts_a_slow_carried_session(tmp_path: Path, stale: str) -> None:
    run = tmp_path / "run"
    # Turns of at most 64 tokens: no session is much longer than another, so a restarted one lands
    # (with a long tail and a small k, a long session can be restarted again and again).
    out = launch([f"hydra.run.dir={run}", *FAST, "steps=10", "sessions_per_step=16", "rollout.over_sample=0.25",
                  "workload.max_tokens=64",
                  "rollout.max_staleness=2", f"rollout.stale={stale}",
                  "+workload.env.slow=[0/1]", f"+workload.env.until={run}/steps/step_00003.json"])
    assert out.returncode == 0, out.stdout + out.stderr
    rows, reports = steps_of(run)
    assert_each_session_once(rows)
    counted = [[r for r in step if r["status"] == "completed"] for step in rows]
    assert all(len(c) == 16 for c in counted)
    assert all(r["staleness"] <= 2 for c in counted for r in c)
    # The report's histogram is over the landed sessions: the dropped ones are past k by definition.
    assert all(sum(rep["staleness"].values()) == 16 and max(int(k) for k in rep["staleness"]) <= 2 for rep in reports)
    assert (0, 1) in {(g[0], g[1]) for g in reports[2]["carried_groups"]}  # held until step 3 was written
    if stale == "drop":
        # Stopped at the boundary of step 3 whatever the machine's speed: it is there as step 3 begins.
        [(s, row)] = [(s, r) for s, step in enumerate(rows) for r in step if r["session_id"] == "rollout/0/1"]
        # Stopped as step 3 began (it could no longer land within k), its tokens so far discarded.
        assert row["status"] == "stale" and "max_staleness" in row["error"] and row["carried"] == s == 3
        stale_rows = [r for r in rows[s] if r["status"] == "stale"]
        assert reports[s]["dropped_stale"] == len(stale_rows)
        assert reports[s]["tokens_discarded"] >= sum(r["generated_tokens"] for r in stale_rows)
    else:
        # Restarted at step 3 from its first turn (its request ids of its own); once landed, whole and
        # within the bound (a restart that ran too long again is restarted again, never landed stale).
        assert reports[3]["restarted_stale"] >= 1
        assert (0, 1) in {(g[0], g[1]) for g in reports[3]["carried_groups"] if g[2] >= 1} | {
            (r["started_step"], r["index"]) for r in rows[3]}
        got = landed_or_running(rows, reports, (0, 1))
        if got is not None:
            assert got[1]["status"] == "completed" and got[1]["staleness"] <= 2 and got[1]["carried"] >= 4


@pytest.mark.timeout(300)
def test_zero_variance_groups_are_filtered_and_replaced(tmp_path: Path) -> None:
    run = tmp_path / "run"
    out = launch([f"hydra.run.dir={run}", *FAST, "steps=3", "sessions_per_step=8",
                  "+workload.prompts.samples_per_prompt=2", "+workload.env.samples_per_prompt=2",
                  "+workload.env.equal_every=3", "rollout.filter_groups=zero_variance"])
    assert out.returncode == 0, out.stdout + out.stderr
    rows, reports = steps_of(run)
    assert_each_session_once(rows)
    for step, report in zip(rows, reports, strict=True):
        useful = [r for r in step if r["status"] == "completed"]
        filtered = [r for r in step if r["status"] == "filtered"]
        assert len(useful) == 8  # four useful groups of two
        assert all(all_equal(r["started_step"], r["index"] // 2, 3) for r in filtered)
        assert len(filtered) == 2 * report["filtered_groups"]
        assert not any(all_equal(r["started_step"], r["index"] // 2, 3) for r in useful)  # their rewards differ
        assert not report["closed_short"]
    starts = sum(r["group_starts"] for r in reports)
    assert starts >= sum(r["filtered_groups"] for r in reports) + 12


@pytest.mark.timeout(400)
def test_a_run_resumed_mid_step_restarts_what_was_carried_and_writes_no_session_twice(tmp_path: Path) -> None:
    run = tmp_path / "run"
    args = [f"hydra.run.dir={run}", *FAST, "steps=4", "sessions_per_step=8", "rollout.over_sample=0.5",
            "+workload.env.slow=[0/0,1/2]", f"+workload.env.until={run}/steps/step_00002.json"]
    proc = start_launch(args)
    try:
        wait_for(lambda: (run / "steps" / "step_00001.json").exists(), 120, "step 1 to end")
        time.sleep(0.3)
        proc.kill()
        proc.wait(timeout=30)
    finally:
        finish(proc, 30)
    wait_for(lambda: not [r for r in read_pidfiles(run / "pids") if r.alive()], 60, "the killed run's processes to end")
    before = json.loads((run / "steps" / "step_00001.json").read_text())["carried_groups"]
    assert before  # something was running when the step closed

    out = launch([*args, "resume=true"])
    assert out.returncode == 0, out.stdout + out.stderr
    rows, reports = steps_of(run)
    assert len(rows) == 4 and all(len(step) == 8 for step in rows)
    assert_each_session_once(rows)
    landed = {(r["started_step"], r["index"]) for step in rows[2:] for r in step}
    still = {(s, g) for s, g, _ in reports[3]["carried_groups"]}  # running when the run ended
    # What step 1 carried on (started before it, running at the kill) ran again: it landed, or ran on.
    assert {(s, g) for s, g, _ in before} <= landed | still


@pytest.mark.timeout(300)
def test_agent_sessions_over_http_carry_like_token_level_ones(tmp_path: Path) -> None:
    pytest.importorskip("openai")
    run = tmp_path / "run"
    out = launch([f"hydra.run.dir={run}", "workload=agent", "engine.time_scale=0.2", "groups=single",
                  "rollout.close=count", "rollout.over_sample=0.5", "steps=5", "sessions_per_step=6",
                  "workload.agent._target_=tests.helpers.agents_for_tests.carried",
                  "+workload.agent.slow=[0/1]", f"+workload.agent.until={run}/steps/step_00000.json"])
    assert out.returncode == 0, out.stdout + out.stderr
    rows, reports = steps_of(run)
    assert_each_session_once(rows)
    assert all(len(step) == 6 and all(r["status"] == "completed" for r in step) for step in rows)
    assert (0, 1) in {(g[0], g[1]) for g in reports[0]["carried_groups"]}  # held until step 0 was written
    got = landed_or_running(rows, reports, (0, 1))
    if got is not None:
        assert got[0] >= 1 and got[1]["carried"] == got[0] and got[1]["num_turns"] == 2


@pytest.mark.timeout(300)
def test_the_count_flip_counts_the_sessions_that_close_a_step(tmp_path: Path) -> None:
    run = tmp_path / "run"
    out = launch([f"hydra.run.dir={run}", "engine.time_scale=0.2", "router.heartbeat_s=0.2", "rollout.close=count",
                  "rollout.over_sample=0.5", "steps=3", "sessions_per_step=8", "tail.policy=count",
                  "tail.threshold=0.75", *ENV])
    assert out.returncode == 0, out.stdout + out.stderr
    rows, reports = steps_of(run)
    assert_each_session_once(rows)
    for report in reports:
        # Flipped at exactly ceil(0.75 * 8) sessions done in the step, carried ones among them.
        assert report["flip"]["count"] == report["flip"]["expected_count"] == 6
        assert report["flip"]["spillover"] == 0  # after it, the step's requests all ran on the tail group
