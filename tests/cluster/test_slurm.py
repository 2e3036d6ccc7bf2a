"""cluster=slurm, the sbatch templates and sweeps against a real Slurm (slurm/dev-cluster.sh up):
real slurmctld/slurmd, accounting (sacct), srun --mpi=pmi2 ranks, sim engines.

Run dirs must be on storage every node sees, so they live under $TOOLKIT_SHARED_TMP (default:
.slurm-test-runs in the repo, or ~/.cache/rollout-toolkit/slurm-test-runs when the repo itself is
under a temporary directory), not under pytest's /tmp; each test removes its own. Every test gives
its run a unique ``job`` name (the prefix of its Slurm job names) and checks at the end that squeue
lists none of its jobs. Without a Slurm these tests skip, unless TOOLKIT_REQUIRE_SLURM=1 (CI).
"""

from __future__ import annotations

import csv
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.helpers.outputs import check_outputs
from tests.helpers.paths import ROOT
from tests.helpers.procs import (
    assert_no_process_left,
    explained,
    finish,
    launch,
    lose_node_rank,
    start_launch,
    wait_for,
)
from tests.helpers.slurm import FAST, accounting, job_id, our_jobs, pending, registrations
from toolkit.core.lifecycle import read_pidfiles

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(420)]

def test_default_run_on_slurm_completes_with_complete_outputs(slurm_run: tuple[Path, str]) -> None:
    d, job = slurm_run
    out = launch([f"hydra.run.dir={d / 'run'}", f"job={job}", *FAST], timeout_s=300)
    assert out.returncode == 0, out.stdout + out.stderr
    r = d / "run"
    check_outputs(r, steps=2, sessions=32)
    # The router advertises an address other nodes reach, and CURVE is on with private keys.
    router = json.loads((r / "router.json").read_text())
    assert "127.0.0.1" not in router["frontend"] and "0.0.0.0" not in router["frontend"]
    assert sorted(p.name for p in (r / "keys").iterdir()) == ["client.key", "client.key_secret", "gateway.token",
                                                             "router.key", "router.key_secret"]
    assert all((p.stat().st_mode & 0o077) == 0 for p in (r / "keys").iterdir())
    # One job for the router, one job array per group, one MPI job of two tasks for the ranks.
    log = out.stdout + out.stderr
    ids = {line.split(": Slurm job ")[0].split()[-1]: line.split(": Slurm job ")[1].split()[0]
           for line in log.splitlines() if ": Slurm job " in line}
    assert set(ids) == {"router", "replica-throughput-0", "replica-throughput-1", "replica-tail-0", "ranks"}
    assert ids["replica-throughput-0"].split("_")[0] == ids["replica-throughput-1"].split("_")[0]
    assert ids["replica-throughput-0"].endswith("_0") and ids["replica-throughput-1"].endswith("_1")
    states = accounting(ids["ranks"])
    assert states[ids["ranks"]] == "COMPLETED", states
    ranks_out = "".join(p.read_text() for p in (r / "logs" / "submitit" / "ranks").glob("*_log.out"))
    assert "--mpi=pmi2" in next((r / "logs" / "submitit" / "ranks").glob("*_submission.sh")).read_text()
    assert "MPI world has" not in ranks_out  # one world of 2 ranks, not 2 worlds of 1
    # Compile caches under the shared cache dir, set for every replica job.
    assert (r / "cache" / "vllm").is_dir() and (r / "cache" / "triton").is_dir()
    assert_no_process_left(r)


def test_the_local_cluster_runs_inside_a_slurm_job_step(slurm_run: tuple[Path, str]) -> None:
    """``cluster=local`` in an ``srun`` session on a compute node (a hydra-submitit point keeping the default
    cluster is one too): the ranks start on this node, not through a nested srun that waits for CPUs
    the step holds."""
    d, job = slurm_run
    cmd = ["srun", f"--job-name={job}", "-n1", "-c4", f"--chdir={d}", sys.executable, "-m", "toolkit.launch",
           f"hydra.run.dir={d / 'run'}", "steps=1", "engine.time_scale=0.2", "cluster.ready_timeout_s=60"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "starting them again" not in out.stdout
    check_outputs(d / "run", steps=1, sessions=32)
    assert_no_process_left(d / "run")


def test_killing_a_replica_job_mid_step_loses_no_session(slurm_run: tuple[Path, str]) -> None:
    from toolkit.core.rundir import RunDir
    from toolkit.weights import publish

    d, job = slurm_run
    r = d / "run"
    weights, checkpoint = d / "weights", d / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    # On-policy: step 1 waits for weights version 1, so the run cannot end before launch has seen the
    # killed job and replaced it (waited on below); the steps after it run with the replacement there.
    proc = start_launch([f"hydra.run.dir={r}", f"job={job}", *FAST, "steps=3", "router.heartbeat_s=0.2",
                         f"rollout.weights_dir={weights}", "rollout.max_staleness=0", "rollout.weights_timeout_s=300"])
    try:
        with explained(proc, r):
            wait_for(lambda: (r / "steps" / "step_00000.json").exists(), 180, "the first step")
            victim = job_id(job, "replica-throughput", array_index=0)
            subprocess.run(["scancel", victim], check=True, timeout=30)
            wait_for(lambda: any(e["kind"] == "replica_restarted" for e in RunDir(r).read_events()), 120,
                     "launch to replace the killed replica")
    finally:
        for version in (1, 2):  # lets steps 1 and 2 run: the launch must still succeed
            publish(weights, version, checkpoint)
        output = finish(proc)
    assert proc.returncode == 0, output
    check_outputs(r, steps=3, sessions=32)  # every session exactly once, all completed
    report = json.loads((r / "report.json").read_text())
    assert report["summary"]["replica_restarts"] >= 1
    assert "CANCELLED" in accounting(victim)[victim]
    assert_no_process_left(r)


def test_a_requeued_replica_reregisters_and_the_run_goes_on(slurm_run: tuple[Path, str]) -> None:
    d, job = slurm_run
    r = d / "run"
    # Enough steps (under a second each here) for the requeued job to run again well before the last.
    proc = start_launch([f"hydra.run.dir={r}", f"job={job}", *FAST, "steps=30", "router.heartbeat_s=0.2"])
    try:
        with explained(proc, r):
            wait_for(lambda: (r / "steps" / "step_00000.json").exists(), 180, "the first step")
            victim = job_id(job, "replica-throughput", array_index=1)
            subprocess.run(["scontrol", "requeue", victim], check=True, timeout=30)
            # A requeued job waits ~2 minutes (its BeginTime) before it may run again; once it is back in
            # the queue, let it go sooner. Not at once: slurmd refuses to relaunch a job id it has just
            # killed ("already killed, do not launch batch job"), and the job would fail instead.
            wait_for(lambda: ("PENDING", "BeginTime") in pending(job), 60, "the job to be requeued")
            subprocess.run(["scontrol", "update", f"JobId={victim}", "StartTime=now+3"], check=True, timeout=30)
            wait_for(lambda: len(registrations(r, "throughput-1")) == 2, 120, "the requeued replica to register again")
            assert proc.poll() is None, "the run ended before the requeued replica came back"
    finally:
        output = finish(proc)
    assert proc.returncode == 0, output
    check_outputs(r, steps=30, sessions=32)
    report = json.loads((r / "report.json").read_text())
    assert report["summary"]["replica_restarts"] == 0  # the same job came back: nothing was replaced
    assert len(registrations(r, "throughput-1")) == 2
    assert_no_process_left(r)


def test_a_run_that_loses_its_router_job_restarts_it(slurm_run: tuple[Path, str]) -> None:
    d, job = slurm_run
    r = d / "run"
    proc = start_launch([f"hydra.run.dir={r}", f"job={job}", *FAST, "steps=3", "tail.threshold=0.9"])
    try:
        with explained(proc, r):
            wait_for(lambda: (r / "steps" / "step_00000.json").exists(), 180, "the first step")
            subprocess.run(["scancel", job_id(job, "router")], check=True, timeout=30)
    finally:
        output = finish(proc)
    assert proc.returncode == 0, output
    assert "restarting it" in output
    reports = check_outputs(r, steps=3, sessions=32)
    assert all(rep["flip"]["count"] == 29 for rep in reports)
    assert json.loads((r / "report.json").read_text())["summary"]["router_restarts"] == 1


def test_ctrl_c_cancels_every_job(slurm_run: tuple[Path, str]) -> None:
    d, job = slurm_run
    r = d / "run"
    proc = start_launch([f"hydra.run.dir={r}", f"job={job}", *FAST, "steps=100"])
    try:
        with explained(proc, r):
            wait_for(lambda: (r / "steps" / "step_00000.json").exists(), 180, "the first step")
            assert len(our_jobs(job)) == 5  # router, 2 + 1 replicas, ranks
            proc.send_signal(signal.SIGINT)
    finally:
        output = finish(proc, 120)
    assert proc.returncode == 130, output
    assert "interrupted" in output
    assert our_jobs(job) == []  # squeue: nothing of the run is left
    assert json.loads((r / "report.json").read_text())["status"] == "interrupted"
    assert_no_process_left(r)


def test_agents_over_http_on_slurm(slurm_run: tuple[Path, str]) -> None:
    """The ranks' gateways on a cluster: bound on every interface, advertising the node's name, admitting
    the run's token (CURVE is on), which the agents get from the rank's environment."""
    d, job = slurm_run
    out = launch([f"hydra.run.dir={d / 'run'}", f"job={job}", *FAST, "workload=agent", "steps=1",
                  "sessions_per_step=6", "workload.agent._target_=tests.helpers.agents_for_tests.openai_tools",
                  "+workload.agent.check_outsider=true"], timeout_s=300, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    r = d / "run"
    rows = pq.read_table(r / "steps" / "step_00000.parquet").to_pylist()
    assert len(rows) == 6 and all(x["status"] == "completed" and x["num_turns"] == 3 for x in rows), \
        [x["error"] for x in rows]
    urls = [json.loads(p.read_text())["url"] for p in sorted((r / "gateways").iterdir())]
    assert len(urls) == 2 and not any("127.0.0.1" in u or "0.0.0.0" in u for u in urls)
    assert our_jobs(job) == []


def test_a_failed_step_cancels_every_job(slurm_run: tuple[Path, str]) -> None:
    d, job = slurm_run
    out = launch([f"hydra.run.dir={d / 'run'}", f"job={job}", *FAST,
                  "workload.env._target_=tests.helpers.crashing_env.CrashOnSession", "+workload.env.crash_index=3",
                  "~workload.env.max_turns", "~workload.env.observation_tokens", "~workload.env.vocab_size",
                  "rollout.max_failed_fraction=0"],  # one failed sample is over this budget: the run fails
                 timeout_s=300, cwd=ROOT)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "rollout ranks exited" in out.stdout + out.stderr
    assert "more than rollout.max_failed_fraction = 0.0" in out.stdout + out.stderr
    assert our_jobs(job) == []
    assert_no_process_left(d / "run")


def test_readiness_is_bounded_and_names_the_stuck_job(slurm_run: tuple[Path, str]) -> None:
    d, job = slurm_run
    # Every job of the run may only start in an hour: the router job is the one stuck.
    out = launch([f"hydra.run.dir={d / 'run'}", f"job={job}", *FAST, "cluster.ready_timeout_s=5",
                  "cluster.extra_sbatch=['--begin=now+3600']"], timeout_s=120)
    assert out.returncode == 1, out.stdout + out.stderr
    text = out.stdout + out.stderr
    assert "router wrote no address in 5s" in text and "PENDING (BeginTime)" in text, text
    assert our_jobs(job) == []


def test_a_partition_the_cluster_does_not_have_fails_at_setup(slurm_run: tuple[Path, str]) -> None:
    """Named with the cluster's partitions, before the run dir is taken or a job submitted."""
    d, job = slurm_run
    out = launch([f"hydra.run.dir={d / 'run'}", f"job={job}", *FAST, "cluster.partition=nope"], timeout_s=120)
    text = out.stdout + out.stderr
    assert out.returncode == 2, text
    assert "cluster.partition = 'nope': one of the cluster's partitions: debug, multi" in text.replace("\n", " "), text
    assert not (d / "run" / "pids").exists() and not (d / "run" / "logs").exists() and our_jobs(job) == []


def test_the_sbatch_template_runs_the_whole_thing_as_steps(slurm_run: tuple[Path, str]) -> None:
    d, job = slurm_run
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    out = subprocess.run(
        ["sbatch", "--wait", "--parsable", f"--chdir={ROOT}", f"--output={d}/slurm-%j.out", f"--job-name={job}",
         str(ROOT / "slurm" / "rollout.sbatch"), f"hydra.run.dir={d / 'run'}", f"job={job}", "engine.time_scale=0.5",
         "report.log_interval_s=0.5"],
        capture_output=True, text=True, timeout=300, env=env)
    log = "".join(p.read_text() for p in d.glob("slurm-*.out"))
    assert out.returncode == 0, out.stdout + out.stderr + log
    r = d / "run"
    check_outputs(r, steps=2, sessions=32)
    assert (r / "router_stats.json").exists()  # the router step was stopped with SIGTERM, cleanly
    # The job's log is not a terminal: the running step's progress comes as plain lines.
    progress = [line for line in log.splitlines() if line.startswith("progress: step ")]
    assert progress and all("/32 sessions" in line and "in flight" in line for line in progress), log
    # Every component served its metrics on every interface, advertised by the node's name.
    for name in ("router", "replica-throughput-0", "replica-throughput-1", "replica-tail-0", "rank-0", "rank-1"):
        text = (r / "logs" / f"{name}.log").read_text()
        assert f"metrics on http://{socket.gethostname()}:" in text, (name, text[-2000:])
    assert json.loads((r / "prometheus_targets.json").read_text())  # launch listed them
    jid = out.stdout.strip().split(";")[0]
    states = accounting(jid)
    names = subprocess.run(["sacct", "-n", "-P", "-j", jid, "-o", "JobName"], capture_output=True, text=True,
                           timeout=30).stdout.split()
    assert {"router", "replica-throughput-0", "replica-throughput-1", "replica-tail-0", "ranks"} <= set(names)
    assert states[jid] == "COMPLETED", states
    assert_no_process_left(r)


def test_overrides_on_the_sbatch_line_that_outgrow_the_allocation_fail_at_setup(slurm_run: tuple[Path, str]) -> None:
    """The template holds 6 CPUs a node: a router of 8 would leave its step waiting for good. Named, with what
    the job holds, before the run dir is taken or a step started."""
    d, job = slurm_run
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    out = subprocess.run(
        ["sbatch", "--wait", "--parsable", f"--chdir={ROOT}", f"--output={d}/slurm-%j.out", f"--job-name={job}",
         str(ROOT / "slurm" / "rollout.sbatch"), f"hydra.run.dir={d / 'run'}", f"job={job}", "cluster.router_cpus=8"],
        capture_output=True, text=True, timeout=300, env=env)
    log = "".join(p.read_text() for p in d.glob("slurm-*.out"))
    assert out.returncode != 0, out.stdout + out.stderr + log
    assert "runs in an allocation of 13 CPUs a node for this config, not job" in log.replace("\n", " "), log
    assert not (d / "run" / "pids").exists() and not (d / "run" / "logs").exists()
    assert our_jobs(job) == []


def test_a_sweep_through_hydra_submitit_writes_the_summary(slurm_run: tuple[Path, str]) -> None:
    d, job = slurm_run
    sweep = d / "sweep"
    out = launch(["-m", "hydra/launcher=submitit_slurm", f"hydra.sweep.dir={sweep}", f"hydra.launcher.name={job}-sweep",
                  "hydra.launcher.array_parallelism=1", "hydra.launcher.timeout_min=20", "hydra.launcher.mem_gb=1",
                  f"job={job}", *FAST, "steps=1", "tail.threshold=0.8,0.9,0.95"], timeout_s=400)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "sweep summary (3 runs)" in out.stdout
    # The launcher returns once each job has written its result; the jobs then end by themselves.
    wait_for(lambda: not our_jobs(job), 60, "the sweep's jobs to leave the queue")
    rows = list(csv.DictReader((sweep / "sweep_summary.csv").open()))
    assert [row["overrides"] for row in rows] == [f"tail.threshold={t}" for t in ("0.8", "0.9", "0.95")]
    assert all(row["status"] == "ok" for row in rows)
    # Flip point: ceil(threshold * 32) sessions done.
    assert [float(row["flip_count"]) for row in rows] == [26.0, 29.0, 31.0]
    for row in rows:
        assert float(row["step_time_s"]) > 0 and 0 <= float(row["spillover"]) <= 1
        assert 0 <= float(row["prefix_hit_rate"]) <= 1


@pytest.mark.vllm
@pytest.mark.timeout(900)  # two vLLM boots, then a third; beside the vLLM tests' worker over 420 s
def test_a_vllm_replica_spans_two_slurm_nodes_and_a_lost_node_replaces_it(slurm_run: tuple[Path, str]) -> None:
    """The dev cluster's `multi` partition: two nodes emulated on this host by two slurmd. One replica of
    tensor parallel 2 is one job of two nodes: node rank 0 serves the engine, node rank 1 runs vLLM's
    headless worker, and they meet at the address node rank 0 publishes in the run dir. Node rank 1's
    processes killed after the first step (a lost node): the job ends, launch submits a replacement,
    and no session is lost."""
    if not os.environ.get("TOOLKIT_REQUIRE_VLLM"):
        pytest.importorskip("vllm")
    d, job = slurm_run
    r = d / "run"

    proc = start_launch([f"hydra.run.dir={r}", f"job={job}", "cluster=slurm", "engine=vllm", "model=tiny",
                         f"engine.cache_dir={d / 'cache'}", "groups=single", "engine.tensor_parallel_size=2",
                         "+cluster.group_resources.throughput.nodes=2",
                         "+cluster.group_resources.throughput.partition=multi", "ranks=1", "steps=3",
                         "sessions_per_step=4"])
    killed = []
    try:
        with explained(proc, r):
            killed = lose_node_rank(r, 400, proc)
    finally:
        output = finish(proc, 500)
    assert proc.returncode == 0, output[-5000:]
    assert len(killed) >= 2
    check_outputs(r, steps=3, sessions=4)
    # Two node ranks on the two nodes of one job; node rank 1's worker joined node rank 0's engine, twice.
    log1 = (r / "logs" / "replica-throughput-0-node1.log").read_text()
    assert "node rank 1 of 2" in log1 and log1.count("1 worker(s) up") >= 2, log1[-3000:]
    masters = list((r / "replicas").glob("replica-throughput-0.*.master.json"))
    assert len(masters) >= 2 and all(json.loads(m.read_text())["addr"] for m in masters)
    jobs = [j for j, name in _job_names(job) if name.endswith("replica-throughput")]
    assert len(jobs) >= 2, jobs  # the first job and its replacement
    for jid in jobs:
        nodes = subprocess.run(["sacct", "-n", "-X", "-P", "-j", jid, "-o", "NNodes"], capture_output=True,
                               text=True, timeout=30).stdout.split()
        assert nodes == ["2"], (jid, nodes)
    report = json.loads((r / "report.json").read_text())
    assert report["summary"]["replica_restarts"] >= 1
    # The jobs are gone from the queue; vLLM's engine core, reparented, exits a moment after its replica.
    wait_for(lambda: not [p for p in read_pidfiles(r / "pids") if p.alive()], 30, "the engine processes to exit")
    assert_no_process_left(r)


def test_a_replica_whose_first_node_is_lost_ends_on_every_node_and_is_replaced(slurm_run: tuple[Path, str]) -> None:
    """A sim replica of two nodes (partition `multi`): node rank 1 only holds its node, watching node rank
    0's beacon. Node rank 0 killed after the first step (a lost first node): node rank 1 exits by itself,
    the job ends, launch submits a replacement, and no session is lost."""
    d, job = slurm_run
    r = d / "run"
    proc = start_launch([f"hydra.run.dir={r}", f"job={job}", *FAST, "groups=single", "ranks=1", "steps=3",
                         "sessions_per_step=8", "router.heartbeat_s=0.2", "+cluster.group_resources.throughput.nodes=2",
                         "+cluster.group_resources.throughput.partition=multi"])

    def node(name: str) -> list:  # type: ignore[type-arg]
        return [p for p in read_pidfiles(r / "pids") if p.name == name and p.alive()]

    try:
        with explained(proc, r):
            wait_for(lambda: node("replica-throughput-0-node1") and (r / "steps" / "step_00000.json").exists(), 180,
                     "the first step with node rank 1 up")
            first, holder = node("replica-throughput-0")[0], node("replica-throughput-0-node1")[0]
            os.kill(first.pid, signal.SIGKILL)
            wait_for(lambda: not holder.alive(), 60, "node rank 1 to end with node rank 0")
    finally:
        output = finish(proc, 300)
    assert proc.returncode == 0, output[-5000:]
    check_outputs(r, steps=3, sessions=8)
    log1 = (r / "logs" / "replica-throughput-0-node1.log").read_text()
    assert "is gone: releasing the node" in log1, log1[-3000:]
    jobs = [j for j, name in _job_names(job) if name.endswith("replica-throughput")]
    assert len(jobs) >= 2, jobs  # the first job and its replacement
    assert json.loads((r / "report.json").read_text())["summary"]["replica_restarts"] >= 1
    assert_no_process_left(r)


def _job_names(job: str) -> list[tuple[str, str]]:
    """(job id, name) of every job of the run, from accounting (they have ended)."""
    out = subprocess.run(["sacct", "-n", "-X", "-P", "-S", "now-1hour", "-o", "JobID,JobName"], capture_output=True,
                         text=True, timeout=30, check=True)
    return [tuple(line.split("|")[:2]) for line in out.stdout.splitlines() if job in line]  # type: ignore[misc]
