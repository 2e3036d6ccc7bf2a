"""Checks of a run's outputs: the step Parquet files and the report."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq

PLACEMENT = {"num_replicas", "cached_tokens", "groups", "replicas"}
"""Columns that say where a session ran (which replica, what its cache held): they differ between two
uninterrupted runs too. Every other column must be equal."""


def check_outputs(run: Path, steps: int, sessions: int, status: str = "ok") -> list[dict]:  # type: ignore[type-arg]
    """Every step of ``steps`` complete (each of ``sessions`` exactly once) and the report's ``status``
    (``interrupted`` for a run stopped by a signal); returns the report's steps."""
    for s in range(steps):
        table = pq.read_table(run / "steps" / f"step_{s:05d}.parquet")
        assert table.num_rows == sessions
        rows = table.to_pylist()
        assert [r["index"] for r in rows] == list(range(sessions))  # every session exactly once
        assert len({r["session_id"] for r in rows}) == sessions
        for r in rows:
            assert r["status"] == "completed", (s, r["session_id"], r["status"], r.get("error"), r.get("replicas"))
            assert len(r["tokens"]) == len(r["loss_mask"]) == len(r["rollout_logprobs"])
            assert sum(r["loss_mask"]) == r["generated_tokens"] > 0
            assert r["response_length"] == len(r["tokens"]) - r["prompt_length"]
    report = json.loads((run / "report.json").read_text())
    assert report["status"] == status
    assert [s["step"] for s in report["steps"]] == list(range(steps))
    assert report["summary"]["sessions"] == steps * sessions
    return report["steps"]  # type: ignore[no-any-return]


def assert_same_outputs(a: Path, b: Path, steps: int) -> None:
    for s in range(steps):
        ta = pq.read_table(a / "steps" / f"step_{s:05d}.parquet")
        tb = pq.read_table(b / "steps" / f"step_{s:05d}.parquet")
        assert ta.schema.names == tb.schema.names
        differ = [c for c in ta.schema.names if c not in PLACEMENT and ta.column(c).to_pylist() != tb.column(c).to_pylist()]
        assert not differ, f"step {s}: columns differ from the uninterrupted run's: {differ}"
