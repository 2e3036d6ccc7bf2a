"""The count flip: once a fraction of a step's sessions are done, the rest of the step goes to the tail group.

The router counts ``SessionDone`` per (job, step). At exactly ``ceil(threshold * n_sessions)`` it
has the job's sentinel file written into the run dir (temp file + rename, on the router's file-writer
thread: the dispatch never waits for the file system) and from then on every request
of that step, queued ones included, is dispatched to the tail group only. Ranks (and any other
router) read the same sentinel, so they agree on the flip without talking to this router.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

from toolkit.config import flip_count
from toolkit.core import clock
from toolkit.core.rundir import FileWriter, RunDir, read_json

logger = logging.getLogger(__name__)


@dataclass
class StepState:
    step: int
    n_sessions: int
    done: set[str] = field(default_factory=set)
    flipped_at: float | None = None
    flip_count: int = 0


class CountFlip:
    def __init__(self, run_dir: RunDir, files: FileWriter, threshold: float | None, group: str) -> None:
        self.run_dir = run_dir
        self.files = files
        self.threshold = threshold
        self.group = group
        self.steps: dict[str, StepState] = {}
        # SessionDone that arrived before its StepBegin (replayed by clients after a router restart).
        self.early: dict[tuple[str, int], set[str]] = {}

    def step_begin(self, job: str, step: int, n_sessions: int) -> None:
        st = self.steps.get(job)
        if st is not None and st.step == step:
            if not st.n_sessions:
                st.n_sessions = n_sessions
            return  # a replay after a restart: keep the counts and any flip
        self.files.remove(self.run_dir.sentinel(job))
        self.steps[job] = StepState(step, n_sessions)
        logger.info("job %s step %d begins with %d sessions", job, step, n_sessions)
        for sid in self.early.pop((job, step), set()):
            self.session_done(job, step, sid)
        self.early = {k: v for k, v in self.early.items() if k[0] != job or k[1] > step}

    def session_done(self, job: str, step: int, session_id: str) -> bool:
        """Count one finished session; True when this call flipped the step (never without a threshold)."""
        st = self.steps.get(job)
        if st is None or st.step < step:
            if len(self.early) < 1024:
                self.early.setdefault((job, step), set()).add(session_id)
            return False
        if st.step != step:
            return False
        st.done.add(session_id)
        if self.threshold is None:
            return False
        if st.flipped_at is None and len(st.done) >= flip_count(self.threshold, st.n_sessions):
            st.flipped_at = clock.wall()
            st.flip_count = len(st.done)
            self.files.write(
                self.run_dir.sentinel(job),
                json.dumps({"job": job, "step": step, "time": st.flipped_at, "count": st.flip_count,
                            "n_sessions": st.n_sessions, "group": self.group}),
            )
            logger.info("job %s step %d flipped to group %s at %d/%d sessions",
                        job, step, self.group, st.flip_count, st.n_sessions)
            return True
        return False

    def flipped(self, job: str, step: int) -> bool:
        st = self.steps.get(job)
        if st is not None and st.step == step:
            return st.flipped_at is not None
        return False

    def adopt_sentinels(self) -> None:
        """After a restart: take over flips another router instance already wrote."""
        for path in self.run_dir.all_sentinels():
            info = read_json(path)
            if info:
                st = StepState(int(info["step"]), int(info.get("n_sessions", 0)))
                st.flipped_at = float(info["time"])
                st.flip_count = int(info["count"])
                self.steps[str(info["job"])] = st
