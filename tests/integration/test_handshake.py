"""The trainer handshake end to end: rollout.max_staleness with the sim engine, real launches and a
small trainer loop in the test. Publishing, latest and wait_step themselves: tests/unit/test_handshake.py."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.helpers.procs import finish, launch, start_launch
from toolkit import samples
from toolkit.core.rundir import RunDir, read_json
from toolkit.weights import publish
from toolkit.weights.checkpoint import IN_PROGRESS

# ---- end to end: a trainer loop in the test, the sim engine -------------------------------------
RUN = ["engine.time_scale=0.2", "sessions_per_step=6", "router.heartbeat_s=0.2"]


def start_loop(tmp_path: Path, steps: int, max_staleness: int):  # type: ignore[no-untyped-def]
    run, weights = tmp_path / "run", tmp_path / "weights"
    proc = start_launch([f"hydra.run.dir={run}", *RUN, f"steps={steps}", f"rollout.weights_dir={weights}",
                         f"rollout.max_staleness={max_staleness}"])
    return run, weights, proc


def trainer(run: Path, weights: Path, steps: int, check, before_publish=None) -> None:  # type: ignore[no-untyped-def]
    """What a trainer does each step: wait for the step's samples, train, publish the next weights."""
    for s in range(steps):
        table = samples.wait_step(run, s, timeout_s=120, poll_s=0.05)
        check(s, table.column("weight_versions").to_pylist())
        if before_publish is not None:
            before_publish(s)
        publish(weights, s + 1, {"w": np.full(4, float(s + 1), dtype=np.float32)})


@pytest.mark.mpi
@pytest.mark.slow
def test_on_policy_each_step_runs_on_the_weights_from_the_step_before(tmp_path: Path) -> None:
    steps = 3
    run, weights, proc = start_loop(tmp_path, steps, max_staleness=0)

    def on_policy(s: int, versions: list[list[int]]) -> None:
        assert versions and all(v == [s] for v in versions), (s, versions)

    def half_written_first(s: int) -> None:
        # A checkpoint still being written and a dir without its marker are never loaded: the next
        # step cannot begin on them (it needs version s + 1 and waits).
        tmp = weights / f".step_{s + 1:05d}.tmp-x"
        tmp.mkdir(parents=True)
        (tmp / "model.safetensors").write_bytes(b"half")
        time.sleep(1.0)
        assert not (run / "steps" / f"step_{s + 1:05d}.json").exists()

    try:
        trainer(run, weights, steps, on_policy, half_written_first)
    finally:
        output = finish(proc, 120)
    assert proc.returncode == 0, output
    for s in range(steps):
        rep = json.loads((run / "steps" / f"step_{s:05d}.json").read_text())
        assert rep["weights"]["version"] == s and rep["weights"]["waited_s"] >= 0
        assert rep["weights"]["path"] == (str(weights / f"step_{s:05d}") if s else None)
    rows = pq.read_table(run / "steps" / "step_00002.parquet").to_pylist()
    assert {v for r in rows for v in r["weight_versions"]} == {2}


@pytest.mark.mpi
@pytest.mark.slow
def test_one_step_off_policy_is_never_more_than_one_version_behind(tmp_path: Path) -> None:
    steps = 4
    run, weights, proc = start_loop(tmp_path, steps, max_staleness=1)
    seen: dict[int, set[int]] = {}

    def one_behind(s: int, versions: list[list[int]]) -> None:
        # A row may list two versions: one published while the step ran is loaded at once.
        seen[s] = {v for vs in versions for v in vs}
        assert all(vs == sorted(vs) for vs in versions), (s, versions)
        assert max(s - 1, 0) <= min(seen[s]) and max(seen[s]) <= s, (s, versions)

    try:
        trainer(run, weights, steps, one_behind)
    finally:
        output = finish(proc, 120)
    assert proc.returncode == 0, output
    for s in range(steps):
        w = json.loads((run / "steps" / f"step_{s:05d}.json").read_text())["weights"]
        assert min(seen[s]) == w["version"] and seen[s] <= {w["version"], *(u["version"] for u in w["updates"])}


@pytest.mark.mpi
@pytest.mark.slow
def test_no_trainer_fails_the_run_naming_the_missing_version_and_never_loads_an_unmarked_one(tmp_path: Path) -> None:
    run, weights = tmp_path / "run", tmp_path / "weights"
    # What a publish that died leaves: its temp dir, and a renamed dir without its marker.
    (weights / ".step_00001.tmp-x").mkdir(parents=True)
    (weights / ".step_00001.tmp-x" / "model.safetensors").write_bytes(b"half")
    (weights / "step_00001").mkdir()
    (weights / "step_00001" / IN_PROGRESS).write_text("{}")
    (weights / "step_00001" / "model.safetensors").write_bytes(b"x")
    out = launch([f"hydra.run.dir={run}", *RUN, "steps=2", f"rollout.weights_dir={weights}",
                  "rollout.max_staleness=0", "rollout.weights_timeout_s=3"])
    text = out.stdout + out.stderr  # on one line: errors are never wrapped
    assert out.returncode == 1, text
    want = ("step 1 needs weights at most rollout.max_staleness = 0 behind: no checkpoint of weight version >= 1 "
            f"(step_00001 .. step_00001) was published in {weights} within rollout.weights_timeout_s = 3s "
            "(none is published)")
    assert want in text
    report = json.loads((run / "report.json").read_text())
    assert report["status"] == "failed" and want in report["error"]
    rep = json.loads((run / "steps" / "step_00000.json").read_text())
    assert rep["weights"]["version"] == 0 and rep["weights"]["path"] is None
    assert not (run / "steps" / "step_00001.json").exists()
    with pytest.raises(samples.RunEnded, match="without step 1; the last step with a report is 0"):
        samples.wait_step(run, 1, timeout_s=3600)


@pytest.mark.mpi
@pytest.mark.slow
def test_a_load_that_cannot_finish_while_a_step_runs_ends_the_run_at_once(tmp_path: Path) -> None:
    """``update_mode=drain``: a checkpoint published while the step runs waits for the requests in the
    engines, which take ten minutes here; past ``rollout.load_timeout_s`` the run fails at once, naming the
    replicas still loading, rather than after every session of the step has ended."""
    from tests.helpers.procs import wait_for
    from toolkit.client import router_status
    from toolkit.core.security import client_curve

    run, weights, checkpoint = tmp_path / "run", tmp_path / "weights", tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    rd = RunDir(run)
    proc = start_launch([f"hydra.run.dir={run}", "steps=1", "sessions_per_step=6", "router.heartbeat_s=0.2",
                         "engine.time_scale=300", f"rollout.weights_dir={weights}", "rollout.update_mode=drain",
                         "rollout.load_timeout_s=2"])

    def running() -> bool:
        info = read_json(rd.router_address)
        st = info and router_status(info["frontend"], 2.0, curve=client_curve(run))
        return bool(st and st.inflight)

    try:
        wait_for(running, 120, "step 0's requests in the engines")
        publish(weights, 0, checkpoint)
    finally:
        output = finish(proc, 240)
    assert proc.returncode == 1, output
    want = f"weights {weights / 'step_00000'} (version 0) not loaded by every replica within 2s; still loading: "
    assert want in output
    report = json.loads((run / "report.json").read_text())
    assert report["status"] == "failed" and want in report["error"]
    assert not (run / "steps" / "step_00000.json").exists()
