"""``python -m toolkit.bench kv``: routing on what the engines cache (``router.policy=kv_aware``) and
admission by KV budget, against consistent hashing and a hand-found cap, on sim engines in the fleet
twin (the router's own code, the sim's step model and prefix cache; ``toolkit/plan/``).

(a) 8,192 multi-turn sessions in flight on the default fleet: consistent hashing uncapped (today), the
best ``rollout.max_concurrent_rollouts`` of a sweep (each with either ``router.affinity``), and
``kv_aware`` with its KV budget, uncapped. (b) Churn: the headline workload with the ``age`` tail
policy moving sessions, a replica restarted and one added mid-step: consistent hashing, ``kv_aware``,
and an oracle (every turn to its longest cached prefix, whatever the load). Then the router's decision
cost with the index at 512 replicas, and its throughput with events flowing against without
(``bench router``'s setup), and the router's CPU with and without them alone on a core (``kv_router``).
Method: docs/benchmarks.md#kv.
"""

from __future__ import annotations

import multiprocessing as mp
import random
import statistics
import tempfile
from pathlib import Path
from typing import Any

from toolkit.bench import router as rb
from toolkit.bench.kv_router import EVENT_ARMS, cpu_ratio
from toolkit.bench.router import KV_BLOCK, _run_client, bench_config, decision_cost, instant_replicas
from toolkit.bench.tail_arms import SESSIONS
from toolkit.config import Config, compose_config, group_engine
from toolkit.core import protocol as P
from toolkit.core.blocks import block_hashes
from toolkit.core.lifecycle import cpu_seconds
from toolkit.launch.stack import LocalStack
from toolkit.launch.validation import validate
from toolkit.plan.fleet import TwinReplica
from toolkit.plan.twin import Twin
from toolkit.router.server import Router

STEPS, WARMUP = 3, 1
"""Steps per arm, of which the first warms up (a job's first sessions teach the budget their size)."""
CROWD = ("sessions_per_step=8192",)
"""(a): the default workload (three turns) and fleet, 8,192 sessions a step."""
CAPS = (768, 1024, 1280, 1536, 2048)
AFFINITIES = ("spill", "wait")
KV_AWARE = ("router.policy=kv_aware", "router.affinity=wait")
"""The recommended setting: turns wait for the replica holding their prefix rather than spill."""
CHURN = (f"sessions_per_step={SESSIONS}", "workload.max_tokens=2048", "seed=7")
"""(b): the tail bench's headline workload on the default fleet (``tail.policy=age`` moves sessions)."""
ORACLE = ("router.policy=kv_aware", "router.affinity=wait", "router.load_factor=1000", "router.kv_budget=1.0")
"""Every turn to wherever its longest prefix is cached, waiting for it there, whatever the load."""
FILLER = 2000
"""Blocks of other work each replica holds in the decision bench's index."""
RESTART_AT, ADD_AT = 0.3, 0.5
"""When, as a share of the warm-up step's time after the measured steps begin, a throughput replica is
restarted (lost, and back empty at once) and one is added."""


def _config(overrides: list[str]) -> Config:
    cfg = compose_config(overrides)
    validate(cfg)
    return cfg


def arm(overrides: tuple[str, ...], steps: int = STEPS, events: Any = None) -> dict[str, Any]:
    """Mean step time and prefix hit rate over the steps after the warm-up, and each step's."""
    cfg = _config([*overrides, f"steps={steps}"])
    run = Twin(cfg, events=events(cfg) if events else None).run()
    measured = run.steps[WARMUP:]
    times = [s["wall_s"] for s in measured]
    hits = [s["prefix_hit_rate"] for s in measured]
    return {"step_s": round(statistics.fmean(times), 3), "prefix_hit": round(statistics.fmean(hits), 4),
            "steps_s": [round(t, 3) for t in times], "steps_hit": [round(h, 4) for h in hits],
            "twin_real_s": round(run.real_s, 1)}


def churn_events(warmup_s: float) -> Any:
    """A throughput replica restarted and one added, mid-way through the first measured step."""

    def make(cfg: Config) -> Any:
        def schedule(twin: Twin) -> None:
            loop = twin.loop

            def restart() -> None:
                old = next(r for r in twin.replicas if r.group == "throughput" and r.alive)
                old.die()
                new = TwinReplica(cfg, old.group, int(old.replica_id.split("-")[1].split("@")[0]),
                                  group_engine(cfg, old.group), twin.wire, twin.plan)
                twin.replicas.append(new)
                new.start()  # the same id registers again, empty: the router drops the old one

            def add() -> None:
                n = sum(r.group == "throughput" for r in twin.replicas)
                new = TwinReplica(cfg, "throughput", n + 10, group_engine(cfg, "throughput"), twin.wire, twin.plan)
                twin.replicas.append(new)
                new.start()

            loop.call_at(warmup_s * (1 + RESTART_AT), restart)
            loop.call_at(warmup_s * (1 + ADD_AT), add)

        return schedule

    return make


def events_ratio(n: int, window: int, replicas: int, rounds: int, prompts: str) -> dict[str, Any]:
    """``bench router``'s throughput (instant replicas, a client keeping ``window`` requests out) of each
    router of :data:`EVENT_ARMS`, its replicas sending their prefix caches' events with each Result where
    it has them (and taking them either way), its client sending each prompt's block hashes where the
    router asks for them; ``prompts`` as ``bench router``'s ``prompt_of``. Rounds rotate the order; per arm its
    best requests/s, and the median of its per-round ratios to ``no_events`` (events on vs off) and to
    ``consistent_hash`` (the whole feature)."""
    mpc = mp.get_context("spawn")
    rates: dict[str, list[float]] = {a: [] for a in EVENT_ARMS}
    cpu: dict[str, list[float]] = {a: [] for a in EVENT_ARMS}
    with tempfile.TemporaryDirectory(prefix="bench-kv-events-") as tmp:
        stacks, procs = {}, []
        try:
            for name, (policy, block) in EVENT_ARMS.items():
                cfg = bench_config(replicas, max(1, 2 * window // replicas), policy, metrics=False)
                stack = stacks[name] = LocalStack(cfg, Path(tmp) / name)  # stopped below whatever fails next
                stack.start_router()
                backend = stack.run_dir.wait_router_address(10)["backend"]
                procs.append(mpc.Process(target=instant_replicas, daemon=True,
                                         args=(backend, replicas, "bench", cfg.groups["bench"].max_inflight, 0.5,
                                               block, KV_BLOCK)))
                procs[-1].start()
                stack.wait_ready(30)
            names = list(EVENT_ARMS)
            for name in names:
                _run_client(stacks[name].frontend, min(n, 2000), window, prompts, EVENT_ARMS[name][1])  # warm each
            for k in range(rounds):
                for name in names[k % 3:] + names[: k % 3]:
                    router = stacks[name].procs[0].pid
                    before = cpu_seconds(router) or 0.0
                    rates[name].append(_run_client(stacks[name].frontend, n, window, prompts, EVENT_ARMS[name][1]))
                    cpu[name].append(((cpu_seconds(router) or 0.0) - before) / n * 1e6)
        finally:
            for p in procs:
                p.terminate()
                p.join(5)
            for stack in stacks.values():
                stack.stop()

    def median_ratio(a: str, b: str) -> float:
        paired = sorted(x / y for x, y in zip(rates[a], rates[b], strict=True))
        return round(paired[len(paired) // 2], 4)

    us = {a: statistics.median(c) for a, c in cpu.items()}
    return {"rps": {a: round(max(r), 1) for a, r in rates.items()},
            "ratio_events_on": median_ratio("events", "no_events"),
            "ratio_vs_consistent_hash": median_ratio("events", "consistent_hash"),
            "router_cpu_us_per_request": {a: round(v, 2) for a, v in us.items()},
            "cpu_ratio_events_on": round(us["no_events"] / us["events"], 4),
            "cpu_ratio_vs_consistent_hash": round(us["consistent_hash"] / us["events"], 4),
            "rounds": rounds, "prompts": prompts}


def _indexed(router: Router, rng: random.Random) -> dict[int, list[int]]:
    """``kv_aware``'s index as a busy fleet's: each session's context (512 tokens) cached on 1 to 3
    replicas, and each replica holding :data:`FILLER` blocks of other work. Returns the contexts."""
    index = router.kv.index
    assert index is not None
    reps = list(router.pool.all())
    held: dict[int, list[int]] = {r.kv_slot: [rng.getrandbits(63) for _ in range(FILLER)] for r in reps}
    contexts = {}
    for sid in range(rb.SESSIONS):
        ctx = [rng.randrange(1, 30000) for _ in range(512)]
        contexts[sid] = ctx + [7] * 16
        hashes = block_hashes(ctx, KV_BLOCK)
        for r in rng.sample(reps, rng.randint(1, 3)):
            held[r.kv_slot].extend(hashes[: rng.randint(1, len(hashes))])
    for r in reps:
        index.snapshot(r, P.KvSnapshot(0, held[r.kv_slot]))
    return contexts


def run(quick: bool = False) -> dict[str, Any]:
    crowd = CROWD if not quick else ("sessions_per_step=512", "engine.kv_cache_tokens=25000")
    caps = CAPS if not quick else (64, 128)
    steps = STEPS if not quick else 2
    a: dict[str, Any] = {"consistent_hash": arm(crowd, steps)}
    sweep = {f"cap={c},affinity={aff}": arm((*crowd, f"rollout.max_concurrent_rollouts={c}", f"router.affinity={aff}"),
                                            steps)
             for c in caps for aff in AFFINITIES}
    best = min(sweep, key=lambda k: sweep[k]["step_s"])
    a["best_cap"] = {**sweep[best], "setting": best}
    a["kv_aware"] = arm((*crowd, *KV_AWARE), steps)
    a["kv_aware_spill"] = arm((*crowd, "router.policy=kv_aware"), steps)

    churn = CHURN if not quick else ("sessions_per_step=32", "workload.max_tokens=512", "seed=7")
    first = Twin(_config([*churn, "steps=1"])).run().steps[0]["wall_s"]
    events = churn_events(first)
    b = {"churn_consistent_hash": arm(churn, steps, events),
         "churn_kv_aware": arm((*churn, *KV_AWARE), steps, events),
         "churn_oracle": arm((*churn, *ORACLE), steps, events)}
    p50, p99 = decision_cost(replicas=512, samples=2000 if quick else 20000, queued=5000 if quick else 50000,
                             policy="kv_aware", setup=_indexed)
    thr = {prompts: events_ratio(n=3000 if quick else 20000, window=1024, replicas=4, rounds=1 if quick else 7,
                                 prompts=prompts) for prompts in (("turns",) if quick else ("turns", "distinct", "same"))}
    alone = cpu_ratio(n=3000 if quick else 20000, rounds=1 if quick else 7, prompts="turns")
    arms = {**a, **b}
    return {
        "arms": arms,
        "cap_sweep": sweep,
        "ratio_step_vs_best_cap": round(arms["kv_aware"]["step_s"] / arms["best_cap"]["step_s"], 4),
        "hit_gap_vs_oracle": round(arms["churn_oracle"]["prefix_hit"] - arms["churn_kv_aware"]["prefix_hit"], 4),
        "decision_us_p50": round(p50, 2),
        "decision_us_p99": round(p99, 2),
        "router_throughput_ratio_events_on": thr["turns"]["ratio_events_on"],
        "router_throughput": thr,
        "router_cpu_in_process": alone,
        "steps_per_arm": steps,
        "warmup_steps": WARMUP,
        "kv_aware_setting": " ".join(KV_AWARE),
        "oracle_setting": " ".join(ORACLE),
    }
