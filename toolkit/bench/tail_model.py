"""``python -m toolkit.bench tail_model``: how close placement could bring the tail bench's steps to
their lower bound, on a model of its fleet with no process in it.

It replays the tail bench's workload and fleet as a discrete-event model (``tail_events.py``), with
the router's own hashing and ``age`` policy, to tell a limit of scheduling from one of the
implementation. ``DESIGNS`` adds designs the router cannot run today: more room, KV moves, trades,
``rank`` with and without a predictor, oracles. The model and the designs: docs/benchmarks.md#tail_model;
results: docs/tail-routing.md.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from toolkit.bench.tail_arms import ARMS, SESSIONS
from toolkit.bench.tail_events import LINK_BYTES_PER_S, Design, Step, workload
from toolkit.config import Config, compose_config
from toolkit.core.rundir import RunDir

__all__ = ["DESIGNS", "TWINS", "Design", "Step", "bench_config", "model_step", "run", "run_workload", "twin",
           "workload"]

DESIGNS = (
    Design("off", "off"), Design("off_room64", "off", tail_room=64), Design("age", "age"),
    Design("age_q0.8", "age", tail={"long_quantile": 0.8}),
    Design("age_tokens250", "age", tail={"long_tokens": 250}),
    Design("age_room32", "age", tail_room=32), Design("age_room64", "age", tail_room=64),
    Design("age_kv", "age", kv=True), Design("age_kv_room64", "age", tail_room=64, kv=True),
    Design("age_swap", "age", swap=True), Design("age_kv_swap", "age", kv=True, swap=True),
    Design("age_behind0.5", "age", behind=0.5),
    Design("rank", "rank"), *(Design(f"rank_foresight{f:g}", "rank", foresight=f) for f in (0.75, 0.5, 0.25, 0.0)),
    *(Design(f"age_hint{f:g}", "age", hint=f) for f in (0.5, 0.25)),
    Design("oracle_reveal24", "oracle", kv=True, reveal=24), Design("oracle", "oracle"),
)

TWINS: dict[str, Design] = {
    "off": Design("off", "off"), "age": Design("age", "age"), "age+kv": Design("age_kv", "age", kv=True),
    "age+trade+kv": Design("age_kv_swap", "age", kv=True, swap=True),
}
"""The tail bench's arms the model can run as the router does (the others have no twin here)."""


def bench_config(max_tokens: int = 2048) -> Config:
    """The tail bench's config (its ``age`` arm; the designs change only placement)."""
    return compose_config([f"sessions_per_step={SESSIONS}", "engine.time_scale=0.25",
                           f"workload.max_tokens={max_tokens}", *ARMS["age"]])


def model_step(cfg: Config, design: Design, seed: int) -> dict[str, Any]:
    """One modelled step of ``design`` (seconds at ``cfg.engine.time_scale``)."""
    prompts, lengths = workload(cfg, seed)
    return Step(cfg, design, prompts, lengths).run()


def run_workload(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """A step's prompts and turn lengths as a run made them, from its Parquet file: a session's turns are
    the runs of its loss mask (what the engines generated, between observations of at least a token)."""
    rows = pq.read_table(path, columns=["prompt_length", "loss_mask"]).to_pylist()
    turns = [[len(list(run)) for bit, run in itertools.groupby(r["loss_mask"]) if bit] for r in rows]
    lengths = np.zeros((len(rows), max(map(len, turns), default=0)), dtype=np.int64)
    for i, t in enumerate(turns):
        lengths[i, : len(t)] = t
    return np.array([r["prompt_length"] for r in rows], dtype=np.int64), lengths


def twin(cfg: Config, run: RunDir, steps: Iterable[int], arms: Iterable[str]) -> dict[str, Any]:
    """The model of ``arms`` (those in :data:`TWINS`, ``off`` among them) on a run's own steps: the same
    sessions and turn lengths, placed with no process in the way. Beside a real arm's figures, its twin's
    tell what the implementation costs from what the design does."""
    work = [run_workload(run.step_parquet(k)) for k in steps]
    results = {arm: [Step(cfg, TWINS[arm], p, lengths).run() for p, lengths in work] for arm in arms if arm in TWINS}
    off = statistics.fmean(s["wall_s"] for s in results["off"])
    return {
        "steps": len(work),
        "speedup": {arm: round(off / statistics.fmean(s["wall_s"] for s in out), 3) for arm, out in results.items()
                    if arm != "off"},
        "bound_ratio": {arm: round(statistics.fmean(s["bound_ratio"] for s in out), 3) for arm, out in results.items()},
    }


def _summary(results: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    def mean(name: str, key: str) -> float:
        return statistics.fmean(s[key] for s in results[name])

    off = mean("off", "wall_s")
    return {name: {"step_time_s": round(mean(name, "wall_s"), 3), "speedup": round(off / mean(name, "wall_s"), 3),
                   "bound_ratio": round(mean(name, "bound_ratio"), 3), "moves_per_step": round(mean(name, "moves"), 1),
                   "prefix_hit": round(mean(name, "prefix_hit"), 4)}
            for name in results}


def run(quick: bool = False) -> dict[str, Any]:
    steps = 4 if quick else 40
    out: dict[str, Any] = {"steps": steps, "sessions_per_step": SESSIONS, "link_bytes_per_s": LINK_BYTES_PER_S}
    for max_tokens, key in ((2048, "designs"), (1024, "moderate_tail")):
        cfg = bench_config(max_tokens)
        out[key] = _summary({d.name: [model_step(cfg, d, seed) for seed in range(steps)] for d in DESIGNS})
    return out
