"""Experiment trackers: every step report, flattened, logged with the tracker's own library.

``report.trackers=[wandb, tensorboard]``: ``launch`` opens one :class:`Tracker` per name when the run
starts (the run's config attached once) and logs each step report as the ranks write it, keyed by its
step. A name whose library is missing is a setup error naming the package to install
(:data:`PACKAGES`, checked in ``toolkit/validation.py``). One module per tracker; a new one is a
module and an entry in :data:`TRACKERS`.
"""

from __future__ import annotations

import importlib
import logging
import math
import threading
from abc import ABC, abstractmethod
from typing import Any

from toolkit.rundir import RunDir

logger = logging.getLogger(__name__)

PACKAGES = {"wandb": ("wandb", "wandb"), "tensorboard": ("tensorboardX", "tensorboardX tensorboard")}
"""Tracker name -> (module it imports, what to pip install)."""


class Tracker(ABC):
    @abstractmethod
    def log(self, step: int, metrics: dict[str, float]) -> None:
        """One step's figures."""

    @abstractmethod
    def close(self) -> None:
        """Flush and finish (the run's files complete on disk)."""


def flatten(report: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The numbers of a step report under dotted keys (``bound.critical_path_s``,
    ``groups.tail.requests``); text, lists and missing values are left out."""
    out: dict[str, float] = {}
    for key, value in report.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, f"{name}."))
        elif isinstance(value, bool):
            out[name] = float(value)
        elif isinstance(value, int | float) and math.isfinite(value):
            out[name] = float(value)
    return out


def _make(name: str, run_dir: RunDir, config: dict[str, Any], options: dict[str, Any]) -> Tracker:
    module = importlib.import_module(f"toolkit.trackers.{name}")
    tracker: Tracker = module.open_tracker(run_dir, config, options)
    return tracker


CLOSE_TIMEOUT_S = 60.0


class Trackers:
    """The run's trackers; a tracker that fails to log is reported once and dropped, never the run."""

    def __init__(self, names: list[str], run_dir: RunDir, config: dict[str, Any], options: dict[str, Any]) -> None:
        self.trackers: dict[str, Tracker] = {}
        try:
            for name in names:
                self.trackers[name] = _make(name, run_dir, config, options)
        except BaseException:
            self.close()
            raise

    def log(self, report: dict[str, Any]) -> None:
        metrics = flatten({k: v for k, v in report.items() if k != "step"})
        for name, tracker in list(self.trackers.items()):
            try:
                tracker.log(int(report["step"]), metrics)
            except Exception as exc:  # a tracker's own failure (disk, service) must not end the rollout
                logger.error("tracker %s failed to log step %s (%r); it logs nothing more", name, report["step"], exc)
                self.trackers.pop(name)

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Each tracker's close, bounded by ``timeout_s`` (a stalled upload must not hold the launch's
        exit, nor a requeue in the grace Slurm gave it): one still closing then is left to its thread."""
        for name, tracker in self.trackers.items():
            done = threading.Event()

            def close(tracker: Tracker = tracker, name: str = name, done: threading.Event = done) -> None:
                try:
                    tracker.close()
                except Exception as exc:
                    logger.error("tracker %s failed to close: %r", name, exc)
                finally:
                    done.set()

            threading.Thread(target=close, name=f"close-{name}", daemon=True).start()
            if not done.wait(timeout_s):
                logger.error("tracker %s did not close within %.0fs; leaving it", name, timeout_s)
        self.trackers = {}
