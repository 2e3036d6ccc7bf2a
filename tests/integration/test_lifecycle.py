"""lifecycle helpers that need no other component."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

PRINT_STDOUT_FILE = "import sys; from toolkit.core.lifecycle import stdout_file; print(stdout_file(), file=sys.stderr)"


def test_stdout_file_names_the_log_a_job_prints_to_and_nothing_else(tmp_path: Path) -> None:
    log = tmp_path / "job_log.out"
    with open(log, "w") as out:
        got = subprocess.run([sys.executable, "-c", PRINT_STDOUT_FILE], stdout=out, stderr=subprocess.PIPE,
                             text=True, timeout=60)
    assert got.stderr.strip() == str(log)
    piped = subprocess.run([sys.executable, "-c", PRINT_STDOUT_FILE], capture_output=True, text=True, timeout=60)
    assert piped.stderr.strip() == "None"


def test_a_pid_recorded_without_its_start_time_is_never_signalled() -> None:
    """Its process was gone when it was recorded: the pid may be anyone's now (here, a live sleeper)."""
    from toolkit.core.lifecycle import ProcessRef, stop_processes

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        stop_processes([ProcessRef(sleeper.pid, None, "recorded too late")], grace_s=0.5)
        assert sleeper.poll() is None
        # Recorded on another machine (a Slurm compute node): that pid is not this machine's.
        remote = ProcessRef.decode(dataclasses.replace(ProcessRef.of(sleeper.pid), host="node-17").encode())
        assert remote.host == "node-17" and not remote.alive()
        stop_processes([remote], grace_s=0.5)
        assert sleeper.poll() is None
        # Known twice, once with its start time: that one is the process, and it is stopped.
        assert stop_processes([ProcessRef.of(sleeper.pid), ProcessRef(sleeper.pid, None)], grace_s=5) == []
        assert sleeper.wait(10) is not None
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
            sleeper.wait()


def test_a_job_that_raises_says_why_in_its_log_and_in_launchs_message(tmp_path: Path) -> None:
    """submitit logs only that a job raised: the traceback joins the component's log, and launch's
    message for a component that ended quotes its log and its raw output (what an engine printed)."""
    import submitit

    from tests.helpers.failing_job import fail_at_boot
    from tests.helpers.procs import wait_for
    from toolkit.cluster import exit_story
    from toolkit.cluster.local import SubmititComponent

    ex = submitit.LocalExecutor(folder=tmp_path / "submitit" / "replica-x")
    ex.update_parameters(timeout_min=5)
    log = tmp_path / "replica-x.log"
    comp = SubmititComponent("replica-x", ex.submit(fail_at_boot, str(log)))
    wait_for(lambda: not comp.alive(), 120, "the job to end")
    assert "ValueError: no such model: /models/none" in log.read_text()
    story = exit_story(comp, log)
    assert story.startswith("replica-x exited (") and "engine: worker 1 failed to start" in story
    assert story.count("ValueError: no such model: /models/none") >= 2  # its log, its output


TERMINATED = """
import asyncio, sys, time
from toolkit.core.errors import Terminated
from toolkit.core.lifecycle import run_until_terminated

async def main(hang: bool) -> None:
    print("up", flush=True)
    try:
        await asyncio.sleep(3600)
    finally:
        print("cleanup", flush=True)
        await asyncio.sleep(0.5)  # the cleanup's awaits run (a second SIGTERM arrives meanwhile)
        if hang:
            time.sleep(3600)  # a cleanup that never ends
        print("cleaned", flush=True)

try:
    run_until_terminated(main(sys.argv[1] == "hang"), grace_s=float(sys.argv[2]))
except Terminated as exc:
    print("terminated", exc.code, flush=True)
    sys.exit(exc.code)
"""


def _signalled(tmp_path: Path, mode: str, grace_s: float) -> tuple[subprocess.Popen[str], str]:
    import signal

    script = tmp_path / "terminated.py"
    script.write_text(TERMINATED)
    proc = subprocess.Popen([sys.executable, str(script), mode, str(grace_s)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "up\n"
        proc.send_signal(signal.SIGTERM)
        assert proc.stdout.readline() == "cleanup\n"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    return proc, out + err


def test_sigterm_cancels_an_asyncio_main_whose_cleanup_runs_to_its_end_a_second_sigterm_ignored(tmp_path: Path) -> None:
    proc, out = _signalled(tmp_path, "clean", 60)
    assert proc.returncode == 143 and out.splitlines()[:2] == ["cleaned", "terminated 143"], out


def test_a_cleanup_that_hangs_after_sigterm_writes_every_threads_stack_and_exits(tmp_path: Path) -> None:
    proc, out = _signalled(tmp_path, "hang", 1.0)
    assert proc.returncode == 1, out
    assert "cleaned" not in out and "most recent call first" in out and "in main" in out, out


def test_a_replica_stopped_while_it_waits_for_its_router_exits_cleanly(tmp_path: Path) -> None:
    """The wait for the router's address is the replica's task, not a thread: SIGTERM ends it at once (a
    thread polling for minutes held the exit until the stack-dumping grace ran out, exit 1)."""
    import signal

    from tests.helpers.procs import wait_for
    from toolkit.config import compose_config
    from toolkit.launch.stack import LocalStack

    stack = LocalStack(compose_config(["engine=sim", "groups=single"]), tmp_path / "run")  # no router.json
    proc = stack.start_replica("throughput", 0)
    try:
        log = stack.run_dir.logs / "replica-throughput-0.out"
        wait_for(lambda: log.exists() and "waits for the router's address" in log.read_text(errors="replace"), 60,
                 "the replica to wait for its router")
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
        out = (stack.run_dir.logs / "replica-throughput-0.out").read_text(errors="replace")
        assert code == 0 and "Current thread" not in out, out[-3000:]
    finally:
        stack.stop()


def test_a_stacks_router_and_replicas_end_with_the_process_that_started_them(tmp_path: Path) -> None:
    """A benchmark killed (a timeout, the OOM killer) runs no ``finally``: its LocalStack's processes watch it."""
    import signal

    from tests.helpers.procs import wait_for
    from toolkit.core.lifecycle import read_pidfiles

    root = tmp_path / "stack"
    owner = subprocess.Popen([sys.executable, "-c", (
        "import time\nfrom pathlib import Path\nfrom toolkit.config import compose_config\n"
        "from toolkit.launch.stack import LocalStack\n"
        f"s = LocalStack(compose_config(['groups=single', 'engine.time_scale=0.1']), Path({str(root)!r})).start(60)\n"
        "print('ready', flush=True)\ntime.sleep(600)\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None and owner.stdout.readline().strip() == "ready"
        started = read_pidfiles(root / "pids")
        assert {r.name for r in started} == {"router", "replica-throughput-0"}
        owner.send_signal(signal.SIGKILL)
        owner.wait(30)
        wait_for(lambda: not any(r.alive() for r in started), 60, "the stack's processes to end with their owner")
    finally:
        if owner.poll() is None:
            owner.kill()
        for r in read_pidfiles(root / "pids"):
            r.signal(signal.SIGKILL)
