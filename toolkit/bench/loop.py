"""``python -m toolkit.bench loop``: the RL loop, strictly on-policy (``rollout.max_staleness=0``) against
one step of overlap (``=1``), with sim engines and a trainer stand-in whose step takes as long as a
rollout step.

The stand-in runs the trainer handshake: ``wait_step``, "train", ``publish``. A third arm has updates
land mid-step. Method and fields: docs/benchmarks.md#loop.
"""

from __future__ import annotations

import json
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from toolkit.config import compose_config
from toolkit.core.rundir import RunDir, read_json
from toolkit.launch.app import run as launch_run
from toolkit.launch.validation import validate
from toolkit.samples import read_step, wait_step
from toolkit.weights import publish


def _rollout(overrides: list[str], run: Path) -> None:
    cfg = compose_config(overrides)
    validate(cfg)
    launch_run(cfg, RunDir(run), Console(quiet=True))


class TrainerStandIn(threading.Thread):
    """Waits for each step, "trains" for ``train_s``, publishes the next step's weights."""

    def __init__(self, run: Path, weights: Path, source: Path, steps: int, train_s: float) -> None:
        super().__init__(name="trainer", daemon=True)
        self.run_dir, self.weights, self.source = run, weights, source
        self.steps, self.train_s = steps, train_s
        self.available: list[float] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for step in range(self.steps):
                wait_step(self.run_dir, step, timeout_s=600, poll_s=0.02)
                self.available.append(time.monotonic())
                time.sleep(self.train_s)
                publish(self.weights, step + 1, self.source)
        except BaseException as exc:  # reported by the arm
            self.error = exc


def _arm(root: Path, name: str, base: list[str], k: int, steps: int, train_s: float, source: Path) -> dict[str, Any]:
    run, weights = root / name, root / f"{name}-weights"
    weights.mkdir()
    trainer = TrainerStandIn(run, weights, source, steps, train_s)
    trainer.start()
    _rollout([*base, f"steps={steps}", f"rollout.weights_dir={weights}", f"rollout.max_staleness={k}",
              f"hydra.run.dir={run}"], run)
    trainer.join(timeout=120)
    if trainer.error is not None:
        raise trainer.error
    if trainer.is_alive() or len(trainer.available) != steps:
        raise RuntimeError(f"the trainer stand-in saw {len(trainer.available)} of {steps} steps of {run}")
    rd = RunDir(run)
    stale, aborted, waited, mid_step = [], 0, [], 0
    for step in range(steps):
        rows = read_step(run, step, columns=["weight_versions"]).to_pylist()
        stale += [step - min(r["weight_versions"]) for r in rows]
        rep = read_json(rd.step_report(step)) or {}
        aborted += sum(n for s, n in rep.get("requests_by_status", {}).items() if s != "ok")
        waited.append(rep["weights"]["waited_s"])
        mid_step += len(rep["weights"]["updates"])
    stats = read_json(rd.router_stats) or {}
    aborted += sum(int(v) for key, v in stats.items() if key == "requeued" or key.startswith("migrated"))
    span = trainer.available[-1] - trainer.available[0]
    return {"steps_per_s": (steps - 1) / span if span > 0 else None, "aborted_requests": aborted,
            "mean_staleness": sum(stale) / len(stale) if stale else None,
            "mean_weights_wait_s": sum(waited) / len(waited), "updates_mid_step": mid_step}


def run(quick: bool = False) -> dict[str, Any]:
    steps = 4 if quick else 10
    # Tail routing off: its moves abort and continue requests too, which would hide what this counts
    # (requests the weight updates aborted).
    base = [f"engine.time_scale={0.2 if quick else 0.5}", "sessions_per_step=32", "rollout.update_mode=pause",
            "tail.policy=count"]
    with tempfile.TemporaryDirectory(prefix="bench-loop-") as tmp:
        root = Path(tmp)
        source = root / "checkpoint"  # the sim loads any directory: a stand-in checkpoint
        source.mkdir()
        (source / "config.json").write_text(json.dumps({"model_type": "sim"}))
        # The rollout's own step time, without weights: the stand-in trains exactly as long.
        warm = root / "warmup"
        _rollout([*base, "steps=3", f"hydra.run.dir={warm}"], warm)
        walls = [read_json(warm / "steps" / f"step_{s:05d}.json")["wall_s"] for s in (1, 2)]
        train_s = sum(walls) / len(walls)
        sync = _arm(root, "sync", base, 0, steps, train_s, source)
        asyn = _arm(root, "async", base, 1, steps, train_s, source)
        # With equal times each update lands about as the step ends; a trainer twice as fast publishes
        # in the middle of every step: the in-place updates (update_mode=pause) with requests running.
        mid = _arm(root, "async-mid", base, 1, steps, train_s / 2, source)
    ratio = (asyn["steps_per_s"] / sync["steps_per_s"]) if sync["steps_per_s"] and asyn["steps_per_s"] else None
    return {
        "steps": steps,
        "rollout_step_s": round(train_s, 3),
        "train_step_s": round(train_s, 3),
        "steps_per_s_sync": sync["steps_per_s"],
        "steps_per_s_async": asyn["steps_per_s"],
        "ratio": ratio,
        "aborted_requests": sync["aborted_requests"] + asyn["aborted_requests"] + mid["aborted_requests"],
        "mean_staleness": {"sync": sync["mean_staleness"], "async": asyn["mean_staleness"]},
        # Where the time goes: a step's wait for its weights, and the updates that landed mid-step.
        "mean_weights_wait_s": {"sync": sync["mean_weights_wait_s"], "async": asyn["mean_weights_wait_s"]},
        "updates_mid_step": {"sync": sync["updates_mid_step"], "async": asyn["updates_mid_step"]},
        "async_mid_step": {"train_step_s": round(train_s / 2, 3), **mid},
        "target": {"ratio": ">= 1.6", "aborted_requests": 0},
    }
