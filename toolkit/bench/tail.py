"""``python -m toolkit.bench tail``: the same long-tail step run with each tail routing setting.

One seeded workload (128 three-turn sessions per step, lognormal turn lengths with a long tail) runs
on the default fleet as a full ``launch`` per arm: ``off``, ``steer``, ``migrate``, ``age``,
``predict``, ``age+count``, ``age+kv``, ``age+trade+kv``. Then sensitivities: compressed time, a
thinner tail, a faster tail group, correlated siblings, length hints. ``model_twin`` runs each arm's
fleet twin (``toolkit.plan``) on the same config: the same sessions, no process in the way. Workload, fleet and arms: docs/benchmarks.md#tail;
results: docs/tail-routing.md.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from toolkit.bench.tail_arms import ARMS, SESSIONS, THRESHOLD
from toolkit.config import Config, compose_config
from toolkit.core.rundir import RunDir
from toolkit.launch.app import run as launch_run
from toolkit.launch.validation import validate
from toolkit.plan.twin import Twin
from toolkit.router.tail import flip_count

TIME_SCALE = 1.0
"""The main workload's ``engine.time_scale``: modelled real time."""
COMPRESSED = 0.25
"""``compressed``'s and the sensitivities': 4x faster than modelled real time."""
QUICK_SCALE = 0.1
"""``--quick``'s (a smoke run of every field): 10x faster than modelled real time."""
WARMUP_STEPS = 1
# The tail group at the cap, 3x the throughput group per token: TP 4 at 2/3 efficiency.
TAIL_AT_CAP = ("groups.tail.engine.tensor_parallel_size=4", "+groups.tail.engine.tp_efficiency=0.6667")
# GRPO groups of 8 sessions per prompt whose lengths share half their log-variance (an assumption: Seer
# shows strongly correlated sibling lengths, Fig. 4, but publishes no figure we could cite).
SIBLINGS = ("+workload.prompts.samples_per_prompt=8", "engine.output_len_prompt_share=0.5")
HINT_SIGMAS = (0.25, 0.5)
"""``length_hints``: the sigma of the length predictor's lognormal miss (the turn lengths' own is 1.0)."""


def hints(sigma: float) -> tuple[str, ...]:
    """The main workload with every turn hinted by the sim's own plan, off by a lognormal of ``sigma``."""
    return (f"+workload.length_hint={{_target_:toolkit.rollout.hints.SimOracle,sigma:{sigma},engine:${{engine}}}}",)


def _config(overrides: list[str]) -> Config:
    cfg = compose_config(overrides)
    validate(cfg)
    return cfg


def _arm(name: str, overrides: list[str], root: Path) -> list[dict[str, Any]]:
    cfg = _config(overrides)
    launch_run(cfg, RunDir(root / name), Console(quiet=True))
    return json.loads(RunDir(root / name).report.read_text())["steps"]


def _ratio_of_means(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return a.mean(axis=-1) / b.mean(axis=-1)


def _mean_difference(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return a.mean(axis=-1) - b.mean(axis=-1)


def _ci95(a: np.ndarray, b: np.ndarray, stat: Any, resamples: int = 4000) -> list[float]:
    """Paired bootstrap over steps: a 95% interval of ``stat(a, b)``."""
    idx = np.random.default_rng(0).integers(0, a.size, size=(resamples, a.size))
    lo, hi = np.percentile(stat(a[idx], b[idx]), [2.5, 97.5])
    return [round(float(lo), 4), round(float(hi), 4)]


def _measure(
    sessions: int, steps: int, max_tokens: int, root: Path, fleet: tuple[str, ...] = (),
    arms: tuple[str, ...] = tuple(ARMS), name: str = "main", time_scale: float = COMPRESSED, twin: bool = False,
) -> dict[str, Any]:
    base = [
        *fleet,
        f"sessions_per_step={sessions}",
        f"steps={steps + WARMUP_STEPS}",
        f"engine.time_scale={time_scale}",
        f"workload.max_tokens={max_tokens}",
        "seed=7",
    ]
    tag = f"{name}-{max_tokens}-x{time_scale:g}"
    # Every arm's first step also pays for first use (imports, Parquet writer, caches): not counted.
    results = {arm: _arm(_dir(arm, tag), [*base, *ARMS[arm]], root)[WARMUP_STEPS:] for arm in arms}

    def mean(arm: str, key: str) -> float:
        return statistics.fmean(s[key] for s in results[arm])

    def column(arm: str, key: str) -> np.ndarray:
        return np.array([s[key] for s in results[arm]], dtype=np.float64)

    def tail10(what: str) -> float:
        return statistics.fmean(s["done_s"][what]["tail10_share"] for s in results["off"])

    flips = [s["flip"] for arm in results for s in results[arm] if s.get("flip") and s["flip"].get("count")]
    after = sum(sum(f.get("requests_after_by_group", {}).values()) for f in flips)
    spilled = sum(f["spillover"] * sum(f.get("requests_after_by_group", {}).values()) for f in flips)
    counts = sorted({f["count"] for f in flips})
    wall = {arm: mean(arm, "wall_s") for arm in results}
    policies = [arm for arm in results if arm != "off"]
    best = min(policies, key=lambda arm: wall[arm])
    lost = {arm: sum(n for s in results[arm] for k, n in s["requests_by_status"].items() if k != "ok")
            for arm in results}
    out: dict[str, Any] = {
        **{f"step_time_{arm}_s": round(wall[arm], 3) for arm in results},
        **{f"speedup_{arm}": round(wall["off"] / wall[arm], 3) for arm in policies},
        **{f"prefix_hit_{arm}": round(mean(arm, "prefix_hit_rate"), 4) for arm in results},
        "best_policy": best,
        "speedup_best": round(wall["off"] / wall[best], 3),
        "bound_ratio_best": round(mean(best, "bound_ratio"), 3),
        "prefix_hit_best": round(mean(best, "prefix_hit_rate"), 4),
        "flip_at": counts[0] if len(counts) == 1 else counts,
        "expected_flip_at": flip_count(THRESHOLD, sessions),
        "spillover": round(spilled / after, 6) if after else 0.0,
        "tail10_share_requests_off": round(tail10("requests"), 3),
        "tail10_share_sessions_off": round(tail10("sessions"), 3),
        "flip_share_of_step_off": round(
            statistics.fmean(
                s["done_s"]["sessions"]["p95"] / s["done_s"]["sessions"]["p100"] for s in results["off"]
            ),
            3,
        ),
        # Step k holds the same sessions in every arm, but where its longest sessions land depends on
        # timing: identical runs differ by up to ~30% on one step.
        "ci95": {
            **{f"speedup_{arm}": _ci95(column("off", "wall_s"), column(arm, "wall_s"), _ratio_of_means)
               for arm in policies},
            "speedup_best": _ci95(column("off", "wall_s"), column(best, "wall_s"), _ratio_of_means),
            "prefix_hit_best_minus_off": _ci95(
                column(best, "prefix_hit_rate"), column("off", "prefix_hit_rate"), _mean_difference
            ),
        },
        # How far each arm's steps are from their lower bound (critical path or throughput; the step
        # report's ``bound_ratio``): what scheduling could still win.
        "bound_ratio": {arm: round(mean(arm, "bound_ratio"), 3) for arm in results},
        # Requests moved to the tail group while they ran, per step (a long runner, or after the flip).
        "moves_per_step": {arm: round(statistics.fmean((s.get("tail") or {}).get("moves", 0) for s in results[arm]), 1)
                           for arm in results},
        # Requests that did not end ``ok`` (a moved request is one request: it ends once, with every token).
        "requests_not_ok": lost,
        "max_tokens": max_tokens,
        "time_scale": time_scale,
        "step_times_s": {arm: [round(s["wall_s"], 3) for s in steps_] for arm, steps_ in results.items()},
    }
    if twin:
        # The fleet twin of every arm: the same configs, sessions and tokens, no process in the way.
        runs = {arm: Twin(_config([*base, *ARMS[arm]])).run().steps[WARMUP_STEPS:] for arm in arms}
        twin_wall = {arm: statistics.fmean(s["wall_s"] for s in r) for arm, r in runs.items()}
        out["model_twin"] = {
            "steps": steps,
            "speedup": {arm: round(twin_wall["off"] / twin_wall[arm], 3) for arm in policies},
            "bound_ratio": {arm: round(statistics.fmean(s["bound_ratio"] for s in r), 3) for arm, r in runs.items()},
        }
    return out


def _dir(arm: str, tag: str) -> str:
    return f"{arm}-{tag}".replace("+", "_")


def run(quick: bool = False) -> dict[str, Any]:
    sessions = 32 if quick else SESSIONS
    steps = 1 if quick else 12
    with tempfile.TemporaryDirectory(prefix="bench-tail-") as tmp:
        out = _measure(sessions, steps, 2048, Path(tmp), time_scale=QUICK_SCALE if quick else TIME_SCALE, twin=True)
        if not quick:
            out["compressed"] = _measure(sessions, steps, 2048, Path(tmp), name="compressed")
            out["moderate_tail"] = _measure(sessions, steps // 2, 1024, Path(tmp), name="moderate")
            out["tail_at_cap"] = _measure(sessions, steps // 2, 2048, Path(tmp), TAIL_AT_CAP, name="cap")
            out["correlated_siblings"] = _measure(sessions, steps // 2, 2048, Path(tmp), SIBLINGS,
                                                  ("off", "age", "predict", "age+count", "age+trade+kv"), name="siblings")
            out["length_hints"] = {
                f"sigma{sigma:g}": _measure(sessions, steps // 2, 2048, Path(tmp), hints(sigma),
                                            ("off", "age", "age+count", "age+trade+kv"), name=f"hints{sigma:g}")
                for sigma in HINT_SIGMAS}
    out.update({"sessions_per_step": sessions, "steps_per_arm": steps, "threshold": THRESHOLD})
    return out
