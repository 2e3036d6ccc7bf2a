"""Experiment trackers: every step report, flattened, logged with the tracker's own library.

``report.trackers=[wandb, tensorboard]``: ``launch`` opens one :class:`Tracker` per name when the run
starts (the run's config attached once) and logs each step report as the ranks write it, keyed by its
step. A name whose library is missing is a setup error naming the package to install
(:data:`PACKAGES`, checked in ``toolkit/launch/validation.py``). One module per tracker; a new one is a
module and an entry in :data:`TRACKERS`.
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import threading
from abc import ABC, abstractmethod
from typing import Any

from toolkit.core.rundir import RunDir, atomic_write, read_json

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
    module = importlib.import_module(f"toolkit.report.trackers.{name}")
    tracker: Tracker = module.open_tracker(run_dir, config, options)
    return tracker


CLOSE_TIMEOUT_S = 60.0


class Trackers:
    """The run's trackers; a tracker that fails to open or to log is reported once and dropped, never the run.
    Each one's last logged step is kept in the run dir, so a resumed run logs exactly the steps its
    previous launch did not (it may have ended between a step's report and its next look at them)."""

    def __init__(self, names: list[str], run_dir: RunDir, config: dict[str, Any], options: dict[str, Any]) -> None:
        self.run_dir = run_dir
        self.trackers: dict[str, Tracker] = {}
        self.logged: dict[str, int] = read_json(run_dir.trackers_logged) or {}
        try:
            for name in names:
                try:
                    self.trackers[name] = _make(name, run_dir, config, options)
                except Exception as exc:  # (no login, no network on a compute node...): the run goes on
                    logger.error("tracker %s could not open, so this run logs nothing to it: %s: %s (W&B "
                                 "without a login or network: report.wandb_mode=offline)", name,
                                 type(exc).__name__, exc)
        except BaseException:
            self.close()
            raise

    def catch_up(self, reports: list[dict[str, Any]]) -> None:
        """A resumed run: log the earlier launches' steps that no tracker got (in step order)."""
        for report in sorted(reports, key=lambda r: int(r["step"])):
            self.log(report)

    def log(self, report: dict[str, Any]) -> None:
        step = int(report["step"])
        metrics = flatten({k: v for k, v in report.items() if k != "step"})
        for name, tracker in list(self.trackers.items()):
            if step <= self.logged.get(name, -1):
                continue  # an earlier launch of this run logged it
            try:
                tracker.log(step, metrics)
            except Exception as exc:  # a tracker's own failure (disk, service) must not end the rollout
                logger.error("tracker %s failed to log step %s (%r); it logs nothing more", name, step, exc)
                self.trackers.pop(name)
                continue
            # Recorded as each logs, not once all have: a launch stopped inside the next one's ``log``
            # (its stop signal, a hung upload) must not have this one log the step again on resume.
            self.logged[name] = step
            self._record()

    def _record(self) -> None:
        path = self.run_dir.trackers_logged
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(path, json.dumps(self.logged))
        except OSError as exc:  # a resume may then log a step twice, which trackers tolerate
            logger.warning("could not write %s: %s", path, exc)

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
