"""What a twin run predicts, per config: step time (mean, p90), bound ratio, samples/s, the fleet's
busy share, prefix hit, moves per step, the share of sessions that failed and whether the run would stop
at its failure budget; and, over a sweep, which setting made the difference."""

from __future__ import annotations

import statistics
from typing import Any

import numpy as np

from toolkit.plan.twin import TwinRun

FIELDS = ("step_time_s", "step_time_p90_s", "bound_ratio", "samples_per_s", "fleet_busy_share", "prefix_hit",
          "moves_per_step", "failed_share", "twin_s")


def _mean(values: list[Any]) -> float | None:
    vals = [float(v) for v in values if v is not None]
    return statistics.fmean(vals) if vals else None


def summarize(run: TwinRun, skip: int = 0) -> dict[str, Any]:
    """The predictions over the run's steps after the first ``skip``."""
    steps = run.steps[skip:] or run.steps
    walls = [s["wall_s"] for s in steps]
    samples = sum(s.get("rows", 0) for s in steps)
    sessions = sum(s.get("sessions", 0) for s in steps)
    failed = sum((s.get("sessions_by_status") or {}).get("failed", 0) for s in steps)
    return {
        "step_time_s": statistics.fmean(walls),
        "step_time_p90_s": float(np.percentile(walls, 90)),
        "bound_ratio": _mean([s.get("bound_ratio") for s in steps]),
        "samples_per_s": samples / sum(walls) if sum(walls) > 0 else None,
        "fleet_busy_share": _mean([s.get("fleet_busy_share") for s in steps]),
        "prefix_hit": _mean([s.get("prefix_hit_rate") for s in steps]),
        "moves_per_step": _mean([(s.get("tail") or {}).get("moves", 0) for s in steps]),
        "failed_share": failed / sessions if sessions else None,
        "twin_s": run.real_s,
        "stopped": run.stopped,
    }


def difference(rows: list[dict[str, Any]], keys: list[str], field: str = "step_time_s") -> tuple[str, float] | None:
    """The swept key whose values move ``field`` most (the spread of its per-value means, the other keys
    averaged out), and that spread; None with fewer than two values of any key."""
    best: tuple[str, float] | None = None
    for key in keys:
        by: dict[str, list[float]] = {}
        for r in rows:
            if r.get(field) is not None and key in r["swept"]:
                by.setdefault(r["swept"][key], []).append(float(r[field]))
        if len(by) < 2:
            continue
        means = [statistics.fmean(v) for v in by.values()]
        spread = max(means) - min(means)
        if best is None or spread > best[1]:
            best = (key, spread)
    return best
