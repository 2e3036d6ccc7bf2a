"""``python -m toolkit.launch`` end to end: real router, sim replicas, MPI ranks, Parquet out."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.helpers.outputs import check_outputs
from tests.helpers.procs import assert_no_process_left, finish, launch, ranks_started, start_launch, wait_for
from toolkit.core.lifecycle import read_pidfiles
from toolkit.core.rundir import RunDir

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

FAST = ["engine.time_scale=0.2"]


def test_default_run_writes_complete_outputs_and_leaves_nothing(tmp_path: Path) -> None:
    run = tmp_path / "run"
    out = launch([f"hydra.run.dir={run}", *FAST])
    assert out.returncode == 0, out.stdout + out.stderr
    for rep in check_outputs(run, steps=2, sessions=32):
        # The sim's time model gives every step a lower bound; the step line shows the wall time against it.
        b = rep["bound"]
        assert rep["bound_s"] == max(b["critical_path_s"], b["throughput_s"]) > 0
        assert rep["bound_ratio"] == rep["wall_s"] / rep["bound_s"] and 0 <= b["critical_session"] < 32
        # Tail routing is on by default: long runners move to the tail group as they show up.
        tail = rep["tail"]
        assert tail["policy"] == "age" and tail["moves"] >= tail["moved_requests"] >= 0
        assert rep["flip"] is None and rep["sessions_by_status"] == {"completed": 32}
    assert "step 1/2" in out.stdout and "step 2/2" in out.stdout and "rollout summary" in out.stdout
    assert "x its bound" in out.stdout and "age: " in out.stdout and " move" in out.stdout
    # Prometheus' file_sd targets as launch last wrote them: the endpoints serving then (the ranks may
    # have ended already; tests/integration/test_metrics.py waits for all of them), labelled with the run, on loopback.
    targets = {t["labels"]["component"]: t for t in json.loads((run / "prometheus_targets.json").read_text())}
    assert "router" in targets and set(targets) <= {"router", "replica-throughput-0", "replica-throughput-1",
                                                    "replica-tail-0", "rank-0", "rank-1"}
    assert targets["router"]["labels"] == {"run": str(run.absolute()), "component": "router"}
    assert all(t["targets"][0].startswith("127.0.0.1:") for t in targets.values())
    assert (run / "config.yaml").exists() and (run / ".hydra" / "config.yaml").exists()
    logs = {p.name for p in (run / "logs").iterdir()}
    assert {"router.log", "replica-throughput-0.log", "replica-throughput-1.log", "replica-tail-0.log",
            "rank-0.log", "rank-1.log"} <= logs
    assert_no_process_left(run)
    # The same run dir again: refused at setup (the old router address would mislead the new run's
    # components), and the first run's outputs are left as they were.
    before = {p: p.stat().st_mtime_ns for p in (run / "steps").iterdir()}
    made_by = RunDir(run).read_overrides()
    assert made_by == FAST  # (the task's overrides; hydra.* are Hydra's own)
    again = launch([f"hydra.run.dir={run}", *FAST, "steps=7"], timeout_s=60)
    assert again.returncode == 2, again.stdout + again.stderr
    assert "already holds a run" in again.stdout and str(run) in again.stdout.replace("\n", "")
    assert {p: p.stat().st_mtime_ns for p in (run / "steps").iterdir()} == before
    # Hydra rewrote its .hydra files for the refused launch; the run's own record of how it was made stands
    # (replay= and the sweep summary read it).
    assert "steps=7" in (run / ".hydra" / "overrides.yaml").read_text() and RunDir(run).read_overrides() == made_by


def test_overrides_scale_groups_and_flip_at_the_exact_count(tmp_path: Path) -> None:
    run = tmp_path / "run"
    out = launch([f"hydra.run.dir={run}", *FAST, "steps=3", "groups.throughput.replicas=3",
                  "tail.threshold=0.9", "sessions_per_step=20"])
    assert out.returncode == 0, out.stdout + out.stderr
    reports = check_outputs(run, steps=3, sessions=20)
    assert (run / "logs" / "replica-throughput-2.log").exists()
    for rep in reports:
        flip = rep["flip"]
        assert flip["expected_count"] == math.ceil(0.9 * 20) == 18
        assert flip["count"] == 18
        assert flip["spillover"] == 0.0
        assert flip["requests_after_by_group"]["throughput"] == 0
        assert set(rep["groups"]) == {"throughput", "tail"}
    assert RunDir(run).timeline_png.stat().st_size > 10_000
    timelines = sorted(p.name for p in RunDir(run).timelines.iterdir())
    assert timelines == [f"rollout.step_{s:05d}.json" for s in range(3)]
    RunDir(run).timeline_png.unlink()
    out = subprocess.run([sys.executable, "-m", "toolkit.report.run_report", str(run)], capture_output=True, text=True,
                         timeout=60, env=dict(os.environ, COLUMNS="200"))
    assert out.returncode == 0, out.stderr
    assert "18/18" in out.stdout and RunDir(run).timeline_png.exists()
    assert_no_process_left(run)


def test_a_group_added_by_override_serves_the_step(tmp_path: Path) -> None:
    run = tmp_path / "run"
    # The tail group fills its room with the step's first turns (tail.policy=age): 8 places leave
    # 16 sessions to the bulk groups.
    out = launch([f"hydra.run.dir={run}", *FAST, "steps=1", "sessions_per_step=24", "groups.tail.max_inflight=8",
                  "+groups.mid={replicas:1,max_inflight:8}", "+groups.mid.labels.role=mid"])
    assert out.returncode == 0, out.stdout + out.stderr
    (rep,) = check_outputs(run, steps=1, sessions=24)
    assert set(rep["groups"]) == {"throughput", "tail", "mid"}
    assert rep["groups"]["mid"]["requests"] > 0  # a bulk group like throughput: sessions hash onto it
    assert (run / "logs" / "replica-mid-0.log").exists()
    assert_no_process_left(run)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGHUP])
def test_ctrl_c_or_a_dropped_terminal_stops_every_process(tmp_path: Path, sig: signal.Signals) -> None:
    run = tmp_path / "run"
    # As from a terminal: SIGHUP's default action (the tests may run under nohup, whose SIG_IGN launch
    # inherits and keeps, as it should).
    proc = start_launch([f"hydra.run.dir={run}", "steps=50"],
                        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    try:
        wait_for(lambda: ranks_started(run), 90, "ranks to start")
        proc.send_signal(sig)
    finally:
        output = finish(proc, 60)
    assert proc.returncode == 130, output
    assert "interrupted" in output
    report = json.loads((run / "report.json").read_text())
    assert report["status"] == "interrupted" and sig.name in report["error"]
    assert [e["kind"] for e in report["interruptions"]] == ["signal"]
    assert_no_process_left(run)


@pytest.mark.parametrize("before", [None, signal.SIGTERM])
def test_a_terminal_that_hangs_up_stops_every_process_though_nothing_can_be_written_there(
        tmp_path: Path, before: signal.Signals | None) -> None:
    """launch on a terminal (a pty: its controlling terminal) that goes away, as an SSH session drops:
    the kernel sends SIGHUP, and from then on every write to the terminal fails (EIO), the teardown's
    own included. The teardown still stops everything and writes the report; also when a SIGTERM came
    first (logind at a logout) and its teardown is under way."""
    import pty
    import select
    import threading
    import time

    run = tmp_path / "run"
    pid, master = pty.fork()
    if pid == 0:  # the child: a session leader whose controlling terminal is the pty
        try:
            signal.signal(signal.SIGHUP, signal.SIG_DFL)
            os.environ.update(PYTHONUNBUFFERED="1", COLUMNS="200")
            os.execv(sys.executable, [sys.executable, "-m", "toolkit.launch", f"hydra.run.dir={run}", "steps=50"])
        finally:
            os._exit(127)
    stop = threading.Event()
    seen = bytearray()

    def drain() -> None:  # a terminal reads what launch writes (a full pty would block it)
        while not stop.is_set():
            if select.select([master], [], [], 0.1)[0]:
                try:
                    seen.extend(os.read(master, 65536))
                except OSError:
                    return

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    status = None
    try:
        wait_for(lambda: ranks_started(run), 90, "ranks to start")
        if before is not None:
            os.kill(pid, before)
            # Its teardown under way before the hang-up: both pending at once, Python would run SIGHUP's
            # handler first (it runs pending handlers in signal-number order).
            events = RunDir(run).events
            wait_for(lambda: events.exists() and before.name in events.read_text(), 60, f"launch to take {before.name}")
        stop.set()
        reader.join()
        os.close(master)  # the terminal is gone
        deadline = time.monotonic() + 120
        while status is None and time.monotonic() < deadline:
            done, st = os.waitpid(pid, os.WNOHANG)
            status = st if done else None
            time.sleep(0.2)
    finally:
        if status is None:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 130, bytes(seen).decode(errors="replace")[-2000:]
    report = json.loads((run / "report.json").read_text())
    assert report["status"] == "interrupted" and (before or signal.SIGHUP).name in report["error"]
    assert_no_process_left(run)


def test_a_raising_environment_fails_its_sample_and_the_failure_budget_the_run(tmp_path: Path) -> None:
    crash = ["workload.env._target_=tests.helpers.crashing_env.CrashOnSession", "+workload.env.crash_index=3",
             "~workload.env.max_turns", "~workload.env.observation_tokens", "~workload.env.vocab_size"]
    run = tmp_path / "run"
    out = launch([f"hydra.run.dir={run}", *FAST, "steps=1", *crash], cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stdout + out.stderr  # 1 of 32 is within the default budget (0.1)
    rows = pq.read_table(run / "steps" / "step_00000.parquet").to_pylist()
    assert rows[3]["status"] == "failed"
    assert rows[3]["error"] == "environment raised RuntimeError: environment crashed on session 3"
    assert all(r["status"] == "completed" for r in rows if r["index"] != 3)
    assert_no_process_left(run)

    run = tmp_path / "strict"
    out = launch([f"hydra.run.dir={run}", *FAST, *crash, "rollout.max_failed_fraction=0"],
                 cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 1, out.stdout + out.stderr
    text = out.stdout + out.stderr  # on one line: errors are never wrapped
    assert ("step 0: 1 of 32 sessions failed (3.1%), more than rollout.max_failed_fraction = 0.0; first errors: "
            "session 3: environment raised RuntimeError: environment crashed on session 3") in text
    assert (run / "steps" / "step_00000.parquet").exists()  # the step's files are written before the run ends
    assert_no_process_left(run)


def test_an_environment_that_hangs_or_answers_garbage_fails_its_own_sample(tmp_path: Path) -> None:
    env = ["workload.env._target_=tests.helpers.crashing_env.MisbehaveOnSessions",
           "~workload.env.max_turns", "~workload.env.observation_tokens", "~workload.env.vocab_size"]
    run = tmp_path / "run"
    out = launch([f"hydra.run.dir={run}", *FAST, "steps=1", *env, "workload.env_timeout_s=5",
                  "rollout.max_failed_fraction=0.3"], cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stdout + out.stderr
    rows = pq.read_table(run / "steps" / "step_00000.parquet").to_pylist()
    hung = rows[1]["error"]  # its turn's wait for the engine is told apart from the environment's own time
    assert rows[1]["status"] == "failed" and re.fullmatch(
        r"environment timed out after workload.env_timeout_s = 5.0s \((\d+\.\d)s of it waiting for the engines\)",
        hung), hung
    assert [(r["status"], r["error"]) for r in rows[2:9]] == [
        ("failed", "environment raised BadTokens: step's observation holds token id 1099511627776, outside 0..2147483647"),
        ("failed", "environment raised BadTokens: step's observation must be a list of int token ids: "
                   "'float' object cannot be interpreted as an integer"),
        ("failed", "environment raised RouterUnavailable: a toolkit error the user's code let through"),
        ("failed", "environment: the reward must be a finite number, got nan"),
        ("failed", "environment raised Abandon: past every except Exception"),
        ("failed", "environment raised RuntimeError: StopIteration"),
        ("failed", "environment raised BadTokens: step's observation must be a list of int token ids, not a bytes"),
    ]
    assert all(r["status"] == "completed" for r in rows if not 1 <= r["index"] <= 8)
    assert_no_process_left(run)


def test_a_predictor_that_answers_garbage_fails_its_sample_alone(tmp_path: Path) -> None:
    hint = ["+workload.length_hint={_target_:tests.helpers.garbage_hint.GarbageOnSession,garbage_index:3,engine:${engine}}"]
    run = tmp_path / "run"
    # One turn per session: a turn starts on the tail group only for its hint (no earlier turn ran there).
    out = launch([f"hydra.run.dir={run}", *FAST, "steps=2", "workload=singleturn", "tail.policy=age",
                  "tail.long_tokens=100", *hint],
                 cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stdout + out.stderr
    for step in range(2):
        rows = pq.read_table(run / "steps" / f"step_{step:05d}.parquet").to_pylist()
        assert rows[3]["status"] == "failed"
        assert rows[3]["error"] == ("workload.length_hint returned 'a lot': expected an int in [0, 2147483647] "
                                    "(tokens; 0 = no guess)")
        assert all(r["status"] == "completed" for r in rows if r["index"] != 3)
    # Turns hinted over 100 tokens (the sim's exact plan) start on the tail group while it has room.
    tails = [s["tail"] for s in json.loads((run / "report.json").read_text())["steps"]]
    assert all(t["policy"] == "age" and t["started"] > 0 for t in tails), tails
    assert "turns started on the tail group" in out.stdout
    assert_no_process_left(run)


def test_a_crashing_rank_fails_the_run_and_leaves_nothing(tmp_path: Path) -> None:
    run = tmp_path / "run"
    out = launch([f"hydra.run.dir={run}", *FAST, "workload.env._target_=tests.helpers.crashing_env.ExitOnSession",
                  "+workload.env.crash_index=3", "~workload.env.max_turns", "~workload.env.observation_tokens",
                  "~workload.env.vocab_size"], cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 1, out.stdout + out.stderr
    assert "rollout ranks exited" in out.stdout + out.stderr
    assert_no_process_left(run)


def _kill_router_after_first_step(run: Path, extra: list[str]) -> tuple[int, str]:
    proc = start_launch([f"hydra.run.dir={run}", *extra])
    try:
        wait_for(lambda: (run / "steps" / "step_00000.json").exists(), 120, "the first step")
        router = next(r for r in read_pidfiles(run / "pids") if r.name == "router")
        os.kill(router.pid, signal.SIGKILL)  # mid-step: step 1 has just begun
    finally:
        output = finish(proc, 120)
    return proc.returncode, output


def test_router_restart_mid_step_loses_no_session_and_duplicates_none(tmp_path: Path) -> None:
    run = tmp_path / "run"
    code, output = _kill_router_after_first_step(run, ["steps=3", "tail.threshold=0.9"])
    assert code == 0, output
    assert "restarting it" in output
    reports = check_outputs(run, steps=3, sessions=32)  # every session exactly once, all completed
    assert json.loads((run / "report.json").read_text())["summary"]["router_restarts"] == 1
    # The restarted router got the step's counts replayed and still flipped at the exact count.
    assert all(r["flip"]["count"] == 29 for r in reports)
    assert_no_process_left(run)


def test_lost_router_without_restart_fails_the_run_cleanly(tmp_path: Path) -> None:
    run = tmp_path / "run"
    code, output = _kill_router_after_first_step(run, ["steps=50", "cluster.restart_router=false"])
    assert code == 1, output
    assert "router exited" in output
    assert_no_process_left(run)


def test_a_killed_replica_is_replaced_and_no_session_is_lost(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = start_launch([f"hydra.run.dir={run}", "steps=3", "router.heartbeat_s=0.2"])
    try:
        wait_for(lambda: ranks_started(run), 90, "ranks to start")
        victim = next(r for r in read_pidfiles(run / "pids") if r.name == "replica-throughput-0")
        os.kill(victim.pid, signal.SIGKILL)
    finally:
        output = finish(proc, 120)
    assert proc.returncode == 0, output
    check_outputs(run, steps=3, sessions=32)
    report = json.loads((run / "report.json").read_text())
    assert report["summary"]["replica_restarts"] >= 1
    assert_no_process_left(run)


def _replica_lost_at_boot(run: Path, overrides: list[str]) -> tuple[subprocess.Popen[str], str]:
    """Launch, its router stopped (SIGSTOP) once it has written its address, so that no replica can be
    ready; replica-throughput-0 killed as it boots; the router resumed once launch has answered. Launch's
    exit code and output."""
    proc = start_launch([f"hydra.run.dir={run}", *FAST, "steps=1", *overrides])
    router = None
    try:
        wait_for(lambda: (run / "router.json").exists(), 90, "the router's address")
        router = next(r for r in read_pidfiles(run / "pids") if r.name == "router")
        os.kill(router.pid, signal.SIGSTOP)
        victim = wait_for(lambda: next((r for r in read_pidfiles(run / "pids") if r.name == "replica-throughput-0"),
                                       None), 90, "replica-throughput-0 to start")
        os.kill(victim.pid, signal.SIGKILL)
        wait_for(lambda: proc.poll() is not None or any(e["kind"] == "replica_boot_failed"
                                                        for e in RunDir(run).read_events()), 90, "launch to answer")
    finally:
        if router is not None:
            os.kill(router.pid, signal.SIGCONT)
        output = finish(proc, 180)
    return proc, output


def test_a_replica_lost_before_the_run_is_ready_is_started_again(tmp_path: Path) -> None:
    """``cluster.boot_retries``: a replica that ends before the run is first ready (a bad node) is started
    again, and launch says why; no session is lost."""
    run = tmp_path / "run"
    proc, output = _replica_lost_at_boot(run, [])
    assert proc.returncode == 0, output
    assert "replica-throughput-0 exited before it was ready" in output and "1 of cluster.boot_retries=1" in output
    [event] = [e for e in RunDir(run).read_events() if e["kind"] == "replica_boot_failed"]
    assert (event["group"], event["index"], event["attempt"]) == ("throughput", 0, 1)
    check_outputs(run, steps=1, sessions=32)
    assert_no_process_left(run)


def test_with_no_boot_retries_a_replica_lost_at_boot_fails_the_run_with_its_log(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc, output = _replica_lost_at_boot(run, ["cluster.boot_retries=0"])
    assert proc.returncode != 0, output
    assert "run failed:" in output and "replica-throughput-0 exited" in output
    assert f"last lines of {run / 'logs' / 'replica-throughput-0.log'}" in " ".join(output.split()), output
    assert not [e for e in RunDir(run).read_events() if e["kind"] == "replica_boot_failed"]
    assert_no_process_left(run, ranks=False)  # the run failed before they started


def test_kill_9_of_launch_leaves_no_orphan(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "toolkit.launch", f"hydra.run.dir={run}", "steps=50"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: ranks_started(run), 90, "ranks to start")
        proc.kill()  # no teardown can run: every component must notice its owner is gone
        proc.wait(10)
        refs = [r for r in read_pidfiles(run / "pids") if r.pid != proc.pid]
        wait_for(lambda: not any(r.alive() for r in refs), 30, "every component to exit")
    finally:
        if proc.poll() is None:
            proc.kill()
        from toolkit.core.lifecycle import stop_processes

        stop_processes(read_pidfiles(run / "pids"))


def test_async_environments_do_not_block_the_ranks_other_sessions(tmp_path: Path) -> None:
    run = tmp_path / "run"
    out = launch([f"hydra.run.dir={run}", *FAST, "steps=1", "sessions_per_step=12",
                  "workload.env._target_=tests.helpers.async_env.SlowToolEnv"], cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stdout + out.stderr
    rows = pq.read_table(run / "steps" / "step_00000.parquet").to_pylist()
    assert all(r["status"] == "completed" and r["num_turns"] == 3 for r in rows)
    assert max(r["reward"] for r in rows) >= 2  # sessions were inside their slow tools together


def test_ranks_that_fail_in_mpi_init_are_started_once_more(tmp_path: Path) -> None:
    """A launcher whose first world dies before any rank is up (as MPI's wire-up can after a requeue):
    launch starts the ranks once more, and the run completes."""
    run = tmp_path / "run"
    wrapper = tmp_path / "flaky-mpiexec"
    marker = tmp_path / "failed-once"
    real = Path(sys.executable).parent / "mpiexec"
    wrapper.write_text(f"#!/bin/sh\nif [ ! -e {marker} ]; then touch {marker}; echo 'wire-up failed' >&2; exit 14; fi\n"
                       f"exec {real} \"$@\"\n")
    wrapper.chmod(0o755)
    out = launch([f"hydra.run.dir={run}", *FAST, "steps=1", f"cluster.mpiexec={wrapper}"])
    assert out.returncode == 0, out.stdout + out.stderr
    assert "did not get through MPI_Init; starting them again" in out.stdout
    check_outputs(run, steps=1, sessions=32)


def test_ranks_stuck_in_mpi_init_twice_end_the_run_at_their_readiness_timeout(tmp_path: Path) -> None:
    """A world that never wires up (a nested srun waiting for resources, an MPI that hangs): started
    once more, then a readiness error, not a wait with the whole fleet up until the time limit."""
    run = tmp_path / "run"
    hang = tmp_path / "hanging-mpiexec"
    hang.write_text("#!/bin/sh\necho 'waiting for a world that never comes' >&2\nexec sleep 600\n")
    hang.chmod(0o755)
    out = launch([f"hydra.run.dir={run}", *FAST, "steps=1", f"cluster.mpiexec={hang}", "cluster.ready_timeout_s=12"])
    assert out.returncode == 1, out.stdout + out.stderr
    assert "did not get through MPI_Init; starting them again" in out.stdout
    assert "did not get through MPI_Init in 12s, started twice" in out.stdout + out.stderr
    assert json.loads((run / "report.json").read_text())["status"] == "failed"
