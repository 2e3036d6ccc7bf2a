"""``python -m toolkit.bench tail_model``: the tail bench's workload and fleet under each placement the
router can be set to, run by the fleet twin (``toolkit.plan``): the router's own policies on sim
engines in virtual time, no process in the way, many seeded steps. It tells a limit of scheduling from
one of the implementation: beside the real arms (``tail``), the same settings without the processes'
costs. Designs and results: docs/benchmarks.md#tail_model, docs/tail-routing.md.
"""

from __future__ import annotations

import statistics
from typing import Any

from toolkit.bench.tail_arms import ARMS, SESSIONS
from toolkit.config import Config, compose_config
from toolkit.launch.validation import validate
from toolkit.plan.twin import Twin

HINT = "+workload.length_hint={{_target_:toolkit.rollout.hints.SimOracle,sigma:{sigma},engine:${{engine}}}}"

DESIGNS: dict[str, tuple[str, ...]] = {
    "off": ARMS["off"],
    "off_room64": (*ARMS["off"], "groups.tail.max_inflight=64"),
    "age": ARMS["age"],
    "age_q0.8": (*ARMS["age"], "tail.long_quantile=0.8"),
    "age_tokens250": (*ARMS["age"], "tail.long_tokens=250"),
    "age_room32": (*ARMS["age"], "groups.tail.max_inflight=32"),
    "age_room64": (*ARMS["age"], "groups.tail.max_inflight=64"),
    "age_kv": ARMS["age+kv"],
    "age_kv_room64": (*ARMS["age+kv"], "groups.tail.max_inflight=64"),
    "age_trade_kv": ARMS["age+trade+kv"],
    "predict": ARMS["predict"],
    "age_count": ARMS["age+count"],
    **{f"age_hint{s:g}": (*ARMS["age"], HINT.format(sigma=s)) for s in (0.5, 0.25)},
}
"""Each design's overrides on the tail bench's workload: every one a setting of the router's."""
ROOMS = (16, 24, 32, 48, 64)
"""Places on the tail group (``groups.tail.max_inflight``) for ``rooms``: ``age+trade+kv`` against ``off``."""


def bench_config(overrides: tuple[str, ...], steps: int, max_tokens: int = 2048) -> Config:
    """The tail bench's workload (modelled real time) with ``overrides``, over ``steps`` seeded steps."""
    cfg = compose_config([f"sessions_per_step={SESSIONS}", f"workload.max_tokens={max_tokens}", "seed=7",
                          f"steps={steps}", *overrides])
    validate(cfg)
    return cfg


def figures(overrides: tuple[str, ...], steps: int, max_tokens: int = 2048) -> dict[str, float]:
    reports = Twin(bench_config(overrides, steps, max_tokens)).run().steps
    return {"step_time_s": statistics.fmean(s["wall_s"] for s in reports),
            "bound_ratio": statistics.fmean(s["bound_ratio"] for s in reports),
            "moves_per_step": statistics.fmean((s["tail"] or {}).get("moves", 0) for s in reports),
            "prefix_hit": statistics.fmean(s["prefix_hit_rate"] for s in reports)}


def _against_off(results: dict[str, dict[str, float]], off: str = "off") -> dict[str, Any]:
    base = results[off]["step_time_s"]
    return {name: {"step_time_s": round(f["step_time_s"], 3), "speedup": round(base / f["step_time_s"], 3),
                   "bound_ratio": round(f["bound_ratio"], 3), "moves_per_step": round(f["moves_per_step"], 1),
                   "prefix_hit": round(f["prefix_hit"], 4)} for name, f in results.items()}


def run(quick: bool = False) -> dict[str, Any]:
    steps = 1 if quick else 40
    out: dict[str, Any] = {"steps": steps, "sessions_per_step": SESSIONS}
    for max_tokens, key in ((2048, "designs"), (1024, "moderate_tail")):
        out[key] = _against_off({name: figures(o, steps, max_tokens) for name, o in DESIGNS.items()})
    rooms = {}
    for room in ROOMS[:2] if quick else ROOMS:
        place = f"groups.tail.max_inflight={room}"
        both = _against_off({"off": figures((*ARMS["off"], place), steps),
                             "age_trade_kv": figures((*ARMS["age+trade+kv"], place), steps)})
        rooms[str(room)] = {"speedup": both["age_trade_kv"]["speedup"], "bound_ratio": both["age_trade_kv"]["bound_ratio"],
                            "off_step_time_s": both["off"]["step_time_s"]}
    out["rooms"] = rooms
    return out
