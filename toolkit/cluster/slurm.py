"""``cluster=slurm``: every component a Slurm job, submitted with submitit's SlurmExecutor.

- the router: a small CPU job;
- each engine group: one job array, one array task per replica (``replica.gpus`` GPUs per node,
  ``replica.nodes`` nodes per replica: every node of a replica gets its node rank and the master
  address); a replaced or added replica is a single job of the same shape;
- the rollout ranks: one MPI job, ``srun --mpi=pmi2`` (``cluster.mpi``), one task per rank.

Components run on other nodes, so they do not watch the launch process (``owner=None``) and are
never signalled by pid: teardown is ``scancel`` of every job the run submitted, and waits until
``squeue`` no longer lists them. A requeued or preempted-and-requeued job stays the same component
(its states are live ones); when it runs again its process registers with the router anew.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shlex
import socket
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import submitit

from toolkit.cluster.base import Cluster, Component, submitit_outputs
from toolkit.config import Config, SlurmClusterConfig, replica_resources
from toolkit.core.errors import ComponentFailed
from toolkit.core.lease import current_epoch
from toolkit.core.lifecycle import ProcessRef
from toolkit.core.names import process_name
from toolkit.core.rundir import RunDir
from toolkit.core.slurmctl import JobStates, hostnames, need, scancel, wait_gone
from toolkit.engine.node_role import NodeRole
from toolkit.engine.nodes import serve_node
from toolkit.rollout import worker
from toolkit.router import process as router_process

logger = logging.getLogger(__name__)

_SLURM_ENDS = frozenset({"TIMEOUT", "PREEMPTED", "NODE_FAIL", "DEADLINE"})
"""End states Slurm chose, not the job's code (cluster.job_timeout_min, a preemption, a node lost)."""
_SITE_INPUTS = ("SLURM_CONF", "SLURM_CLUSTERS")
"""``SLURM_*`` variables that are the site's or the user's settings, not a job's identity."""


def cache_dir(cfg: Config, run_dir: RunDir) -> Path:
    c = cfg.cluster
    assert isinstance(c, SlurmClusterConfig)
    return Path(c.cache_dir) if c.cache_dir else run_dir.cache


def cache_env(cache: Path) -> dict[str, str]:
    """Compile caches under one shared dir: a replica started later (replacement, scale-up) on
    another node finds the kernels and graphs the first ones compiled."""
    return {
        "VLLM_CACHE_ROOT": str(cache / "vllm"),
        "TRITON_CACHE_DIR": str(cache / "triton"),
        "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
    }


def job_identity(env: Mapping[str, str]) -> list[str]:
    """The variables of ``env`` that say which job it runs in: submitit's, and inside a job Slurm's
    ``SLURM_*`` outputs (``SLURM_JOB_ID``, ``SLURM_ARRAY_JOB_ID``, ``SLURM_NODELIST``...) and sbatch's
    ``SBATCH_MEM_BIND*``."""
    inside = "SLURM_JOB_ID" in env
    # SBATCH_MEM_BIND*: sbatch's outputs in a job (its own --mem-bind), not the user's setting.
    return [k for k in env if k.startswith("SUBMITIT_")
            or (inside and (k.startswith("SLURM_") and k not in _SITE_INPUTS or k.startswith("SBATCH_MEM_BIND")))]


@contextlib.contextmanager
def outside_job() -> Iterator[None]:
    """Submit as if from a login node. sbatch exports the submitting environment, and a run launched
    inside a job (a sweep through hydra-submitit-launcher) would hand its job's identity
    (``SLURM_ARRAY_JOB_ID``, ``SUBMITIT_*``...) to its own jobs, where submitit then looks for the
    wrong job's pickle. The user's own ``SBATCH_*`` (``SBATCH_ACCOUNT``, ``SBATCH_PARTITION``,
    ``SBATCH_QOS``, ``SBATCH_RESERVATION``...), ``SRUN_*`` and ``SALLOC_*`` settings are inputs, kept,
    except an ``SBATCH_EXPORT`` that is not ``ALL`` (a site's ``NONE``): a job must get the submitting
    environment (submitit's own variables, the run's lease epoch), as the job scripts assume."""
    saved = {k: v for k, v in os.environ.items() if k in job_identity(os.environ) or k == "SBATCH_EXPORT"}
    if saved.get("SBATCH_EXPORT", "ALL").upper() != "ALL":
        logger.info("submitting with SBATCH_EXPORT=ALL (not %s): the jobs need this environment",
                    saved["SBATCH_EXPORT"])
    for k in saved:
        del os.environ[k]
    try:
        yield
    finally:
        os.environ.update(saved)


# ---- what runs inside the jobs (pickled by submitit) ------------------------------------------
def router_task(run_dir: str) -> None:
    router_process.serve(run_dir, None)


def node_role(env: dict[str, str] | None = None) -> dict[str, str]:
    """Node rank, node count and master node of this task's replica, from the variables srun sets in
    every task (the same under submitit's srun and an allocation's srun steps). The master port is node
    rank 0's to pick when it starts (``toolkit.engine.nodes.publish_master``)."""
    env = dict(os.environ) if env is None else env
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or socket.gethostname()
    simple = "[" not in nodelist and "," not in nodelist
    master = nodelist if simple else hostnames(nodelist)[0]
    return {
        "TOOLKIT_NODE_RANK": env.get("SLURM_NODEID", "0"),
        "TOOLKIT_NNODES": env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES", "1"),
        "TOOLKIT_MASTER_ADDR": master,
    }


def replica_task(run_dir: str, group: str, index: int) -> None:
    """One node of a replica: node rank 0 serves it; the other nodes of a multi-node replica run the
    engine's workers for it (``toolkit/engine/nodes.py``)."""
    if os.environ.get("SLURM_LOCALID", "0") != "0":
        return  # one task per node is asked for; a second one on a node would only duplicate it
    for var in ("VLLM_CACHE_ROOT", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
        if os.environ.get(var):
            Path(os.environ[var]).mkdir(parents=True, exist_ok=True)
    role = node_role()
    # A requeued job keeps its id, and its steps' ids start again at 0: the restart count tells its
    # incarnations apart, so node ranks never read the previous one's address.
    job = (os.environ.get("SLURM_JOB_ID", "0") + "." + os.environ.get("SLURM_STEP_ID", "0")
           + ".r" + os.environ.get("SLURM_RESTART_COUNT", "0"))
    serve_node(run_dir, group, index, NodeRole(int(role["TOOLKIT_NODE_RANK"]), int(role["TOOLKIT_NNODES"]),
                                               role["TOOLKIT_MASTER_ADDR"], 0, rendezvous=job))


def ranks_task(run_dir: str, first_step: int = 0) -> None:
    code = worker.main([run_dir, "--first-step", str(first_step)])
    if code:
        raise ComponentFailed(f"rollout rank exited with {code}")


# ---- components ----------------------------------------------------------------------------
class SlurmJobComponent(Component):
    """One Slurm job (or array element), watched through the run's shared ``JobStates``."""

    def __init__(self, name: str, job: Any, states: JobStates) -> None:
        super().__init__(name)
        self.job = job
        self.job_id = str(job.job_id)
        self.states = states
        states.watch(self.job_id)

    def alive(self) -> bool:
        return self.states.get(self.job_id).live

    def state(self) -> str:
        return f"{self.states.get(self.job_id)} (job {self.job_id})"

    def exit_code(self) -> int | None:
        s = self.states.get(self.job_id)
        if s.live:
            return None
        return 0 if s.state == "COMPLETED" else (s.exit_code or 1)

    def cancel(self) -> None:
        scancel([self.job_id])

    def kill(self) -> None:
        scancel([self.job_id], signal="KILL")

    def refs(self) -> list[ProcessRef]:
        return []  # processes on other nodes: stopped through Slurm, never by pid

    def outputs(self) -> list[Path]:
        return submitit_outputs(self.job)

    def pending(self) -> bool:
        return self.states.get(self.job_id).state in ("PENDING", "CONFIGURING", "UNKNOWN")

    def interrupted(self) -> str:
        s = self.states.get(self.job_id)
        return f"Slurm ended job {self.job_id} ({self.name}): {s.state}" if s.state in _SLURM_ENDS else ""


class SlurmCluster(Cluster):
    def __init__(self, cfg: Config, run_dir: RunDir, owner: ProcessRef) -> None:
        super().__init__(cfg, run_dir, owner)
        assert isinstance(cfg.cluster, SlurmClusterConfig)
        self.c: SlurmClusterConfig = cfg.cluster
        need("sbatch")
        self.states = JobStates(self.c.poll_s)
        self.cache = cache_dir(cfg, run_dir)
        # One submitit folder per run (inside the run dir): a reused folder can hand back an old
        # job's result once Slurm's job ids restart.
        self.folder = run_dir.submitit

    def _executor(self, name: str, *, nodes: int = 1, tasks_per_node: int = 1, cpus: int = 1,
                  mem: str = "1G", gpus: int = 0, setup: list[str] | None = None,
                  srun_args: list[str] | None = None, extra: dict[str, Any] | None = None,
                  requeue: bool = True, partition: str | None = None) -> submitit.SlurmExecutor:
        c = self.c
        ex = submitit.SlurmExecutor(folder=self.folder / name, python=c.python or shlex.quote(sys.executable))
        params: dict[str, Any] = {
            "job_name": f"{self.cfg.job}-{name}", "time": c.job_timeout_min, "nodes": nodes,
            "ntasks_per_node": tasks_per_node, "cpus_per_task": cpus, "mem": mem,
            "setup": [*c.setup, *(setup or [])], "stderr_to_stdout": True,
            # submitit's default signal-before-timeout is for checkpointing functions; these are services.
            "signal_delay_s": 30,
        }
        for key in ("partition", "account", "qos", "constraint"):
            if getattr(c, key):
                params[key] = getattr(c, key)
        if partition:
            params["partition"] = partition
        if gpus:
            params["gpus_per_node"] = gpus
        if srun_args:
            params["srun_args"] = srun_args
        # Services (router, replicas) come back after a preemption; the ranks must not rerun steps.
        additional: dict[str, Any] = {"requeue": True} if requeue else {"no_requeue": True}
        for line in c.extra_sbatch:
            key, _, value = line.lstrip("-").partition("=")
            additional[key.replace("-", "_")] = value if value else True
        additional.update(extra or {})
        params["additional_parameters"] = additional
        ex.update_parameters(**params)
        return ex

    def _submit(self, ex: submitit.SlurmExecutor, fn: Any, *args: Any) -> Any:
        with outside_job():
            return ex.submit(fn, *args)

    def _track_job(self, name: str, job: Any) -> Component:
        comp = SlurmJobComponent(name, job, self.states)
        logger.info("%s: Slurm job %s", name, comp.job_id)
        # Recorded per launch: a resume cancels what a killed launch left queued.
        path = self.run_dir.jobs(current_epoch())
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(comp.job_id + "\n")
        return self.track(comp)

    def start_router(self) -> Component:
        ex = self._executor("router", cpus=self.c.router_cpus, mem=self.c.router_mem)
        return self._track_job("router", self._submit(ex, router_task, str(self.run_dir.root)))

    def _replica_executor(self, group: str) -> submitit.SlurmExecutor:
        res = replica_resources(self.cfg, group)
        exports = [f"export {k}={shlex.quote(v)}" for k, v in cache_env(self.cache).items()]
        return self._executor(f"replica-{group}", nodes=res.nodes, cpus=res.cpus, mem=res.mem, gpus=res.gpus,
                              setup=exports, requeue=res.requeue, partition=res.partition)

    def start_group(self, group: str, n: int) -> list[Component]:
        """All replicas of a group as one job array (one array task per replica)."""
        if n == 0:
            return []
        ex = self._replica_executor(group)
        ex.update_parameters(array_parallelism=n)
        root = str(self.run_dir.root)
        with outside_job():
            jobs = ex.map_array(replica_task, [root] * n, [group] * n, list(range(n)))
        return [self._track_job(process_name(group, i), job) for i, job in enumerate(jobs)]

    def start_replica(self, group: str, index: int) -> Component:
        job = self._submit(self._replica_executor(group), replica_task, str(self.run_dir.root), group, index)
        return self._track_job(process_name(group, index), job)

    def start_ranks(self, n: int, first_step: int = 0) -> Component:
        per_node = self.c.ranks_per_node or n
        nodes = math.ceil(n / per_node)
        ex = self._executor("ranks", nodes=nodes, tasks_per_node=min(per_node, n), cpus=self.c.rank_cpus,
                            mem=self.c.rank_mem, srun_args=[f"--mpi={self.c.mpi}", f"--ntasks={n}"],
                            extra={"ntasks": n}, requeue=False)
        return self._track_job("ranks", self._submit(ex, ranks_task, str(self.run_dir.root), first_step))

    def stop_all(self, grace_s: float = 5.0, sweep: bool = True) -> list[ProcessRef]:
        """scancel every job this launch submitted, then wait until squeue no longer lists any of them
        (``sweep`` has nothing more to reach: no pid file sweep here)."""
        ids = [c.job_id for c in self.components if isinstance(c, SlurmJobComponent)]
        scancel(ids)
        # Slurm sends SIGTERM, then SIGKILL after its KillWait; allow for both plus a slow controller.
        left = wait_gone(ids, timeout_s=max(60.0, 4 * grace_s))
        if left:
            logger.error("jobs still queued after scancel: %s; sending SIGKILL", left)
            scancel(left, signal="KILL")
            left = wait_gone(left, timeout_s=30.0, signal="KILL")
        if left:
            logger.error("jobs still queued after SIGKILL: %s", left)
        return []


if __name__ == "__main__":
    # ``python -m toolkit.cluster.slurm replica RUN_DIR GROUP INDEX``: a replica as an srun step
    # (cluster=allocation), with the same node roles as under submitit.
    if len(sys.argv) != 5 or sys.argv[1] != "replica":
        sys.exit("usage: python -m toolkit.cluster.slurm replica RUN_DIR GROUP INDEX")
    replica_task(sys.argv[2], sys.argv[3], int(sys.argv[4]))
