"""Live progress of the step that runs, in ``launch``: from the router's status, once a second.

On a terminal a one-line display is redrawn in place (a bar of sessions done, then the figures); in a
log (a Slurm job's output, a pipe) a plain line every ``report.log_interval_s`` instead. Both say:
sessions done / total, generated tokens and tokens/s, requests queued and in flight per group, the
tail group's moves and the count flip when it came, replica restarts, and an ETA. The step lines and
the final table are printed as before; this only fills the time between them.
"""

from __future__ import annotations

import time

from rich.console import Console
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from toolkit.core import protocol as P
from toolkit.report.run_report import secs, si


class Progress:
    def __init__(self, console: Console, job: str, steps: int, log_interval_s: float) -> None:
        self.console = console
        self.job = job
        self.steps = steps
        self.log_interval_s = log_interval_s
        self.live: Live | None = None
        self._logged_at = 0.0
        self._tokens: tuple[float, int] | None = None  # (time, generated tokens) of the last status
        self.tokens_per_s = 0.0
        self._ended = -1
        """The last step whose line was printed: a status fetched before its report still shows it running."""

    def line(self, status: P.Status, restarts: int, now: float) -> tuple[str, P.StepProgress] | None:
        """The progress line of the job's current step, or None when it has not begun."""
        st = status.steps.get(self.job)
        if st is None or st.step < 0 or st.step <= self._ended or not st.sessions:
            return None
        generated = sum(g.generated_tokens for g in status.groups.values())
        if self._tokens is not None and now > self._tokens[0] and generated >= self._tokens[1]:
            self.tokens_per_s = (generated - self._tokens[1]) / (now - self._tokens[0])
        self._tokens = (now, generated)
        elapsed = time.time() - st.started_at if st.started_at else 0.0
        parts = [f"step {st.step + 1}/{self.steps}", f"{st.done}/{st.sessions} sessions",
                 f"{si(self.tokens_per_s)} tok/s", f"queued {status.queued}",
                 "in flight " + ", ".join(f"{g} {s.inflight}" for g, s in sorted(status.groups.items()))]
        if st.moves:
            parts.append(f"{st.moves} moves")
        if st.flip_at:
            parts.append(f"flip {st.flip_count}/{st.sessions} at {secs(st.flip_at - st.started_at)}")
        if status.loading:
            parts.append(f"{len(status.loading)} replicas loading weights")
        if restarts:
            parts.append(f"{restarts} replica restarts")
        if st.done and st.done < st.sessions and elapsed > 0:
            parts.append(f"ETA {secs(elapsed / st.done * (st.sessions - st.done))}")
        return " · ".join(parts), st

    def update(self, status: P.Status | None, restarts: int) -> None:
        """A new router status (None: none this time)."""
        if status is None:
            return
        now = time.monotonic()
        got = self.line(status, restarts, now)
        if got is None:
            return
        text, st = got
        if not self.console.is_terminal:
            if now - self._logged_at >= self.log_interval_s:
                self._logged_at = now
                self.console.print(f"progress: {text}", highlight=False, soft_wrap=True)
            return
        grid = Table.grid(padding=(0, 1))
        grid.add_row(ProgressBar(total=st.sessions, completed=st.done, width=24), Text(text))
        if self.live is None:
            self.live = Live(grid, console=self.console, transient=True, auto_refresh=False)
            self.live.start()
        self.live.update(grid, refresh=True)

    def step_done(self, step: int) -> None:
        """Step ``step``'s report arrived: clear the display before its step line; no progress line for it
        after that one."""
        self._ended = max(self._ended, step)
        self.close()

    def close(self) -> None:
        """Clear the display; the next status prints at once."""
        if self.live is not None:
            self.live.stop()
            self.live = None
        self._logged_at = 0.0
