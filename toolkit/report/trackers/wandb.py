"""Weights & Biases: one W&B run per toolkit run (resumed runs continue it), files under
``<run dir>/trackers/``. ``report.wandb_mode=offline`` needs no network (``wandb sync`` uploads later)."""

from __future__ import annotations

import hashlib
from typing import Any

import wandb

from toolkit.core.rundir import RunDir
from toolkit.report.trackers import Tracker


class WandbTracker(Tracker):
    def __init__(self, run_dir: RunDir, config: dict[str, Any], options: dict[str, Any]) -> None:
        directory = run_dir.trackers
        directory.mkdir(parents=True, exist_ok=True)
        # The same id for every launch of one run dir: a resumed run continues its W&B run.
        run_id = hashlib.blake2b(str(run_dir.root.resolve()).encode(), digest_size=8).hexdigest()
        self.run = wandb.init(project=options.get("project") or "rollout-toolkit", dir=str(directory),
                              mode=options.get("mode"), id=run_id, resume="allow", name=run_dir.root.name,
                              config=config, settings=wandb.Settings(console="off", silent=True))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


def open_tracker(run_dir: RunDir, config: dict[str, Any], options: dict[str, Any]) -> Tracker:
    return WandbTracker(run_dir, config, {"project": options.get("wandb_project"), "mode": options.get("wandb_mode")})
