"""Per-request facts collected on each rank, and the step report rank 0 writes from them."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from toolkit.config import CloseMode, Config, flip_count
from toolkit.core.protocol import STATUSES, GroupStatus
from toolkit.core.rundir import atomic_write
from toolkit.rollout.bound import step_bound
from toolkit.rollout.close import STEP_COUNTERS
from toolkit.session.columns import Columns, final_rows
from toolkit.session.sample import SAMPLE_STATUSES

_UNCOUNTED = [SAMPLE_STATUSES.index("stale"), SAMPLE_STATUSES.index("filtered")]
"""Status codes of rows that are written but never counted."""

FLEET_TIME = ("replica_s", "busy_s", "generated_tokens", "engine_steps", "prefill_tokens", "model_s", "active_s")
"""The ``GroupStatus`` counters a step report keeps per group under ``fleet_time``."""


def _pct(a: np.ndarray, q: float) -> float | None:
    return float(np.percentile(a, q)) if a.size else None


def completion(done_at: np.ndarray, t0: float) -> dict[str, float | None]:
    """When the step's sessions (or requests) ended, in seconds after the step began, and
    ``tail10_share``: the share of that span spent on the last 10% of them (the measure RL systems
    papers use for the long tail, e.g. Seer, arXiv:2511.14617, where it reaches ~50%)."""
    if not done_at.size:
        return {"p50": None, "p90": None, "p95": None, "p100": None, "tail10_share": None}
    t = np.sort(done_at - t0)
    # The time the k-th of n ended, k = ceil(q * n): an order statistic, as the flip counts them.
    at = {q: float(t[max(0, math.ceil(q * t.size - 1e-9) - 1)]) for q in (0.5, 0.9, 0.95, 1.0)}
    end = at[1.0]
    return {"p50": at[0.5], "p90": at[0.9], "p95": at[0.95], "p100": end,
            "tail10_share": (end - at[0.9]) / end if end > 0 else 0.0}


def step_report(step: int, wall_s: float, t0: float, cols: Columns, req: Columns, group_names: list[str],
                cfg: Config, flip: dict[str, Any] | None,
                speeds: dict[str, GroupStatus] | None = None) -> dict[str, Any]:
    # What the engines generated for the step's requests: summing the samples' counts would count a
    # gateway session's shared turns once per branch (n > 1, a rewritten history).
    gen = int(req["output_tokens"].sum())
    by_group: dict[str, Any] = {}
    for i, g in enumerate(group_names):
        sel = req["group"] == i
        prompt = int(req["prompt_tokens"][sel].sum())
        by_group[g] = {
            "requests": int(sel.sum()),
            "prefix_hit_rate": (int(req["cached_tokens"][sel].sum()) / prompt) if prompt else None,
        }
    # A session's outcome is its last row (with gateway branches a session has several rows).
    final = final_rows(cols)
    counted = final & ~np.isin(cols["status"], _UNCOUNTED)  # (stale and filtered rows are written, never counted)
    statuses = Counter(SAMPLE_STATUSES[c] for c in cols["status"][final].tolist())
    req_status = Counter(STATUSES[c] if c < len(STATUSES) else "unknown" for c in req["status"].tolist())
    prompt_all = int(req["prompt_tokens"].sum())
    report: dict[str, Any] = {
        "step": step,
        "wall_s": wall_s,
        "started_at": t0,
        "ended_at": t0 + wall_s,
        "sessions": int(final.sum()),
        "rows": int(cols["index"].size),
        "sessions_by_status": dict(statuses),
        "requests": int(req["latency_s"].size),
        "requests_by_status": dict(req_status),
        "generated_tokens": gen,
        "tokens_per_s": gen / wall_s if wall_s > 0 else None,
        "reward_mean": float(cols["reward"][counted].mean()) if counted.any() else None,
        # How far behind the step its landed sessions' oldest policy was: {versions behind: sessions}
        # (not the rows dropped as stale, which are over the bound by definition, nor filtered ones).
        "staleness": {str(k): int(v) for k, v in
                      zip(*np.unique(cols["staleness"][counted], return_counts=True), strict=True)},
        "latency_s": {"p50": _pct(req["latency_s"], 50), "p99": _pct(req["latency_s"], 99)},
        "queue_wait_s": {cfg.job: {"p50": _pct(req["queue_s"], 50), "p99": _pct(req["queue_s"], 99)}},
        "prefix_hit_rate": (int(req["cached_tokens"].sum()) / prompt_all) if prompt_all else None,
        "done_s": {"sessions": completion(req["session_done_at"], t0),
                   "requests": completion(req["done_at"], t0)},
        "groups": by_group,
        "bound_s": None,
        "bound_ratio": None,
        "flip": None,
        "tail": None,
    }
    report.update(step_bound(cfg, req, wall_s, speeds) or {})
    # Each group's counts so far from heartbeats (the router's since it started): between two steps'
    # reports, how busy the fleet was and, with the sim, where its engines' time went.
    report["fleet_time"] = ({g: {k: getattr(s, k) for k in FLEET_TIME} for g, s in speeds.items()}
                            if speeds else None)
    if cfg.tail.active:
        moved = req["moves"] > 0
        report["tail"] = {
            "policy": cfg.tail.policy,
            "moves": int(req["moves"].sum()),
            "moved_requests": int(moved.sum()),
            "moved_tokens": int(req["output_tokens"][moved].sum()),
        }
        if cfg.tail.reserves_group:  # else every group serves the step anyway
            # Sent there by the policy (a length hint, a session that ran there), not by a flip.
            before_flip = req["dispatched_at"] < float(flip["time"]) if flip is not None else True
            started = (req["group"] == group_names.index(cfg.tail.group)) & ~moved & before_flip
            report["tail"]["started"] = int(started.sum())
    if cfg.tail.threshold is not None:
        expected = flip_count(cfg.tail.threshold, cfg.sessions_per_step)  # what the router flips at
        report["flip"] = {"expected_count": expected, "count": None, "time_s": None, "spillover": None}
        if flip is not None:
            t_flip = float(flip["time"])
            after = req["dispatched_at"] >= t_flip
            tail_code = group_names.index(cfg.tail.group)
            n_after = int(after.sum())
            report["flip"].update({
                "count": int(flip["count"]),
                "time_s": t_flip - t0,
                "requests_before_by_group": {g: int(((req["group"] == i) & ~after).sum())
                                             for i, g in enumerate(group_names)},
                "requests_after_by_group": {g: int(((req["group"] == i) & after).sum())
                                            for i, g in enumerate(group_names)},
                "spillover": (int((after & (req["group"] != tail_code)).sum()) / n_after) if n_after else 0.0,
            })
    return report


def closing_report(closing: Columns, close: CloseMode) -> dict[str, Any]:
    """The step report's counts of how the step closed (summed over ranks); with ``close=count`` also
    ``carried_groups``, the groups still running (``[started_step, group, attempt]``) that a resumed run
    restarts."""
    counts = closing["counts"].reshape(-1, len(STEP_COUNTERS)).sum(axis=0)
    out: dict[str, Any] = {"close": str(close), **{k: int(v) for k, v in zip(STEP_COUNTERS, counts, strict=True)}}
    out["closed_short"] = bool(out["closed_short"])
    if close == CloseMode.count:
        out["carried_groups"] = closing["in_flight"].reshape(-1, 3).tolist()
    return out


def write_step_report(path: Path, report: dict[str, Any]) -> None:
    def clean(x: Any) -> Any:
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        return x

    atomic_write(path, json.dumps(clean(report), indent=1))
