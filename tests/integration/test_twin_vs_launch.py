"""The twin and a real launch (router, sim replicas and MPI ranks as processes) on one config: every
session lands exactly once in both, with the same tokens and turns, and the same requests counted;
and a replay of that run (``toolkit/plan/replay.py``), under its own settings and under others, says
what the run's sessions said."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq

from tests.helpers.procs import launch
from toolkit.config import compose_config
from toolkit.launch.validation import validate
from toolkit.plan.replay import Recorded
from toolkit.plan.twin import Twin

CONFIG = ["engine.time_scale=0.05", "router.heartbeat_s=0.2", "sessions_per_step=24", "steps=2",
          "workload.max_tokens=512", "seed=11"]


def test_the_twin_and_a_launch_land_the_same_sessions_with_the_same_tokens(tmp_path: Path) -> None:
    run = tmp_path / "real"
    proc = launch([f"hydra.run.dir={run}", *CONFIG])
    assert proc.returncode == 0, proc.stderr[-3000:]
    real = json.loads((run / "report.json").read_text())["steps"]
    cfg = compose_config(CONFIG)
    validate(cfg)
    twin = Twin(cfg).run()
    assert len(twin.steps) == len(real) == 2
    for step, (t, r) in enumerate(zip(twin.steps, real, strict=True)):
        rows = pq.read_table(run / "steps" / f"step_{step:05d}.parquet").to_pylist()
        landed = {(row["started_step"], row["index"]): (row["generated_tokens"], row["num_turns"]) for row in rows}
        assert twin.sessions[step] == landed  # every session once, the same tokens and turns
        assert sorted(landed) == [(step, i) for i in range(24)]
        for key in ("sessions", "requests", "generated_tokens", "sessions_by_status", "requests_by_status"):
            assert t[key] == r[key], (step, key)

    # The run replayed: its own sessions, as they were and on a fleet with another tail replica.
    rec = Recorded(run)
    for overrides in ([], ["groups.tail.replicas=2", "tail.policy=count"]):
        cfg = rec.config(overrides)
        validate(cfg)
        replayed = Twin(cfg, plan=rec.plan, gaps=rec.gaps).run()
        for step in range(2):
            rows = pq.read_table(run / "steps" / f"step_{step:05d}.parquet").to_pylist()
            assert replayed.sessions[step] == {(row["started_step"], row["index"]): (row["generated_tokens"],
                                                                                   row["num_turns"]) for row in rows}
