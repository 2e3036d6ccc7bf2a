"""Streamed weights end to end with the sim engine (its modelled link): real launches, the trainer's
``Streamer`` in this test. The router's part alone: tests/unit/test_stream_router.py; real vLLM:
tests/cluster/vllm_routed/test_vllm_stream_routed.py and tests/cluster/test_vllm_stream.py."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.helpers.procs import finish, start_launch, wait_for
from toolkit import samples
from toolkit.core.lifecycle import read_pidfiles
from toolkit.weights import Streamer

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

pytest.importorskip("torch")  # the trainer's Streamer streams over torch.distributed, to the sim's replicas too

RUN = ["engine.time_scale=0.2", "sessions_per_step=6", "router.heartbeat_s=0.2", "rollout.weights_transport=stream"]


@pytest.mark.timeout(300)
def test_each_step_runs_on_the_streamed_version_and_a_replaced_replica_gets_it_before_it_serves(tmp_path: Path) -> None:
    steps = 4
    run = tmp_path / "run"
    proc = start_launch([f"hydra.run.dir={run}", *RUN, f"steps={steps}", "rollout.max_staleness=0"])
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 1024)).astype(np.float32)
    sent: list[dict] = []
    try:
        with Streamer(run, connect_timeout_s=120) as streamer:
            for s in range(steps):
                table = samples.wait_step(run, s, timeout_s=120, poll_s=0.05)
                assert all(v == [s] for v in table.column("weight_versions").to_pylist()), (s, table)
                w[s, :16] += 1.0  # a small step: the next update is a delta
                streamer.send(s + 1, [("w", w), ("step", np.array([s + 1], dtype=np.int64))])
                sent.append(dict(streamer.last))
                if s == 0:  # a replica dies: its replacement holds version 0 until the trainer's copy
                    victim = next(r for r in read_pidfiles(run / "pids") if r.name == "replica-throughput-0")
                    os.kill(victim.pid, signal.SIGKILL)
                    # The replacement asks for the run's weights and gets a dense copy of version 1. Waited
                    # for here: the steps are short, and without it the run could end (step 2 needs only
                    # version 2) before a replacement slow to boot has registered.
                    wait_for(lambda: any(rid.startswith("throughput-0@") for _, rid in streamer.caught_up), 120,
                             "the replacement's dense copy")
            assert [v for v, rid in streamer.caught_up if rid.startswith("throughput-0@")][0] == 1, streamer.caught_up
    finally:
        output = finish(proc, 120)
    assert proc.returncode == 0, output
    assert [x["delta"] for x in sent] == [False, True, True, True]
    assert all(x["bytes"] < 0.01 * x["dense_bytes"] for x in sent[1:]), sent
    for s in range(steps):
        rep = json.loads((run / "steps" / f"step_{s:05d}.json").read_text())
        assert rep["weights"]["version"] == s, rep["weights"]
    rows = pq.read_table(run / "steps" / f"step_{steps - 1:05d}.parquet").to_pylist()
    assert {v for r in rows for v in r["weight_versions"]} == {steps - 1}
    report = json.loads((run / "report.json").read_text())
    assert report["summary"]["replica_restarts"] >= 1
