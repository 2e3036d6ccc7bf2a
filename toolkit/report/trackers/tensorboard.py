"""TensorBoard: an event file under ``<run dir>/trackers/tensorboard`` (``tensorboard --logdir`` on it),
written with tensorboardX (no TensorFlow or torch needed); the config as text at step 0."""

from __future__ import annotations

import json
from typing import Any

from tensorboardX import SummaryWriter

from toolkit.core.rundir import RunDir
from toolkit.report.trackers import Tracker


class TensorBoardTracker(Tracker):
    def __init__(self, run_dir: RunDir, config: dict[str, Any]) -> None:
        self.writer = SummaryWriter(logdir=str(run_dir.trackers / "tensorboard"))
        self.writer.add_text("config", "```\n" + json.dumps(config, indent=1, default=str) + "\n```", 0)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def open_tracker(run_dir: RunDir, config: dict[str, Any], options: dict[str, Any]) -> Tracker:
    return TensorBoardTracker(run_dir, config)
