"""guard.bounded in a real process: a SIGTERM landing in the user's code ends the rank. The rest:
tests/unit/test_guard.py."""

from __future__ import annotations

from tests.helpers.paths import ROOT


def test_sigterm_in_the_users_code_ends_the_rank_instead_of_failing_the_session(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The SIGTERM handler's exit must not be taken for the user's own sys.exit(): the process would
    go on, ignoring every later SIGTERM (the handler fires once)."""
    import signal
    import subprocess
    import sys

    script = tmp_path / "rank.py"
    script.write_text(
        "import asyncio, sys, time\n"
        "from toolkit.core.lifecycle import exit_on_sigterm\n"
        "from toolkit.rollout import guard\n"
        "async def env_step():\n"
        "    print('ready', flush=True)\n"
        "    time.sleep(30)  # blocking inside an async environment: the signal lands in the user's code\n"
        "async def main():\n"
        "    print(await guard.guarded('environment', 's', env_step(), 60), flush=True)\n"
        "    print('survived', flush=True)\n"
        "exit_on_sigterm()\n"
        "asyncio.run(main())\n")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            cwd=ROOT)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM and "survived" not in out, out
