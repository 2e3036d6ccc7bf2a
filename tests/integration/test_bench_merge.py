"""The merge benchmark runs both arms under a real mpiexec and reports its fields (no timing asserts)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

FIELDS = {"rank0_cpu_s_central", "rank0_cpu_s_distributed", "rank0_cpu_ratio", "rank0_peak_rss_mb_central",
          "rank0_peak_rss_mb_distributed", "output_mb", "merge_tokens_per_s"}


def test_merge_bench_quick_run_reports_its_fields(tmp_path: Path) -> None:
    out = tmp_path / "merge.json"
    proc = subprocess.run([sys.executable, "-m", "toolkit.bench", "merge", "--json", str(out), "--quick"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = json.loads(out.read_text())
    assert FIELDS <= set(r)
    assert r["ranks"] == 4 and r["outputs_identical"] is True
    assert r["rank0_cpu_s_central"] > 0 and r["rank0_cpu_s_distributed"] > 0
    assert r["rank0_cpu_ratio"] == pytest.approx(r["rank0_cpu_s_distributed"] / r["rank0_cpu_s_central"], rel=0.02)
    assert r["output_mb"] > 0 and r["merge_tokens_per_s"] > 0
    assert r["record_tokens_total"] > r["tokens_total"] > 0
