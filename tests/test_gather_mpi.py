from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from toolkit.cluster.local import find_mpiexec

pytestmark = pytest.mark.mpi
ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("ranks", [2, 3])
def test_gatherv_of_packed_samples(ranks: int) -> None:
    out = subprocess.run([find_mpiexec(None), "-n", str(ranks), sys.executable, str(ROOT / "tests" / "mpi_gather_script.py"),
                          "50"], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"OK size={ranks} rows=50" in out.stdout
