"""Rollout ranks under a real mpiexec against a real router and sim replica: ranks fail loudly together,
a wrongly wired MPI world is detected, and ``rollout.output=shards`` with decoded responses."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.procs import wait_for
from toolkit import samples as api
from toolkit.cluster.local import find_mpiexec
from toolkit.config import compose_config, save_run_config
from toolkit.core.lifecycle import read_pidfiles
from toolkit.core.rundir import RunDir, read_json
from toolkit.launch.stack import LocalStack
from toolkit.launch.validation import validate
from toolkit.model.tokenizer import ByteTokenizer

pytestmark = [pytest.mark.mpi, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
BASE = ["groups=single", "engine.time_scale=0.1", "workload=singleturn", "workload.max_tokens=32"]
HANG_S = 120  # a hard bound: reaching it means the ranks hung, which is the failure under test


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    """One router and one sim replica shared by every run of this module (each run uses its own job)."""
    cfg = compose_config(BASE)
    validate(cfg)
    s = LocalStack(cfg, tmp_path_factory.mktemp("stack") / "run")
    try:
        s.start(timeout_s=60)
        yield s
    finally:
        s.stop()


def run_dir(root: Path, overrides: list[str], router: LocalStack | None = None) -> RunDir:
    cfg = compose_config([*BASE, *overrides])
    validate(cfg)
    rd = RunDir(root)
    rd.make()
    save_run_config(cfg, rd.config)
    if router is not None:
        shutil.copy(router.run_dir.router_address, rd.router_address)
    return rd


def ranks(rd: RunDir, n: int | None) -> tuple[int, str]:
    """Run the ranks (under ``mpiexec -n n``, or one bare process for None); (exit code, output)."""
    cmd = [sys.executable, "-m", "toolkit.rollout.worker", str(rd.root)]
    if n is not None:
        cmd = [find_mpiexec(None), "-n", str(n), *cmd]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            start_new_session=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        out, _ = proc.communicate(timeout=HANG_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # our own process group: mpiexec and its ranks
        out, _ = proc.communicate()
        pytest.fail(f"the ranks hung for {HANG_S}s:\n{out}")
    return proc.returncode, out


def assert_no_rank_left(rd: RunDir) -> None:
    # mpiexec can return a moment before the rank that called MPI_Abort has finished exiting.
    refs = read_pidfiles(rd.pids)
    wait_for(lambda: not any(r.alive() for r in refs), 30, f"rank processes to exit: {[r.name for r in refs]}")


@pytest.mark.parametrize(("n", "step", "index"), [(2, 0, 1), (3, 1, 0), (3, 0, 5)])
def test_one_rank_raising_ends_the_step_on_every_rank(stack: LocalStack, tmp_path: Path, n: int, step: int,
                                                      index: int) -> None:
    # Session i runs on rank i % n: (2, 0, 1) fails rank 1 while rank 0 waits for it at the gather;
    # (3, 1, 0) fails rank 0 in the second step; (3, 0, 5) fails rank 2 of three.
    rd = run_dir(tmp_path / "run", [f"ranks={n}", "steps=2", "sessions_per_step=9", f"job=crash{n}{step}{index}",
                                    "workload.env._target_=tests.helpers.mpi_crash_env.CrashAt",
                                    f"+workload.env.step={step}", f"+workload.env.index={index}"], stack)
    code, out = ranks(rd, n)
    assert code != 0, out
    # The failing rank's own log: mpiexec may kill its output forwarders at the MPI_Abort before they
    # relay the rank's last lines.
    log = (rd.logs / f"rank-{index % n}.log").read_text()
    assert f"rank {index % n} failed: environment crashed on step {step} session {index}" in log, out
    assert (read_json(rd.step_report(0)) is not None) == (step > 0)  # steps before the failure are complete
    assert read_json(rd.step_report(step)) is None
    assert_no_rank_left(rd)


@pytest.mark.parametrize("n", [2, 3])
def test_shards_with_decoded_responses(stack: LocalStack, tmp_path: Path, n: int) -> None:
    rd = run_dir(tmp_path / "run", [f"ranks={n}", "steps=2", "sessions_per_step=10", f"job=shards{n}",
                                    "rollout.output=shards", "rollout.decode_responses=true",
                                    "+workload.tokenizer._target_=toolkit.model.tokenizer.ByteTokenizer"], stack)
    code, out = ranks(rd, n)
    assert code == 0, out
    assert api.steps(rd.root) == [0, 1]
    tok = ByteTokenizer()
    for step in (0, 1):
        manifest = read_json(rd.steps / f"step_{step:05d}" / "manifest.json")
        assert manifest["rows"] == 10 and len(manifest["shards"]) == n
        assert not rd.step_parquet(step).exists()  # rank 0 wrote no samples, only the manifest
        report = read_json(rd.step_report(step))
        assert report["sessions"] == 10 and report["sessions_by_status"] == {"completed": 10}
        rows = api.read_step(rd.root, step).to_pylist()
        assert [r["index"] for r in rows] == list(range(10))
        for r in rows:
            assert r["session_id"] == f"shards{n}/{step}/{r['index']}"
            assert r["metadata"] == {"response_decoded": True} and r["response"]
            assert r["response"] == tok.decode(r["tokens"][r["prompt_length"]:])
    assert_no_rank_left(rd)


def test_two_unwired_processes_each_see_a_world_of_one(tmp_path: Path) -> None:
    # What `srun --mpi=none` does: R processes that each think they are the whole world.
    rd = run_dir(tmp_path / "run", ["ranks=2"])
    cmd = [sys.executable, "-m", "toolkit.rollout.worker", str(rd.root)]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": str(ROOT)}) for _ in range(2)]
    try:
        outs = [p.communicate(timeout=HANG_S)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 3, out
        assert "MPI world has 1 rank(s) but ranks=2" in out and "wired for MPI" in out


@pytest.mark.parametrize("n", [1, 3])
def test_mpiexec_with_the_wrong_rank_count_is_refused(tmp_path: Path, n: int) -> None:
    rd = run_dir(tmp_path / "run", ["ranks=2"])
    code, out = ranks(rd, n)
    assert code == 3, out
    assert f"MPI world has {n} rank(s) but ranks=2" in out
