"""python -m toolkit.launch with a bad config: an error list and exit 2 before anything starts, for a
config that does not validate (Hydra's app) and for an override that does not compose (the command
line's precheck). The checks themselves: tests/unit/test_config.py."""

from __future__ import annotations

from pathlib import Path

from tests.helpers.procs import launch


def test_cli_rejects_bad_config_before_starting_anything(tmp_path: Path) -> None:
    run = tmp_path / "run"
    out = launch([f"hydra.run.dir={run}", "tail.threshold=1.5", "groups.tail.replicas=0"], timeout_s=60)
    assert out.returncode == 2, out.stdout + out.stderr
    text = out.stdout + out.stderr
    assert "tail.threshold = 1.5" in text
    assert "groups.tail.replicas = 0" in text
    assert not (run / "pids").exists() and not (run / "logs").exists()


def test_cli_rejects_unknown_key(tmp_path: Path) -> None:
    out = launch([f"hydra.run.dir={tmp_path / 'run'}", "not_a_field=3"], timeout_s=60)
    assert out.returncode != 0
    assert "not_a_field" in out.stdout + out.stderr
