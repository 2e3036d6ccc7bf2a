"""``python -m toolkit.bench twin``: how well the fleet twin predicts real runs, and how fast it is.

For the tail bench's arms and two more workloads (a heavier tail; GRPO groups of 8 with correlated
lengths) each arm runs as a real ``launch`` (router, sim replicas, MPI ranks) and as a twin of the same
config and seed; the twin's error is its mean step time against the real one, and the arms' order is
compared wherever the real arms' 95% intervals do not overlap. Then the twin's own time on the headline
workload (12 steps) and on one step of 65,536 sessions on 4,096 replicas, and the router's decision
cost at 4,096 replicas. Method: docs/benchmarks.md#twin.
"""

from __future__ import annotations

import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from toolkit.bench.router import decision_cost
from toolkit.bench.tail import SIBLINGS
from toolkit.bench.tail_arms import ARMS, SESSIONS
from toolkit.config import Config, compose_config
from toolkit.core.rundir import RunDir
from toolkit.launch.app import run as launch_run
from toolkit.launch.validation import validate
from toolkit.plan.twin import Twin

TIME_SCALE = 0.5
"""The real runs' ``engine.time_scale``: half of modelled real time (the twin predicts the same)."""
WARMUP_STEPS = 1
HEADLINE = (f"sessions_per_step={SESSIONS}", "workload.max_tokens=2048", "seed=7")
"""The tail bench's main workload on the default fleet."""
WORKLOADS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "tail": (HEADLINE, tuple(ARMS)),
    "heavier_tail": ((*HEADLINE, "engine.output_len_sigma=1.3"), ("off", "age", "age+count", "age+trade+kv")),
    "grpo8": ((*HEADLINE, *SIBLINGS), ("off", "age", "age+count", "age+trade+kv")),
}
"""Each workload's overrides and the arms (``tail_arms.ARMS``) it runs."""
SCALE = ("steps=1", "sessions_per_step=65536", "groups.throughput.replicas=4064", "groups.tail.replicas=32",
         "ranks=8", *HEADLINE[1:])
"""One step of 65,536 sessions of the headline workload's kind on 4,096 replicas (the default fleet's
shape, scaled)."""


def _config(overrides: list[str]) -> Config:
    cfg = compose_config(overrides)
    validate(cfg)
    return cfg


def _ci95(a: list[float]) -> tuple[float, float]:
    """A bootstrap 95% interval of the mean."""
    x = np.asarray(a)
    means = x[np.random.default_rng(0).integers(0, x.size, size=(4000, x.size))].mean(axis=1)
    lo, hi = np.percentile(means, [2.5, 97.5])
    return float(lo), float(hi)


def measure(name: str, steps: int, root: Path, time_scale: float = TIME_SCALE,
            arms: tuple[str, ...] | None = None) -> dict[str, Any]:
    base, every = WORKLOADS[name]
    arms = arms or every
    out: dict[str, Any] = {}
    for arm in arms:
        overrides = [*base, *ARMS[arm], f"steps={steps + WARMUP_STEPS}", f"engine.time_scale={time_scale}"]
        run_dir = root / f"{name}-{arm}".replace("+", "_")
        launch_run(_config(overrides), RunDir(run_dir), Console(quiet=True))
        real = [s["wall_s"] for s in json.loads(RunDir(run_dir).report.read_text())["steps"]][WARMUP_STEPS:]
        twin = [s["wall_s"] for s in Twin(_config(overrides)).run().steps][WARMUP_STEPS:]
        real_s, twin_s = statistics.fmean(real), statistics.fmean(twin)
        out[arm] = {"real_s": round(real_s, 3), "twin_s": round(twin_s, 3), "error": round(twin_s / real_s - 1, 4),
                    "real_ci95": [round(v, 3) for v in _ci95(real)], "real_steps": [round(v, 3) for v in real],
                    "twin_steps": [round(v, 3) for v in twin]}
    pairs = {}
    for a, b in itertools.combinations(arms, 2):
        (alo, ahi), (blo, bhi) = out[a]["real_ci95"], out[b]["real_ci95"]
        differ = ahi < blo or bhi < alo
        same = (out[a]["real_s"] < out[b]["real_s"]) == (out[a]["twin_s"] < out[b]["twin_s"])
        pairs[f"{a} vs {b}"] = {"real_differ": differ, "twin_same_order": same}
    return {"arms": out, "pairs": pairs,
            "order_same": all(p["twin_same_order"] for p in pairs.values() if p["real_differ"]),
            "max_abs_error": round(max(abs(v["error"]) for v in out.values()), 4)}


def twin_seconds(overrides: tuple[str, ...]) -> float:
    cfg = _config(list(overrides))
    t = time.perf_counter()
    Twin(cfg).run()
    return time.perf_counter() - t


def fresh_twin_seconds(overrides: tuple[str, ...], runs: int) -> list[float]:
    """:func:`twin_seconds`, each run in a fresh process, as ``python -m toolkit.plan`` runs a twin: this
    process has run the real launches, and its heap is not a user's."""
    code = ("import json, sys; from toolkit.bench.twin import twin_seconds; "
            "print(json.dumps(twin_seconds(tuple(sys.argv[1:]))))")
    out = []
    for _ in range(runs):
        p = subprocess.run([sys.executable, "-c", code, *overrides], capture_output=True, text=True, timeout=1800)
        if p.returncode != 0:
            raise RuntimeError(f"the twin's timed run failed ({p.returncode}): {p.stderr[-2000:]}")
        out.append(round(float(p.stdout.split()[-1]), 3))
    return out


def run(quick: bool = False) -> dict[str, Any]:
    steps = 1 if quick else 6
    with tempfile.TemporaryDirectory(prefix="bench-twin-") as tmp:
        root = Path(tmp)
        if quick:  # two arms of the main workload, fast: every field, not the figures
            workloads = {"tail": measure("tail", steps, root, 0.1, ("off", "age+trade+kv"))}
        else:
            workloads = {name: measure(name, steps, root) for name in WORKLOADS}
    headline = ("steps=12", *HEADLINE)
    scale = SCALE if not quick else ("steps=1", "sessions_per_step=4096", "groups.throughput.replicas=252",
                                     "groups.tail.replicas=4", *HEADLINE[1:])
    head_runs = fresh_twin_seconds(headline, 1 if quick else 5)
    scale_runs = fresh_twin_seconds(scale, 1 if quick else 3)
    p50, p99 = decision_cost(replicas=4096, samples=2000 if quick else 20000, queued=5000 if quick else 50000)
    return {
        "workloads": workloads,
        "steps_per_arm": steps,
        "time_scale": TIME_SCALE,
        "twin_s_headline_12_steps": statistics.median(head_runs),
        "twin_s_headline_12_steps_runs": head_runs,
        "twin_s_65536_sessions_4096_replicas": statistics.median(scale_runs),
        "twin_s_65536_sessions_4096_replicas_runs": scale_runs,
        "decision_us_p50_4096": round(p50, 2),
        "decision_us_p99_4096": round(p99, 2),
    }
