"""A vLLM replica wider than a node, on one machine: ``cluster.gpus_per_node=1`` with tensor parallel 2
makes each replica two node ranks (two processes, each with one CPU worker of vLLM's CPU build) that
meet only at a master address on loopback. Node rank 0 serves the engine through the router; node rank
1 runs vLLM's headless worker. A lost node rank (its replica ends as a whole, is replaced, no session
lost) is tested on two Slurm nodes (tests/cluster/test_slurm.py), where the same code runs as one job.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

if os.environ.get("TOOLKIT_REQUIRE_VLLM"):
    import vllm  # noqa: F401  (CI: a missing vLLM is a failure, not a skip)
else:
    pytest.importorskip("vllm")

import pyarrow.parquet as pq  # noqa: E402

from tests.helpers.procs import assert_no_process_left, finish, start_launch  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.mpi, pytest.mark.slow, pytest.mark.timeout(900)]


def test_a_replica_of_two_node_ranks_serves_a_step(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = start_launch([f"hydra.run.dir={run}", "engine=vllm", "model=tiny", f"engine.cache_dir={tmp_path / 'cache'}",
                         "groups=single", "engine.tensor_parallel_size=2", "cluster.gpus_per_node=1", "ranks=1",
                         "steps=1", "sessions_per_step=8", "workload.max_tokens=48"])
    output = finish(proc, 700)
    assert proc.returncode == 0, output[-5000:]
    rows = pq.read_table(run / "steps" / "step_00000.parquet").to_pylist()
    assert [r["index"] for r in rows] == list(range(8))
    assert all(r["status"] in ("completed", "truncated") and r["generated_tokens"] > 0 for r in rows), rows
    # Node rank 1 ran vLLM's headless worker, which joined node rank 0's engine.
    log1 = (run / "logs" / "replica-throughput-0-node1.log").read_text()
    assert "node rank 1 of 2" in log1 and "1 worker(s) up" in log1, log1[-3000:]
    assert_no_process_left(run)


def test_data_parallel_2_is_one_replica_with_vllms_own_balancer(tmp_path: Path) -> None:
    """The other way to use a node's devices for a small model: vLLM's ``data_parallel_size`` behind one
    replica (README: the router then sees one replica, and vLLM spreads a session's turns by load)."""
    run = tmp_path / "run"
    proc = start_launch([f"hydra.run.dir={run}", "engine=vllm", "model=tiny", f"engine.cache_dir={tmp_path / 'cache'}",
                         "groups=single", "+engine.args.data_parallel_size=2", "ranks=1", "steps=1",
                         "sessions_per_step=4"])
    output = finish(proc, 600)
    assert proc.returncode == 0, output[-5000:]
    rows = pq.read_table(run / "steps" / "step_00000.parquet").to_pylist()
    assert [r["index"] for r in rows] == list(range(4)) and all(r["generated_tokens"] > 0 for r in rows)
    # One replica to the router, two engine cores (one per data-parallel rank) in it.
    status = json.loads((run / "report.json").read_text())
    assert status["status"] == "ok"
    engines = [p for p in (run / "pids").glob("replica-throughput-0-engine.*.pid")]
    assert len(engines) >= 2, engines
    assert not (run / "logs" / "replica-throughput-1.log").exists()
    assert_no_process_left(run)
