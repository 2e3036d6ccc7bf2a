"""cluster=slurm / cluster=allocation without a Slurm: config typing and validation, the rule for
node-local run dirs, node roles of multi-node replicas."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from toolkit.cluster.slurm import job_identity, node_role, outside_job
from toolkit.cluster.storage import mount_of, node_local_reason
from toolkit.config import (
    ConfigError,
    SlurmClusterConfig,
    compose_config,
    curve_enabled,
    load_run_config,
    replica_nodes,
    replica_resources,
    save_run_config,
)
from toolkit.core.sockets import advertised, bind_host
from toolkit.launch.validation import validate

MOUNTS = """\
/dev/vda / ext4 rw,relatime 0 0
tmpfs /dev/shm tmpfs rw 0 0
tmpfs /scratch/ram tmpfs rw 0 0
nas:/export/home /home nfs4 rw,vers=4.2 0 0
lustre@o2ib:/fs /lustre lustre rw 0 0
/dev/nvme0n1 /local xfs rw 0 0
"""


def test_cluster_is_typed_by_its_type_and_survives_the_run_dir(tmp_path: Path) -> None:
    cfg = compose_config(["cluster=slurm", "cluster.partition=gpu", "+cluster.group_resources.tail.gpus=2"])
    validate(cfg)
    assert isinstance(cfg.cluster, SlurmClusterConfig) and cfg.cluster.type == "slurm"
    assert replica_resources(cfg, "tail").gpus == 2 and replica_resources(cfg, "throughput").gpus == 0
    save_run_config(cfg, tmp_path / "config.yaml")
    again = load_run_config(tmp_path)
    assert again.cluster == cfg.cluster
    assert type(compose_config(["cluster=allocation"]).cluster) is SlurmClusterConfig
    assert type(compose_config([]).cluster).__name__ == "ClusterConfig"


def test_slurm_fields_are_validated_all_at_once() -> None:
    cfg = compose_config([
        "cluster=slurm", "cluster.replica.mem=lots", "cluster.replica.nodes=0", "+cluster.group_resources.nope.gpus=1",
        "+cluster.group_resources.tail.flops=3", "cluster.extra_sbatch=['reservation=rl']", "cluster.cache_dir=rel/dir",
        "cluster.router_cpus=0",
    ])
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    fields = {e.field for e in info.value.errors}
    assert {"cluster.replica.mem", "cluster.replica.nodes", "cluster.group_resources.nope",
            "cluster.group_resources.tail.flops", "cluster.extra_sbatch[0]", "cluster.cache_dir",
            "cluster.router_cpus"} <= fields


def test_curve_and_bind_defaults_follow_the_cluster() -> None:
    local, slurm = compose_config([]), compose_config(["cluster=slurm"])
    assert not curve_enabled(local) and curve_enabled(slurm)
    assert not curve_enabled(compose_config(["cluster=slurm", "router.curve=false"]))
    assert bind_host(None, "local") == "127.0.0.1" and bind_host(None, "slurm") == "0.0.0.0"
    assert bind_host("10.0.0.5", "slurm") == "10.0.0.5"
    addr = advertised("tcp://0.0.0.0:5555")
    assert addr.startswith("tcp://") and addr.endswith(":5555") and "0.0.0.0" not in addr
    assert advertised("tcp://127.0.0.1:5555") == "tcp://127.0.0.1:5555"


@pytest.mark.parametrize(("path", "nodes", "refused"), [
    ("/tmp/run", 1, "temporary directory /tmp"),
    ("/var/tmp/x/run", 1, "temporary directory /var/tmp"),
    ("/dev/shm/run", 1, "temporary directory /dev/shm"),
    ("/scratch/ram/run", 1, "tmpfs (memory) file system"),
    ("/job-tmp/run", 1, "temporary directory /job-tmp"),  # $TMPDIR of the job
    ("/home/me/runs", 64, None),
    ("/lustre/proj/runs", 64, None),
    ("/local/runs", 64, "local xfs file system"),
    ("/work/runs", 64, "local ext4 file system"),
    ("/work/runs", 1, None),  # a single-node cluster: local disk is every node's disk
])
def test_node_local_storage_rule(path: str, nodes: int, refused: str | None) -> None:
    temps = ["/tmp", "/var/tmp", "/dev/shm", "/run", "/job-tmp"]
    reason = node_local_reason(Path(path), MOUNTS, temps, nodes)
    if refused is None:
        assert reason is None
    else:
        assert reason is not None and refused in reason
    assert mount_of(Path("/home/me"), MOUNTS) == ("/home", "nfs4")


def test_a_run_dir_in_tmp_is_refused_before_anything_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """launch's preflight (before it writes or starts anything; a ConfigError there is launch's exit 2,
    tests/integration/test_config.py) on a Slurm of one host (sinfo's answer)."""
    import toolkit.cluster
    from toolkit.cluster import preflight

    monkeypatch.setattr(toolkit.cluster, "cluster_nodes", lambda partition: 1)
    run = tmp_path / "run"
    cfg = compose_config(["cluster=slurm"])
    validate(cfg)
    with pytest.raises(ConfigError) as info:
        preflight(cfg, run)
    text = str(info.value)
    assert "hydra.run.dir" in text and "node-local storage" in text and "cluster.shared_fs_check=false" in text
    assert not run.exists()


def test_node_roles_of_a_multi_node_replica(monkeypatch: pytest.MonkeyPatch) -> None:
    from toolkit.cluster import slurm as slurm_mod

    # ``scontrol show hostnames`` expands a node list (on a real Slurm: tests/cluster/test_slurm.py).
    monkeypatch.setattr(slurm_mod, "hostnames", lambda nodelist: nodelist.split(","))
    base = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NODELIST": "gpu7"}
    role = node_role({**base, "SLURM_NODEID": "0"})
    assert role["TOOLKIT_NODE_RANK"] == "0" and role["TOOLKIT_NNODES"] == "1"
    assert role["TOOLKIT_MASTER_ADDR"] == "gpu7"
    other = node_role({**base, "SLURM_NODEID": "1", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NODELIST": "gpu7,gpu9"})
    assert other["TOOLKIT_NODE_RANK"] == "1" and other["TOOLKIT_MASTER_ADDR"] == "gpu7"
    assert "TOOLKIT_MASTER_PORT" not in other  # node rank 0 picks it when it starts (test_node_rendezvous.py)


def test_gpus_per_node_and_tensor_x_pipeline_parallel_place_a_replica() -> None:
    # 8-GPU nodes: tensor parallel 2 fits one node (2 GPUs); 8 x 2 = 16 spans two nodes of 8.
    cfg = compose_config(["cluster=slurm", "engine=vllm", "engine.tensor_parallel_size=2", "cluster.gpus_per_node=8",
                          "groups.tail.engine.tensor_parallel_size=8", "+groups.tail.engine.pipeline_parallel_size=2"])
    validate(cfg)
    thr, tail = replica_resources(cfg, "throughput"), replica_resources(cfg, "tail")
    assert (thr.gpus, thr.nodes) == (2, 1) and (tail.gpus, tail.nodes) == (8, 2)
    assert replica_nodes(cfg, "tail") == 2
    # Locally (vLLM's CPU build): one device per node rank makes a tensor-parallel-2 replica two processes.
    local = compose_config(["engine=vllm", "groups=single", "engine.tensor_parallel_size=2", "cluster.gpus_per_node=1"])
    validate(local)
    assert replica_nodes(local, "throughput") == 2
    assert replica_nodes(compose_config(["engine=vllm", "groups=single", "engine.tensor_parallel_size=2"]),
                         "throughput") == 1  # gpus_per_node 0: one node


def test_a_replica_shape_that_does_not_divide_the_nodes_is_a_setup_error() -> None:
    cfg = compose_config(["cluster=slurm", "engine=vllm", "cluster.gpus_per_node=4", "engine.tensor_parallel_size=2",
                          "groups.tail.engine.tensor_parallel_size=3", "+groups.tail.engine.pipeline_parallel_size=2",
                          "+cluster.group_resources.throughput.nodes=2"])
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    errors = {e.field: e for e in info.value.errors}
    assert set(errors) == {"groups.tail.engine", "cluster.group_resources.throughput.nodes"}, errors
    tail = str(errors["groups.tail.engine"])
    assert "tensor_parallel_size 3 x pipeline_parallel_size 2 = 6" in tail and "cluster.gpus_per_node = 4" in tail
    assert "1 (or unset)" in str(errors["cluster.group_resources.throughput.nodes"])


def test_a_group_on_its_own_preemptible_partition(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from toolkit import cluster as cluster_pkg
    from toolkit.cluster import slurm as slurm_mod
    from toolkit.core.lifecycle import ProcessRef
    from toolkit.core.rundir import RunDir

    cfg = compose_config(["cluster=slurm", "cluster.partition=gpu", "+cluster.group_resources.tail.partition=spot",
                          "+cluster.group_resources.tail.requeue=false"])
    validate(cfg)
    assert replica_resources(cfg, "tail").partition == "spot" and not replica_resources(cfg, "tail").requeue
    monkeypatch.setattr(slurm_mod, "need", lambda tool: tool)  # no Slurm needed to build the executors
    monkeypatch.setattr(slurm_mod.submitit.SlurmExecutor, "affinity", classmethod(lambda cls: 2))  # (submitit's srun check)
    c = cluster_pkg.make_cluster(cfg, RunDir(tmp_path), ProcessRef.self())
    assert isinstance(c, slurm_mod.SlurmCluster)
    tail = c._replica_executor("tail").parameters
    main = c._replica_executor("throughput").parameters
    assert tail["partition"] == "spot" and tail["additional_parameters"].get("no_requeue") is True
    assert main["partition"] == "gpu" and main["additional_parameters"].get("requeue") is True
    # One allocation has one partition: a group's own is refused there, naming the field.
    bad = compose_config(["cluster=allocation", "+cluster.group_resources.tail.partition=spot"])
    with pytest.raises(ConfigError, match=r"cluster.group_resources.tail.partition = 'spot'"):
        validate(bad)


def test_submitting_hides_the_job_it_runs_in_but_keeps_the_users_sbatch_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside a job (a sweep through hydra-submitit-launcher) the job's identity must not reach the
    jobs it submits; the user's SBATCH_ACCOUNT, SBATCH_QOS... are what sbatch should use, there and
    on a login node."""
    import os

    settings = {"SBATCH_ACCOUNT": "proj42", "SBATCH_PARTITION": "gpu", "SBATCH_QOS": "high",
                "SBATCH_RESERVATION": "hack", "SLURM_CLUSTERS": "c1", "SLURM_CONF": "/etc/slurm/slurm.conf",
                "SRUN_CPUS_PER_TASK": "8"}
    job = {"SLURM_JOB_ID": "77", "SLURM_ARRAY_JOB_ID": "76", "SLURM_NODELIST": "n[1-2]", "SUBMITIT_FOLDER": "/x",
           "SBATCH_MEM_BIND": "local", "SBATCH_MEM_BIND_TYPE": "local"}  # sbatch's outputs for its --mem-bind
    assert job_identity(settings) == []
    assert sorted(job_identity({**settings, **job})) == sorted(job)
    for k, v in {**settings, **job}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("SBATCH_EXPORT", "NONE")  # a site's default: the jobs would miss the run's environment
    with outside_job():
        assert all(os.environ.get(k) == v for k, v in settings.items())
        assert not any(k in os.environ for k in job) and "SBATCH_EXPORT" not in os.environ
    assert all(os.environ.get(k) == v for k, v in {**settings, **job, "SBATCH_EXPORT": "NONE"}.items())


class FakeSlurm:
    """squeue/sacct/scancel answers for toolkit.core.slurmctl, set per test step."""

    def __init__(self) -> None:
        self.squeue: str | None = ""  # None: the controller does not answer (a timeout)
        self.sacct: str | None = ""  # None: no accounting on this site
        self.cancelled: list[list[str]] = []
        self.calls: list[str] = []
        self.on_call: Callable[[], None] = lambda: None
        self.scontrol: Callable[[list[str]], object] = lambda args: None

    def run(self, args: list[str], **kw) -> object:  # type: ignore[no-untyped-def]
        import subprocess

        tool = args[0]
        self.calls.append(tool)
        self.on_call()
        if tool == "scancel":
            self.cancelled.append(args[1:])
            return subprocess.CompletedProcess(args, 0, "", "")
        if tool == "scontrol":
            return self.scontrol(args)
        out = self.squeue if tool == "squeue" else self.sacct
        if out is None:
            if tool == "squeue":
                raise subprocess.TimeoutExpired(args, 30)
            return subprocess.CompletedProcess(args, 1, "", "sacct: error: Slurm accounting storage is disabled")
        return subprocess.CompletedProcess(args, 0, out, "")


@pytest.fixture
def slurm(monkeypatch: pytest.MonkeyPatch) -> FakeSlurm:
    import toolkit.core.slurmctl as ctl

    fake = FakeSlurm()
    monkeypatch.setattr(ctl.subprocess, "run", fake.run)
    monkeypatch.setattr(ctl, "need", lambda tool: tool)
    return fake


def test_a_controller_that_does_not_answer_changes_no_jobs_state(slurm: FakeSlurm) -> None:
    """A squeue past its timeout, or failing, is a hiccup: a running job stays running (it used to be
    UNKNOWN, which counted as pending, and ended a healthy run as 'did not start'), and a job that
    finished stays finished once squeue forgets it, where there is no accounting."""
    from toolkit.core.slurmctl import JobStates

    states = JobStates(poll_s=0)
    for job in ("1", "2", "3"):
        states.watch(job)
    slurm.squeue = "1|RUNNING|None\n2|RUNNING|None\n3|PENDING|Priority\n"
    assert [states.get(j).state for j in "123"] == ["RUNNING", "RUNNING", "PENDING"]
    slurm.squeue = None
    assert [states.get(j).state for j in "123"] == ["RUNNING", "RUNNING", "PENDING"]
    # While squeue fails, accounting still says who ended; not who is live (a lagging slurmdbd may
    # still call a running job pending, which would end the run as "ranks did not start").
    slurm.sacct = "1|PENDING|0:0\n2|CANCELLED by 0|0:15\n"
    assert [states.get(j).state for j in "123"] == ["RUNNING", "CANCELLED", "PENDING"]
    slurm.sacct = ""
    slurm.sacct = None  # and no accounting: squeue's own terminal states tell how they ended
    states.watch("4")
    slurm.squeue = "1|COMPLETED|None\n4|FAILED|NonZeroExitCode\n3|RUNNING|None\n"
    assert [(states.get(j).state, states.get(j).exit_code) for j in "14"] == [("COMPLETED", 0), ("FAILED", 1)]
    slurm.squeue = ""  # squeue forgot them (MinJobAge), and job 3 vanished while running
    assert [(states.get(j).state, states.get(j).live, states.get(j).exit_code) for j in "1234"] == [
        ("COMPLETED", False, 0), ("CANCELLED", False, 143), ("UNKNOWN_END", False, 1), ("FAILED", False, 1)]


def test_a_job_that_ended_for_good_is_not_asked_about_again(slurm: FakeSlurm) -> None:
    """A run that replaces jobs over days asked squeue and sacct about every one of them every poll."""
    from toolkit.core.slurmctl import JobStates

    states = JobStates(poll_s=0)
    for job in ("1", "2"):
        states.watch(job)
    slurm.squeue, slurm.sacct = "2|RUNNING|None\n", "1|COMPLETED|0:0\n"
    assert (states.get("1").state, states.get("2").state) == ("COMPLETED", "RUNNING")
    slurm.calls.clear()
    for _ in range(5):
        assert states.get("1").state == "COMPLETED"
    assert slurm.calls.count("sacct") == 0  # job 2 is listed live: only squeue, and nothing about job 1
    slurm.squeue = ""
    slurm.sacct = "2|PREEMPTED|0:15\n"  # requeued by Slurm: not an end for good, still asked about
    states.get("2")
    slurm.calls.clear()
    states.get("2")
    assert slurm.calls == ["squeue", "sacct"]


def test_a_slow_controller_is_asked_once_a_poll_for_every_job(slurm: FakeSlurm, monkeypatch: pytest.MonkeyPatch) -> None:
    """squeue and sacct taking longer than ``poll_s`` (a loaded slurmctld) must not make every job's
    look-up query them again: a pass over the run's jobs costs one squeue, not one per job."""
    import toolkit.core.slurmctl as ctl

    clock = [100.0]
    monkeypatch.setattr(ctl.time, "monotonic", lambda: clock[0])
    slurm.on_call = lambda: clock.__setitem__(0, clock[0] + 1.2)
    states = ctl.JobStates(poll_s=1.0)
    for job in "123":
        states.watch(job)
    slurm.squeue = "1|RUNNING|None\n2|RUNNING|None\n3|RUNNING|None\n"
    assert [states.get(j).state for j in "123"] == ["RUNNING"] * 3
    assert slurm.calls == ["squeue"]


def test_a_requeue_the_controller_answered_late_is_not_asked_again(slurm: FakeSlurm,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """``scontrol requeue`` past its timeout may still have been done: asked again, the controller says
    no (the job is requeued already) and the run would be reported as not coming back. The job's
    restart count tells; a requeue that was not done is asked again, and a refusal is the answer."""
    import subprocess

    import toolkit.core.slurmctl as ctl

    monkeypatch.setattr(ctl.time, "sleep", lambda s: None)
    restarts, asked = [2], []

    def scontrol(args: list[str]) -> object:
        if args[1] == "show":
            return subprocess.CompletedProcess(args, 0, f"JobId=9 JobName=rollout\n   Restarts={restarts[0]} "
                                                        f"BatchFlag=1 Reboot=0 ExitCode=0:0\n", "")
        asked.append(args[2])
        if len(asked) == 1:  # done, but the answer came too late
            restarts[0] += 1
            return subprocess.CompletedProcess(args, -1, "", "no answer within 30s")
        return subprocess.CompletedProcess(args, 1, "", "scontrol: error: Job is pending execution")

    slurm.scontrol = scontrol
    assert ctl.requeue("9") == "" and asked == ["9"]
    asked.clear()
    restarts[0] = 2

    def never_done(args: list[str]) -> object:
        if args[1] == "show":
            return subprocess.CompletedProcess(args, 0, "JobId=9 Restarts=2 BatchFlag=1\n", "")
        asked.append(args[2])
        return subprocess.CompletedProcess(args, -1 if len(asked) == 1 else 1, "", f"try {len(asked)}")

    slurm.scontrol = never_done
    assert ctl.requeue("9") == "try 2" and asked == ["9", "9"]


def test_teardown_never_takes_a_failed_squeue_for_jobs_gone_and_cancels_again(slurm: FakeSlurm,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import toolkit.core.slurmctl as ctl

    clock = [0.0]
    monkeypatch.setattr(ctl.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(ctl.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    slurm.squeue = None
    assert ctl.wait_gone(["7"], timeout_s=5) == ["7"]  # nothing known: still there at the timeout
    slurm.squeue = "7|RUNNING|None\n"
    assert ctl.wait_gone(["7"], timeout_s=25, signal="KILL") == ["7"]
    assert slurm.cancelled == [["--signal", "KILL", "7"], ["--signal", "KILL", "7"]]  # every 10 s
    slurm.squeue = "7|COMPLETED|None\n"
    assert ctl.wait_gone(["7"], timeout_s=25) == []


def test_ranks_that_slurm_ended_interrupt_the_run_rather_than_fail_it(slurm: FakeSlurm) -> None:
    """The ranks' job at cluster.job_timeout_min, preempted, or on a lost node: resume=true continues
    the run (launch exits 75, Interrupted); a job that failed on its own fails it."""
    from types import SimpleNamespace

    from toolkit.cluster.slurm import SlurmJobComponent
    from toolkit.core.slurmctl import JobStates

    def ranks(sacct: str) -> SlurmJobComponent:
        slurm.sacct = sacct
        return SlurmJobComponent("ranks", SimpleNamespace(job_id="5"), JobStates(poll_s=0))

    timeout = ranks("5|TIMEOUT|0:0\n")
    assert timeout.exit_code() == 1 and timeout.interrupted() == "Slurm ended job 5 (ranks): TIMEOUT"
    assert "PREEMPTED" in ranks("5|PREEMPTED|0:15\n").interrupted()
    failed = ranks("5|FAILED|1:0\n")
    assert failed.exit_code() == 1 and failed.interrupted() == ""


def test_a_signal_grace_the_time_limit_cannot_hold_is_a_setup_error() -> None:
    """``--signal=B:USR1@N`` with N at or past the job's limit signals at the start (an endless requeue);
    sbatch refuses N above 65535."""
    from toolkit.core.errors import ConfigError

    for over in (["cluster.job_timeout_min=2", "cluster.signal_grace_s=180"], ["cluster.signal_grace_s=70000"]):
        with pytest.raises(ConfigError, match=r"cluster.signal_grace_s = \d+: below cluster.job_timeout_min"):
            validate(compose_config(["cluster=allocation", *over]))
    validate(compose_config(["cluster=allocation", "cluster.job_timeout_min=4", "cluster.signal_grace_s=180"]))
    # cluster=slurm: job_timeout_min limits the components' jobs; launch's own job (if any) is the user's.
    validate(compose_config(["cluster=slurm", "cluster.job_timeout_min=2", "cluster.signal_grace_s=180"]))


def test_a_resume_forgets_the_earlier_launches_job_ids_once_they_are_gone(slurm: FakeSlurm, tmp_path: Path) -> None:
    """Slurm reuses job ids (a wrap, a wiped state): ids kept forever would have a later resume cancel
    someone else's job."""
    from toolkit.core.rundir import RunDir
    from toolkit.launch.resume import cancel_leftovers

    rd = RunDir(tmp_path / "run")
    rd.make()
    rd.jobs(1).parent.mkdir(parents=True, exist_ok=True)
    rd.jobs(1).write_text("11\n12\n")
    rd.jobs(2).write_text("21\n")
    slurm.squeue = ""  # none of them is queued
    cancel_leftovers(rd, 2)
    assert slurm.cancelled == [["11", "12"]]
    assert not rd.jobs(1).exists() and rd.jobs(2).read_text() == "21\n"
    cancel_leftovers(rd, 3)  # the next resume cancels only what the launch after them recorded
    assert slurm.cancelled[1:] == [["21"]]


def test_ranks_that_cannot_be_stopped_are_reported_not_doubled(slurm: FakeSlurm, monkeypatch: pytest.MonkeyPatch) -> None:
    """The MPI_Init retry starts the ranks again only once the stuck ones are gone: a controller that
    does not answer leaves them listed as running after the cancel and the kill, and a second set would
    write the same steps beside them."""
    from types import SimpleNamespace

    import toolkit.core.slurmctl as ctl
    from toolkit.cluster.slurm import SlurmJobComponent
    from toolkit.core.slurmctl import JobStates

    clock = [100.0]  # the time module's own clock and sleep (Component.stop's waits)
    monkeypatch.setattr(ctl.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(ctl.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    states = JobStates(poll_s=0)
    ranks = SlurmJobComponent("ranks", SimpleNamespace(job_id="5"), states)
    slurm.squeue = "5|RUNNING|None\n"
    assert ranks.alive()
    slurm.squeue = None  # the controller stops answering: the job stays as last seen
    assert not ranks.stop(wait_s=5)
    assert slurm.cancelled == [["5"], ["--signal", "KILL", "5"]]
    slurm.squeue = "5|CANCELLED|None\n"
    assert ranks.stop(wait_s=5)


def test_a_vllm_replica_gets_the_gpus_its_parallel_sizes_use() -> None:
    """Without ``cluster.gpus_per_node`` a group's GPUs are as given: they must be what its tensor x
    pipeline parallel size uses (the default tail group has TP 2), or the replica fails after its wait in
    the queue. vLLM's CPU build (0 GPUs) is not held to it."""
    from toolkit.config import compose_config
    from toolkit.launch.validation import validate

    with pytest.raises(ConfigError) as info:
        validate(compose_config(["cluster=slurm", "engine=vllm", "cluster.replica.gpus=1"]))
    assert [e.field for e in info.value.errors] == ["cluster.group_resources.tail.gpus"]
    assert "+cluster.group_resources.tail.gpus=2" in str(info.value)
    validate(compose_config(["cluster=slurm", "engine=vllm", "cluster.replica.gpus=1", "+cluster.group_resources.tail.gpus=2"]))
    validate(compose_config(["cluster=slurm", "engine=vllm"]))  # (0 GPUs)


def test_the_machine_is_checked_before_the_run_dir_is_claimed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``cluster=allocation`` outside an allocation, or ``cluster=slurm`` without sbatch: errors at setup (found
    after the run dir was claimed, a corrected command was refused as "already holds a run")."""
    from toolkit.cluster import preflight
    from toolkit.config import compose_config

    for var in ("SLURM_JOB_ID", "SLURM_JOB_NODELIST"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ConfigError) as info:
        preflight(compose_config(["cluster=allocation", "cluster.shared_fs_check=false"]), tmp_path / "run")
    assert "inside an sbatch allocation" in str(info.value)
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch here
    with pytest.raises(ConfigError) as info:
        preflight(compose_config(["cluster=slurm", "cluster.shared_fs_check=false"]), tmp_path / "run")
    assert "sbatch on PATH" in str(info.value)
    assert not (tmp_path / "run").exists()


def test_a_partition_the_cluster_does_not_have_is_an_error_at_setup() -> None:
    """Every field that names one, each of a list (found at the first sbatch, it left a run dir behind); the
    cluster's partitions as sinfo gives them (the real cluster's answer: tests/cluster/test_slurm.py)."""
    from toolkit.cluster import partition_errors
    from toolkit.config import SlurmClusterConfig, compose_config

    def errors(*overrides: str) -> list[tuple[str, object]]:
        c = compose_config(["cluster=slurm", *overrides]).cluster
        assert isinstance(c, SlurmClusterConfig)
        return [(e.field, e.value) for e in partition_errors(c, ["debug", "multi"])]

    assert errors("cluster.partition=gpu", "cluster.replica.partition=multi",
                  "+cluster.group_resources.tail.partition='multi,cpu'") == [
        ("cluster.partition", "gpu"), ("cluster.group_resources.tail.partition", "cpu")]
    assert errors("cluster.partition=debug", "+cluster.group_resources.tail.partition=multi") == []
    c = compose_config(["cluster=slurm", "cluster.partition=gpu"]).cluster
    assert isinstance(c, SlurmClusterConfig)
    assert "one of the cluster's partitions: debug, multi" in str(partition_errors(c, ["debug", "multi"])[0])


def test_an_allocation_smaller_than_its_configs_plan_is_an_error_at_setup() -> None:
    """Overrides on the sbatch line that the rendered #SBATCH lines were not made for (more replicas, more
    CPUs or memory a replica): each shortfall named, from the job's own environment, before any step waits
    for resources the job will never have."""
    from toolkit.cluster.allocation import allocation_problems, plan_allocation
    from toolkit.config import compose_config

    cfg = compose_config(["cluster=allocation", "groups.throughput.replicas=3"])
    plan = plan_allocation(cfg)
    cpus, mem = max(plan.node_cpus()), max(plan.node_mem_mb())
    job = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "n1", "SLURM_JOB_NUM_NODES": str(plan.nodes)}
    assert allocation_problems(cfg, {**job, "SLURM_CPUS_ON_NODE": str(cpus), "SLURM_MEM_PER_NODE": str(mem)}) == []
    assert allocation_problems(cfg, job) == []  # a job that does not say its CPUs or memory: nothing to compare
    short = allocation_problems(cfg, {**job, "SLURM_CPUS_ON_NODE": str(cpus - 1), "SLURM_MEM_PER_NODE": str(mem - 1),
                                      "SLURM_JOB_NUM_NODES": "0"})
    assert short == [
        f"in an allocation of {plan.nodes} node(s) for this config, not job 42's 0 (python -m toolkit.launch.sbatch "
        "renders one for it)",
        f"in an allocation of {cpus} CPUs a node for this config, not job 42's {cpus - 1} (python -m "
        "toolkit.launch.sbatch renders one for it)",
        f"in an allocation of {mem} MB of memory a node for this config, not job 42's {mem - 1} (python -m "
        "toolkit.launch.sbatch renders one for it)"]
    fewer = compose_config(["cluster=allocation", "groups.throughput.replicas=1"])
    assert max(plan_allocation(fewer).node_cpus()) < cpus  # the same job holds a smaller config
    assert allocation_problems(fewer, {**job, "SLURM_CPUS_ON_NODE": str(cpus - 1)}) == []
