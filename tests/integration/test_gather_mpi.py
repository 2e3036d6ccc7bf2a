from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from toolkit.cluster.local import find_mpiexec

pytestmark = pytest.mark.mpi
ROOT = Path(__file__).resolve().parents[2]


def mpirun(ranks: int, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([find_mpiexec(None), "-n", str(ranks), sys.executable, str(ROOT / "tests" / "helpers" / "mpi_gather_script.py"),
                           *args], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.parametrize("ranks", [2, 3])
def test_gatherv_of_packed_samples(ranks: int) -> None:
    out = mpirun(ranks, "50")
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"OK size={ranks} rows=50" in out.stdout


@pytest.mark.parametrize(("ranks", "rows"), [(2, 41), (3, 41), (3, 2)])  # (3, 2): one rank has no session
def test_shards_and_manifest_read_back_as_one_step(ranks: int, rows: int, tmp_path: Path) -> None:
    out = mpirun(ranks, str(rows), "shards", str(tmp_path / "run"))
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"OK shards size={ranks} rows={rows}" in out.stdout
    assert sorted(p.name for p in (tmp_path / "run" / "steps" / "step_00000").iterdir()) == [
        "manifest.json", *(f"shard_{r:05d}.parquet" for r in range(ranks))]
