"""``toolkit.rollout.agents.run_command``, the harness program per session, on its own: what it keeps
of a harness's output, and a harness whose detached helper holds its pipes."""

from __future__ import annotations

import asyncio
import sys

import pytest

from toolkit.rollout import agents
from toolkit.rollout.agents import AgentFailed, run_command

URL = "http://127.0.0.1:9/sessions/0-0-ab/v1"


def run(code: str) -> float | None:
    return asyncio.run(asyncio.wait_for(run_command(URL, {"index": 0}, [sys.executable, "-c", code]), 60))


def test_a_verbose_harness_keeps_its_reward_and_only_its_output_tail(monkeypatch: pytest.MonkeyPatch) -> None:
    kept: list[int] = []
    real = agents._Tail.text

    def text(self: agents._Tail) -> bytes:
        kept.append(len(self.data))
        return real(self)

    monkeypatch.setattr(agents._Tail, "text", text)
    # 20 MB of log lines, then the reward.
    assert run("import sys\nfor _ in range(20000): sys.stdout.write('x' * 999 + '\\n')\nprint(0.75)") == 0.75
    assert max(kept) <= 2 * agents.KEPT_OUTPUT
    with pytest.raises(AgentFailed, match=r"exited with 3: .*last words"):
        run("import sys\nfor _ in range(20000): sys.stderr.write('y' * 999 + '\\n')\n"
            "sys.stderr.write('last words\\n'); sys.exit(3)")


def test_a_harness_whose_detached_helper_holds_its_pipes_still_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    """The helper is in a session of its own (its group is not the harness's): the harness's reward
    counts once it exits, after a short wait for its pipes, not when the helper ends."""
    import contextlib
    import os
    import signal

    monkeypatch.setattr(agents, "PIPE_WAIT_S", 0.5)
    code = ("import subprocess, sys\n"
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True)\n"
            "print(p.pid, file=sys.stderr, flush=True)\nprint(1.0)")
    holder: list[int] = []
    real = agents._Tail.__init__

    def init(self: agents._Tail, stream: asyncio.StreamReader, keep: int = agents.KEPT_OUTPUT) -> None:
        real(self, stream, keep)
        tails.append(self)
        ours.add(os.readlink(f"/proc/self/fd/{stream._transport.get_extra_info('pipe').fileno()}"))  # type: ignore[attr-defined]

    def still_open() -> set[str]:
        """Which of our ends of the harnesses' pipes this process still holds (by pipe, not fd number:
        the test session's other descriptors come and go meanwhile)."""
        links = set()
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                links.add(os.readlink(f"/proc/self/fd/{fd}"))
        return ours & links

    tails: list[agents._Tail] = []
    ours: set[str] = set()
    monkeypatch.setattr(agents._Tail, "__init__", init)
    try:
        assert run(code) == 1.0
        # Our ends of the pipes the helper holds are closed all the same (one session's two descriptors
        # each, else: a rank runs out of them).
        assert len(ours) == 2 and all(p.startswith("pipe:") for p in ours) and not still_open()
        # ...and when the session times out while the harness still runs.
        slow = code.replace("print(1.0)", "import time; time.sleep(120)")

        async def timed_out() -> None:
            task = asyncio.ensure_future(run_command(URL, {"index": 0}, [sys.executable, "-c", slow]))
            while len(tails) < 4 or not any(bytes(t.data).strip() for t in tails[2:]):
                await asyncio.sleep(0.05)  # its helper has started (it wrote its pid)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        asyncio.run(asyncio.wait_for(timed_out(), 60))
        assert len(ours) == 4 and not still_open()
    finally:
        holder.extend(int(w) for t in tails for w in bytes(t.data).split() if w.isdigit())
        for pid in holder:  # the helper this test started, by its pid
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
