"""``python -m toolkit.bench partial``: steps that close on a count against steps that wait for their
slowest session, on the tail bench's workload and fleet (sim engines).

Arms, interleaved in rounds (every arm once per round): ``off`` (close=all, no tail policy), ``tail``
(close=all, ``age`` with moves that recompute), ``partial`` (close=count, over_sample 0.25,
max_staleness 1), ``partial+tail``, ``partial+updates`` (partial, with the loop bench's trainer
stand-in publishing a version every step), ``partial+affinity`` (partial with ``router.affinity=wait``).
Also ``filter``: zero-variance filtering on GRPO groups of 8 with a reward whose all-equal share is
known. Method and fields: docs/benchmarks.md#partial.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
from rich.console import Console

from toolkit.bench.loop import TrainerStandIn
from toolkit.bench.tail_arms import ARMS as TAIL_ARMS
from toolkit.bench.tail_arms import SESSIONS
from toolkit.config import Config, compose_config, group_engine
from toolkit.core.rundir import RunDir
from toolkit.launch.app import run as launch_run
from toolkit.launch.validation import validate
from toolkit.rollout.bound import SimCosts
from toolkit.rollout.envs import EnvStep, ToolCallEnv
from toolkit.rollout.prompts import Prompt

WARMUP_STEPS = 2
PARTIAL = ("rollout.close=count", "rollout.over_sample=0.25", "rollout.max_staleness=1")
ARMS: dict[str, tuple[str, ...]] = {
    "off": TAIL_ARMS["off"],
    "tail": TAIL_ARMS["age"],
    "partial": (*TAIL_ARMS["off"], *PARTIAL),
    "partial+tail": (*TAIL_ARMS["age"], *PARTIAL),
    "partial+updates": (*TAIL_ARMS["off"], *PARTIAL),
    "partial+affinity": (*TAIL_ARMS["off"], *PARTIAL, "router.affinity=wait"),
}
"""Each arm's settings; ``partial+updates`` also gets a ``weights_dir`` its trainer stand-in publishes to.
``partial+affinity``: a design for the throughput bound (a session's turn waits for its own replica)."""
FILTER_SPP = 8
FILTER_EQUAL_EVERY = 4
"""``filter``: every 4th GRPO group's rewards are all equal (a known 25% share)."""


def _launch(overrides: list[str], run: Path) -> None:
    cfg = compose_config([*overrides, f"hydra.run.dir={run}"])
    validate(cfg)
    launch_run(cfg, RunDir(run), Console(quiet=True))


def _with_trainer(overrides: list[str], run: Path, steps: int, train_s: float) -> None:
    weights, source = run.with_name(run.name + "-weights"), run.with_name(run.name + "-checkpoint")
    weights.mkdir()
    source.mkdir()
    (source / "config.json").write_text(json.dumps({"model_type": "sim"}))  # the sim loads any directory
    trainer = TrainerStandIn(run, weights, source, steps, train_s)
    trainer.start()
    _launch([*overrides, f"rollout.weights_dir={weights}"], run)
    trainer.join(timeout=120)
    if trainer.error is not None:
        raise trainer.error


def _read(run: Path, steps: int) -> dict[str, Any]:
    """One launch: its steps' reports and the columns the bench reads of their rows."""
    reports = [json.loads((run / "steps" / f"step_{s:05d}.json").read_text()) for s in range(steps)]
    rows = [pq.read_table(run / "steps" / f"step_{s:05d}.parquet",
                          columns=["session_id", "status", "generated_tokens", "staleness"]).to_pylist()
            for s in range(steps)]
    return {"reports": reports, "rows": rows}


def _books(run: dict[str, Any]) -> dict[str, int]:
    """Over the whole launch: tokens the engines answered its sessions with, against what its rows hold,
    what it discarded and what was still running at its end (``tokens_lost`` must be 0), and session
    ids in more than one row."""
    reports, rows = run["reports"], run["rows"]
    engines = sum(r["generated_tokens"] for r in reports)
    landed = sum(x["generated_tokens"] for step in rows for x in step if x["status"] != "stale")
    discarded = sum(r.get("tokens_discarded", 0) for r in reports)
    in_flight = reports[-1].get("tokens_in_flight", 0)
    ids = Counter(x["session_id"] for step in rows for x in step)
    return {"tokens_lost": engines - landed - discarded - in_flight, "tokens_discarded": discarded,
            "sessions_twice": sum(n > 1 for n in ids.values())}


def _per_step(run: dict[str, Any], warmup: int = WARMUP_STEPS) -> list[dict[str, Any]]:
    """Counted steps: sessions landed (not stale, not filtered), seconds since the previous step ended
    (the gap between steps counts), the throughput bound's seconds, busy and replica seconds."""
    reports, rows = run["reports"], run["rows"]
    out = []
    for s in range(warmup, len(reports)):
        rep, prev = reports[s], reports[s - 1]
        now, before = rep["fleet_time"] or {}, prev["fleet_time"] or {}
        fleet = {g: {k: v - before.get(g, {}).get(k, 0) for k, v in counts.items()} for g, counts in now.items()}
        landed = [x for x in rows[s] if x["status"] in ("completed", "truncated", "failed")]
        out.append({
            "samples": len(landed),
            "landed_tokens": sum(x["generated_tokens"] for x in landed),
            "generated_tokens": rep["generated_tokens"],
            "seconds": rep["ended_at"] - prev["ended_at"],
            "bound_s": (rep.get("bound") or {}).get("throughput_at_max_inflight_s") or 0.0,
            "placed_s": (rep.get("bound") or {}).get("at_max_inflight_as_placed_replica_s") or 0.0,
            "busy_s": sum(g["busy_s"] for g in fleet.values()), "replica_s": sum(g["replica_s"] for g in fleet.values()),
            "fleet": fleet,
            "staleness": [x["staleness"] for x in rows[s] if x["status"] != "stale"],
        })
    return out


def _pace(steps_: list[dict[str, Any]], cfg: Config) -> dict[str, float] | None:
    """Where the fleet's replica-seconds went over the counted steps, as shares that sum to 1: ``idle``
    (no request on the engine), ``behind_model`` (the engine had work but fell behind its own time
    model's schedule: a CPU it shares), ``underfull_batches`` (the fixed cost of steps with fewer
    sequences than ``max_inflight``), ``prefill`` (every prompt token computed), ``placement`` (the
    requests at peak on the groups they ran on, less the bound's best split of them between groups),
    ``aborted`` (tokens decoded for requests no step logged: aborted mid-turn by a stale drop, at the
    bound's cost per token), ``at_peak`` (the throughput bound's replica-seconds for the tokens the
    steps logged) and ``other`` (what is left, less the prefill the bound also counts). ``1 / at_peak`` is about ``fleet_bound_ratio``. None without the sim's counters."""
    costs = {g: SimCosts(group_engine(cfg, g), cfg.groups[g].max_inflight) for g in cfg.groups}
    replicas = sum(cfg.groups[g].replicas for g in cfg.groups)
    t: dict[str, float] = defaultdict(float)
    for s in steps_:
        for g, f in s["fleet"].items():
            c = costs.get(g)
            if c is None:
                continue
            t["replica_s"] += f["replica_s"]
            t["active_s"] += f["active_s"]
            t["model_s"] += f["model_s"]
            t["underfull_batches"] += f["engine_steps"] * c.step - f["generated_tokens"] * c.step / c.inflight
            t["prefill"] += f["prefill_tokens"] * c.prefill
        t["at_peak"] += s["bound_s"] * replicas
        t["engine_tokens"] += sum(f["generated_tokens"] for g, f in s["fleet"].items() if g in costs)
        t["logged_tokens"] += s["generated_tokens"]
        t["placement"] += s["placed_s"] - s["bound_s"] * replicas if s["placed_s"] else 0.0
    seen = t["replica_s"]
    if seen <= 0 or t["model_s"] <= 0:
        return None
    # Tokens the engines decoded for requests no step logged (aborted mid-turn: a stale drop stops its
    # session's running request), at the bound's cost per logged token.
    t["aborted"] = t["at_peak"] * max(0.0, t["engine_tokens"] - t["logged_tokens"]) / max(1.0, t["logged_tokens"])
    split = {"idle": (seen - t["active_s"]) / seen, "behind_model": (t["active_s"] - t["model_s"]) / seen,
             **{k: t[k] / seen for k in ("underfull_batches", "prefill", "placement", "aborted", "at_peak")}}
    split["other"] = 1 - sum(split.values())
    return {k: round(v, 4) for k, v in split.items()}


def _ci95(arm: np.ndarray, off: np.ndarray, resamples: int = 4000) -> list[float]:
    """Paired bootstrap over steps of (arm samples/s) / (off samples/s); columns: samples, seconds."""
    idx = np.random.default_rng(0).integers(0, min(len(arm), len(off)), size=(resamples, min(len(arm), len(off))))
    a, o = arm[idx], off[idx]
    ratio = (a[..., 0].sum(-1) / a[..., 1].sum(-1)) / (o[..., 0].sum(-1) / o[..., 1].sum(-1))
    lo, hi = np.percentile(ratio, [2.5, 97.5])
    return [round(float(lo), 4), round(float(hi), 4)]


def _filter_run(root: Path, base: list[str], steps: int, sessions: int, warmup: int) -> dict[str, Any]:
    run = root / "filter"
    spp = FILTER_SPP
    _launch([*base, *ARMS["partial"], f"steps={steps}", f"sessions_per_step={sessions}",
             "rollout.filter_groups=zero_variance",
             "workload.env._target_=toolkit.bench.partial.GroupRewards",
             f"+workload.prompts.samples_per_prompt={spp}", f"+workload.env.samples_per_prompt={spp}",
             f"+workload.env.equal_every={FILTER_EQUAL_EVERY}"], run)
    got = _read(run, steps)
    reports = got["reports"][warmup:]
    starts = sum(r["group_starts"] for r in reports)
    useful = sum(sum(x["status"] == "completed" for x in step) for step in got["rows"][warmup:]) / spp
    return {"samples_per_prompt": spp, "zero_variance_share": 1 / FILTER_EQUAL_EVERY,
            "group_starts": starts, "useful_groups": useful, "filtered_groups": sum(r["filtered_groups"] for r in reports),
            "starts_per_useful_group": round(starts / useful, 3) if useful else None,
            "expected_starts_per_useful_group": round(1 / (1 - 1 / FILTER_EQUAL_EVERY), 3),
            "closed_short": sum(r["closed_short"] for r in reports), **_books(got)}


def run(quick: bool = False) -> dict[str, Any]:
    sessions = 16 if quick else SESSIONS
    rounds, per_round = (1, 2) if quick else (2, 6)
    warmup = 1 if quick else WARMUP_STEPS  # a smoke run: one step of first use is enough
    steps = warmup + per_round
    base = [f"sessions_per_step={sessions}", f"engine.time_scale={0.1 if quick else 1.0}",
            "workload.max_tokens=2048", "seed=7"]
    measured: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    books: dict[str, Counter[str]] = {arm: Counter() for arm in ARMS}
    with tempfile.TemporaryDirectory(prefix="bench-partial-") as tmp:
        root = Path(tmp)
        train_s = 0.0
        for r in range(rounds):
            for arm, settings in ARMS.items():
                run_dir = root / f"{arm.replace('+', '_')}-{r}"
                overrides = [*base, *settings, f"steps={steps}"]
                if arm == "partial+updates":
                    _with_trainer(overrides, run_dir, steps, train_s)
                else:
                    _launch(overrides, run_dir)
                got = _read(run_dir, steps)
                measured[arm] += _per_step(got, warmup)
                books[arm].update(_books(got))
                if arm == "partial" and not train_s:
                    # The trainer stand-in trains as long as a partial step takes: an update each step.
                    train_s = float(np.mean([s["seconds"] for s in measured["partial"]]))
        filtered = _filter_run(root, base, steps, sessions, warmup)
    table = {arm: np.array([[s["samples"], s["seconds"]] for s in steps_]) for arm, steps_ in measured.items()}
    off_rate = table["off"][:, 0].sum() / table["off"][:, 1].sum()
    arms: dict[str, Any] = {}
    for arm, steps_ in measured.items():
        rate = table[arm][:, 0].sum() / table[arm][:, 1].sum()
        # The fleet's time at its peak for the tokens the arm generated, scaled to those its landed
        # samples hold (tokens it discarded or carried past the window count against it).
        landed_share = sum(s["landed_tokens"] for s in steps_) / max(1, sum(s["generated_tokens"] for s in steps_))
        fleet_s = sum(s["bound_s"] for s in steps_)
        bound_s = fleet_s * landed_share
        stale = [x for s in steps_ for x in s["staleness"]]
        arms[arm] = {
            "samples_per_s": round(float(rate), 3),
            "ratio_vs_off": round(float(rate / off_rate), 4),
            "ci95": _ci95(table[arm], table["off"]),
            "staleness_mean": round(float(np.mean(stale)), 4) if stale else None,
            "staleness_max": int(max(stale)) if stale else None,
            "tokens_discarded": books[arm]["tokens_discarded"],
            "tokens_lost": books[arm]["tokens_lost"],
            "sessions_in_two_steps": books[arm]["sessions_twice"],
            "fleet_busy": round(sum(s["busy_s"] for s in steps_) / max(1e-9, sum(s["replica_s"] for s in steps_)), 4),
            # Samples/s at the fleet's peak (every replica's batch at its max_inflight, the sim's model,
            # on the tokens of the samples it landed) over the arm's samples/s.
            "throughput_bound_ratio": round(float(table[arm][:, 1].sum() / bound_s), 4) if bound_s else None,
            # Its two factors: the fleet's pace against its peak on every token generated, and the
            # share of those tokens its landed samples hold.
            "fleet_bound_ratio": round(float(table[arm][:, 1].sum() / fleet_s), 4) if fleet_s else None,
            "landed_token_share": round(landed_share, 4),
            # Decoded by the engines (the sim's counts) for requests no step logged: aborted mid-turn.
            "tokens_aborted": int(sum(sum(f["generated_tokens"] for f in s["fleet"].values()) - s["generated_tokens"]
                                      for s in steps_)),
            # The fleet's pace taken apart: where its replica-seconds went.
            "fleet_time": _pace(steps_, compose_config([*base, *ARMS[arm]])),
            "mean_step_s": round(float(table[arm][:, 1].mean()), 3),
        }
    partial_arms = [a for a in arms if a.startswith("partial")]
    best = max(partial_arms, key=lambda a: arms[a]["samples_per_s"])
    return {
        "arms": arms,
        "best_partial": best,
        "filter": filtered,
        "sessions_per_step": sessions,
        "steps_per_arm": rounds * per_round,
        "warmup_steps_per_launch": warmup,
        "rounds": rounds,
        "train_step_s": round(train_s, 3),
        "target": {"best_partial_ratio_vs_off": ">= 2.0", "ci95_low": "> 1.7", "throughput_bound_ratio": "<= 1.25",
                   "staleness_max": "<= 1", "tokens_lost": 0},
    }


class GroupRewards(ToolCallEnv):
    """The multi-turn tool task with a reward per GRPO group (``filter``): one group in ``equal_every``,
    drawn by a hash of its step and number (so no rank gets more of them), gets 1.0 on every member
    (zero variance), the others the member's parity; ``equal_every=0``: the task's own reward."""

    def __init__(self, samples_per_prompt: int = 1, equal_every: int = 0, **kw: int) -> None:
        super().__init__(**kw)
        self.samples_per_prompt, self.equal_every = samples_per_prompt, equal_every
        self.index = self.step_of = 0

    def reset(self, prompt: Prompt) -> list[int]:
        self.index = int(prompt.metadata["index"])
        self.step_of = int(prompt.metadata["step"])
        return super().reset(prompt)

    def step(self, generated: list[int], finish_reason: str) -> EnvStep:
        out = super().step(generated, finish_reason)
        if self.equal_every:
            equal = all_equal(self.step_of, self.index // self.samples_per_prompt, self.equal_every)
            out.reward = 0.0 if not out.done else (1.0 if equal else float(self.index % 2))
        return out


def all_equal(step: int, group: int, every: int) -> bool:
    """Whether group ``group`` of ``step`` is one of :class:`GroupRewards`' all-equal ones (1 in ``every``)."""
    key = f"{step}/{group}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=4).digest(), "little") % every == 0
