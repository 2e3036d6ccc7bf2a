"""``python -m toolkit.bench tail``: the same long-tail step run off, steered, and steered + migrated.

Workload (seeded, identical in every arm): 128 multi-turn sessions per step (the built-in tool-call
task, 3 turns, 24-token observations), prompts of 64-384 tokens behind a shared 32-token system
prompt. Turn lengths are lognormal with median 180 tokens and sigma 1.0 (p90 ~650, p99 ~1,850),
cut at 2,048 = 11x the median (RL runs set the cap far above the typical answer: Seer's
production workloads cap at 40k-98k tokens), turns independent of each other (a conservative
choice: a session-level share, ``engine.output_len_session_share``, makes the tail heavier). Why it is realistic:
it is calibrated on the one published measure of the long tail we know, Seer (Moonshot AI,
arXiv:2511.14617): in a synchronous baseline the last 10% of requests take up to ~50% of the rollout
time. The bench reports the same measure for its own ``off`` arm (``tail10_share_requests_off``; the
step report's ``done_s``), 0.5-0.6 here; the sessions' (``tail10_share_sessions_off``) is lower, as a
session sums three independent turns. Scaled down so a step takes seconds on a CPU.

Sensitivity (``moderate_tail``): the same three arms with the cut at 1,024 = 5.7x the median, a
thinner tail (last 10% of requests ~40-45% of the step); the flip then comes later in the step and
leaves less to speed up.

Sensitivity (``tail_at_cap``): the main workload with the tail group at the issue's cap, 3x the
throughput group per token (TP 4 at 2/3 efficiency; more than the sim's TP model would credit an 8B
model, whose all-reduces cost tens of microseconds per layer).

Fleet (``conf/groups/default.yaml``): a throughput group of 2 replicas (TP 1, up to 64 requests in
flight each) and a tail group of 1 replica with tensor parallel 2 (up to 24 in flight). The sim's
decode step reads all weights plus every running sequence's KV cache: 16 GB of bf16 weights and 128
KiB of KV per token at 4.3 TB/s (an H200's measured copy bandwidth) gives ~3.7 ms per step; TP 2
divides the reads over two devices at 85% efficiency (all-reduce cost), so the tail group is 1.85x
faster per token at equal batch size (the issue's cap is 3x). The main workload runs at ``time_scale``
1.0: in modelled real time, so what the router itself takes (its 50 ms look for long runners, the
heartbeats its token estimates come from, a move's round trips, the processes' CPU on this machine)
weighs on a step as it would beside GPUs. Compressed 4x (``time_scale`` 0.25), each of those weighs 4x
as much against the requests' progress: ``compressed`` is the main workload so, the measure of what
the router's own latency costs, and the sensitivities below run compressed too, to keep the bench
within the hour. A migrated request continues exactly the output it was planned to produce
(``Generate.resumed_tokens``): moving it changes where it runs, never how long it is.

Arms, each a full ``launch`` run (router, sim replicas, 2 MPI ranks) in this process, one after
another: ``off`` (no tail routing: every group serves the whole step under consistent hashing),
``steer`` (the count flip at 0.95: after ceil(0.95 * 128) = 122 sessions, every request of the step,
queued ones included, goes to the tail group), ``migrate`` (steer + ``tail.migrate_inflight``: the
step's requests running elsewhere move to the tail group with their tokens, as it has room), ``age``
(``tail.policy=age``: the tail group takes the step's first turns while it has room, then only long
runners, moved with their tokens the moment they pass the step's 0.9 quantile of finished turn
lengths, oldest first, while it has room),
``predict`` (``tail.policy=predict``: a session whose earlier turn was long starts its next turn on
the tail group), ``age+count`` (age, then the flip at 0.95 with migration), ``age+kv`` (age whose moves
carry their KV over the sim's modelled 400 Gb/s link, ``tail.move=kv``, instead of prefilling it again)
and ``age+trade+kv`` (that, and with the tail group full a long runner trades places with its resident
of least expected work left, ``tail.trade_margin=200``). Step time is the
step report's ``wall_s`` (step begin to the step's Parquet file written), averaged over 12 steps per
arm (6 for the sensitivity runs) after one warm-up step; step ``k`` has the same sessions in every
arm. ``ci95`` gives paired-bootstrap 95% intervals over the steps. ``best_policy`` is the arm with the
lowest mean step time; ``speedup_best``, ``bound_ratio_best`` and ``prefix_hit_best`` are its figures.

``model_twin`` (main workload): the fleet model (``tail_model.py``) of the arms it can run as the router
does (``off``, ``age``, ``age+kv``, ``age+trade+kv``) on the very sessions and turn lengths these steps
drew, read back from the ``off`` arm's Parquet files. Beside each arm's measured figures, its twin's
tell what the design does on this workload from what the processes cost it.

Sensitivity (``correlated_siblings``): GRPO groups of 8 sessions per prompt whose turn lengths share
half their log-variance (``engine.output_len_prompt_share=0.5``), where ``predict`` can use siblings.
Seer (arXiv:2511.14617, §2.3, Fig. 4) shows "highly correlated generation lengths" within a group but
publishes no number; 0.5 is an assumption, and the main workload (no correlation) is the zero point.
For scale, not for RL: the answer lengths Zheng et al. (arXiv:2305.13144) published for Vicuna-7B on
Alpaca (one sample at each of three temperatures per prompt) share 0.84 of their log-variance within a
prompt (ICC(1), computed from their ``alpaca-val-10k-length.json``).
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from toolkit.config import Config, compose_config
from toolkit.core.rundir import RunDir
from toolkit.launch.validation import validate
from toolkit.router.tail import flip_count

THRESHOLD = 0.95
SESSIONS = 128
TIME_SCALE = 1.0
"""The main workload's ``engine.time_scale``: modelled real time."""
COMPRESSED = 0.25
"""``compressed``, the sensitivities' and ``--quick``'s: 4x faster than modelled real time."""
WARMUP_STEPS = 1
# The tail group at the cap, 3x the throughput group per token: TP 4 at 2/3 efficiency.
TAIL_AT_CAP = ("groups.tail.engine.tensor_parallel_size=4", "+groups.tail.engine.tp_efficiency=0.6667")
# GRPO groups of 8 sessions per prompt whose lengths share half their log-variance (an assumption: Seer
# shows strongly correlated sibling lengths, Fig. 4, but publishes no figure we could cite).
SIBLINGS = ("+workload.prompts.samples_per_prompt=8", "engine.output_len_prompt_share=0.5")
TRADE_MARGIN = 200
"""``age+trade+kv``: tokens of expected work by which a long runner must outrank a tail resident to trade."""
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
    from toolkit.launch.app import run

    cfg = _config(overrides)
    run(cfg, RunDir(root / name), Console(quiet=True))
    import json

    return json.loads((root / name / "report.json").read_text())["steps"]


def _ratio_of_means(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return a.mean(axis=-1) / b.mean(axis=-1)


def _mean_difference(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return a.mean(axis=-1) - b.mean(axis=-1)


def _ci95(a: np.ndarray, b: np.ndarray, stat: Any, resamples: int = 4000) -> list[float]:
    """Paired bootstrap over steps: a 95% interval of ``stat(a, b)``."""
    idx = np.random.default_rng(0).integers(0, a.size, size=(resamples, a.size))
    lo, hi = np.percentile(stat(a[idx], b[idx]), [2.5, 97.5])
    return [round(float(lo), 4), round(float(hi), 4)]


# Moves recompute and nothing trades unless an arm says otherwise (the default fleet's YAML turns both on).
_RECOMPUTE = ("tail.move=recompute", "tail.trade_margin=null")
ARMS: dict[str, tuple[str, ...]] = {
    "off": ("tail.policy=count", "tail.threshold=null", *_RECOMPUTE),
    "steer": ("tail.policy=count", f"tail.threshold={THRESHOLD}", "tail.migrate_inflight=false", *_RECOMPUTE),
    "migrate": ("tail.policy=count", f"tail.threshold={THRESHOLD}", "tail.migrate_inflight=true", *_RECOMPUTE),
    "age": ("tail.policy=age", "tail.threshold=null", "tail.migrate_inflight=false", *_RECOMPUTE),
    "predict": ("tail.policy=predict", "tail.threshold=null", "tail.migrate_inflight=false", *_RECOMPUTE),
    "age+count": ("tail.policy=age", f"tail.threshold={THRESHOLD}", "tail.migrate_inflight=true", *_RECOMPUTE),
    "age+kv": ("tail.policy=age", "tail.threshold=null", "tail.migrate_inflight=false", "tail.move=kv",
               "tail.trade_margin=null"),
    "age+trade+kv": ("tail.policy=age", "tail.threshold=null", "tail.migrate_inflight=false", "tail.move=kv",
                     f"tail.trade_margin={TRADE_MARGIN}"),
}
"""Each arm's tail settings (the rest of the config is the same in every arm)."""


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
        # The fleet model of the arms it can run, on the sessions these steps drew (imported here:
        # the model imports this module's arms).
        from toolkit.bench.tail_model import twin as model_twin

        counted = range(WARMUP_STEPS, WARMUP_STEPS + steps)
        out["model_twin"] = model_twin(_config([*base, *ARMS["age"]]), RunDir(root / _dir("off", tag)), counted, arms)
    return out


def _dir(arm: str, tag: str) -> str:
    return f"{arm}-{tag}".replace("+", "_")


def run(quick: bool = False) -> dict[str, Any]:
    sessions = 32 if quick else SESSIONS
    steps = 1 if quick else 12
    with tempfile.TemporaryDirectory(prefix="bench-tail-") as tmp:
        out = _measure(sessions, steps, 2048, Path(tmp), time_scale=COMPRESSED if quick else TIME_SCALE, twin=True)
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
