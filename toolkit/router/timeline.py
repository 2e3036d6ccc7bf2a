"""What the router saw of each step: in-flight requests per group over time, and dispatch counts.

The router records one event per dispatch and per completion of a request that belongs to a
(job, step), and writes ``timeline/<job>.step_XXXXX.json`` when the job's next step begins or the
router stops. ``toolkit.report.run_report`` draws ``timeline.png`` from these files.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from toolkit.core import clock
from toolkit.core.rundir import FileWriter, RunDir


@dataclass
class StepTimeline:
    job: str
    step: int
    t0: float
    events: list[tuple[float, str, int]] = field(default_factory=list)
    inflight: Counter[str] = field(default_factory=Counter)
    dispatched_before: Counter[str] = field(default_factory=Counter)
    dispatched_after: Counter[str] = field(default_factory=Counter)
    flip_time: float | None = None
    flip_count: int | None = None
    migrated: int = 0

    def to_json(self) -> dict[str, Any]:
        after = sum(self.dispatched_after.values())
        return {
            "job": self.job, "step": self.step, "t0": self.t0,
            "flip_time": self.flip_time, "flip_count": self.flip_count,
            "dispatched_before_flip": dict(self.dispatched_before),
            "dispatched_after_flip": dict(self.dispatched_after),
            "migrated": self.migrated,
            "events": [[round(t - self.t0, 6), g, n] for t, g, n in self.events],
            "after_flip_total": after,
        }


class Timeline:
    def __init__(self, run_dir: RunDir, files: FileWriter) -> None:
        self.run_dir = run_dir
        self.files = files
        self.steps: dict[str, StepTimeline] = {}

    def begin(self, job: str, step: int) -> None:
        old = self.steps.get(job)
        if old is not None and old.step == step:
            return
        if old is not None:
            self.write(old)
        self.steps[job] = StepTimeline(job, step, clock.wall())

    def of(self, job: str, step: int) -> StepTimeline | None:
        """``job``'s timeline if its current one is of ``step``."""
        st = self.steps.get(job)
        return st if st is not None and st.step == step else None

    def dispatched(self, job: str, step: int, group: str, now: float) -> None:
        st = self.of(job, step)
        if st is None:
            return
        (st.dispatched_after if st.flip_time is not None else st.dispatched_before)[group] += 1
        st.inflight[group] += 1
        st.events.append((now, group, st.inflight[group]))

    def finished(self, job: str, step: int, group: str, now: float) -> None:
        st = self.of(job, step)
        if st is None or st.inflight[group] <= 0:
            return
        st.inflight[group] -= 1
        st.events.append((now, group, st.inflight[group]))

    def flipped(self, job: str, step: int, when: float, count: int) -> None:
        st = self.of(job, step)
        if st is not None:
            st.flip_time, st.flip_count = when, count

    def migrated(self, job: str, step: int) -> None:
        st = self.of(job, step)
        if st is not None:
            st.migrated += 1

    def write(self, st: StepTimeline) -> None:
        self.files.write(self.run_dir.timeline(st.job, st.step), json.dumps(st.to_json()))

    def write_all(self) -> None:
        """Every step's timeline so far, the ones in flight included."""
        for st in self.steps.values():
            self.write(st)
