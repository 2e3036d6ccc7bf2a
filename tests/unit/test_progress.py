"""Live progress in ``launch``: the running step from the router's status, redrawn on a terminal and
as plain lines every ``report.log_interval_s`` in a log."""

from __future__ import annotations

import io
import time

from rich.console import Console

from toolkit.core import protocol as P
from toolkit.launch.progress import Progress


def status(done: int, generated: int, flip_at: float = 0.0) -> P.Status:
    t0 = time.time() - 2.0
    return P.Status(
        groups={"throughput": P.GroupStatus(inflight=40, generated_tokens=generated),
                "tail": P.GroupStatus(inflight=16)},
        queued=5,
        steps={"rollout": P.StepProgress(step=1, sessions=32, done=done, started_at=t0, flip_count=31 if flip_at else 0,
                                         flip_at=t0 + flip_at if flip_at else 0.0, moves=7)},
        loading=["throughput-0@n1:5000", "throughput-1@n2:5000"],
    )


def test_the_line_says_where_the_step_is() -> None:
    p = Progress(Console(file=io.StringIO()), "rollout", 5, 30.0)
    assert p.line(P.Status(), 0, 1.0) is None  # no step begun yet
    p.line(status(8, 1000), 0, 10.0)
    text, st = p.line(status(16, 13_000, flip_at=1.5), 2, 11.0)  # type: ignore[misc]
    assert st.done == 16
    for part in ("step 2/5", "16/32 sessions", "12k tok/s", "queued 5", "in flight tail 16, throughput 40",
                 "7 moves", "flip 31/32 at 1.50s", "2 replicas loading weights", "2 replica restarts", "ETA 2.00s"):
        assert part in text, (part, text)


def test_a_log_gets_a_plain_line_per_interval_and_a_terminal_a_redrawn_one() -> None:
    out = io.StringIO()
    p = Progress(Console(file=out, force_terminal=False, width=200), "rollout", 5, 30.0)
    p.update(status(8, 1000), 0)
    p.update(status(9, 2000), 0)  # within the interval: nothing
    assert out.getvalue().count("progress: step 2/5") == 1
    p.step_done(0)  # step 1/5 ended: the next step's first status prints at once
    p.update(status(1, 3000), 0)
    assert out.getvalue().count("progress: step 2/5") == 2
    tty = io.StringIO()
    p = Progress(Console(file=tty, force_terminal=True, width=200), "rollout", 5, 30.0)
    p.update(status(8, 1000), 0)
    assert p.live is not None and "8/32 sessions" in tty.getvalue()
    p.step_done(0)
    assert p.live is None and "progress:" not in tty.getvalue()


def test_a_status_fetched_before_a_step_s_report_prints_nothing_after_its_step_line() -> None:
    out = io.StringIO()
    p = Progress(Console(file=out, force_terminal=False, width=200), "rollout", 5, 0.0)
    p.step_done(1)  # step 2/5's line was printed
    p.update(status(32, 1000), 0)  # the router's status still showed it running when it was fetched
    assert "progress:" not in out.getvalue()
