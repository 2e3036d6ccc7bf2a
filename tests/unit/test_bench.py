"""The benchmark command's choices (the benchmarks' smoke runs: tests/integration/test_bench.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from toolkit.bench.__main__ import main as bench_main


def test_unknown_benchmark_names_the_choices(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:  # python -m toolkit.bench nope --json ...
        bench_main(["nope", "--json", str(tmp_path / "x.json")])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "fairness" in err and "router" in err
    assert not (tmp_path / "x.json").exists()
