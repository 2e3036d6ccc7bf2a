"""``cluster=local``: the router and replicas as submitit LocalExecutor jobs, ranks under mpiexec."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import submitit

from toolkit.cluster.base import Cluster, Component, submitit_outputs
from toolkit.config import Config, replica_nodes
from toolkit.core.errors import ComponentFailed, FieldError
from toolkit.core.lifecycle import ProcessRef, popen_logged
from toolkit.core.names import process_name
from toolkit.engine import replica
from toolkit.engine.node_role import NodeRole
from toolkit.engine.nodes import serve_node
from toolkit.router import process as router_process


def node_task(run_dir: str, group: str, index: int, owner: ProcessRef, nodes: int) -> None:
    """One node rank of a local multi-node replica (its submitit task rank); node rank 0 picks the
    master port when it starts and the others read it from the run dir, as on Slurm."""
    env = submitit.JobEnvironment()
    serve_node(run_dir, group, index, NodeRole(env.global_rank, nodes, "127.0.0.1", 0, rendezvous=str(env.job_id)),
               owner)


class SubmititComponent(Component):
    def __init__(self, name: str, job: Any) -> None:
        super().__init__(name)
        self.job = job
        proc = getattr(job, "_process", None)
        self._ref = ProcessRef.of(proc.pid, name) if proc is not None else None

    def alive(self) -> bool:
        return self.job.state == "RUNNING"

    def state(self) -> str:
        return f"{self.job.state} (job {self.job.job_id})"

    def exit_code(self) -> int | None:
        proc = getattr(self.job, "_process", None)
        return None if proc is None else proc.poll()

    def cancel(self) -> None:
        # submitit's local controller forwards SIGTERM to its task and exits when the task has;
        # its own cancel() sends SIGINT, which prints a KeyboardInterrupt trace from the controller.
        proc = getattr(self.job, "_process", None)
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        proc = getattr(self.job, "_process", None)
        if proc is not None and proc.poll() is None:
            proc.kill()

    def refs(self) -> list[ProcessRef]:
        return [self._ref] if self._ref is not None else []

    def outputs(self) -> list[Path]:
        return submitit_outputs(self.job)


class ProcessGroupComponent(Component):
    """A process started in its own session (mpiexec and its ranks); stopped as a group by its pid."""

    def __init__(self, name: str, proc: subprocess.Popen[bytes]) -> None:
        super().__init__(name)
        self.proc = proc
        self._ref = ProcessRef.of(proc.pid, name)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def state(self) -> str:
        code = self.proc.poll()
        return "RUNNING" if code is None else f"exited {code}"

    def exit_code(self) -> int | None:
        return self.proc.poll()

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)  # the group we created with start_new_session
        except (ProcessLookupError, PermissionError):
            pass

    def cancel(self) -> None:
        self._signal_group(signal.SIGTERM)

    def kill(self) -> None:
        self._signal_group(signal.SIGKILL)
        self.proc.wait(timeout=5)

    def refs(self) -> list[ProcessRef]:
        return [self._ref]


def find_mpiexec(configured: str | None) -> str:
    if configured:
        return configured
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.exists():
        return str(beside)
    found = shutil.which("mpiexec")
    if found is None:
        raise ComponentFailed("no mpiexec found beside Python or on PATH; `pip install mpich` or set cluster.mpiexec")
    return found


def check_local(cfg: Config) -> list[FieldError]:
    """``cluster=local``'s check beyond its fields' own: an mpiexec to start the ranks with (found after the
    fleet is up, a wrong one failed the run there)."""
    configured = cfg.cluster.mpiexec
    if configured is None:
        try:
            find_mpiexec(None)
        except ComponentFailed as exc:
            return [FieldError("cluster.mpiexec", None, str(exc))]
        return []
    if shutil.which(configured) is None:
        return [FieldError("cluster.mpiexec", configured, "an executable mpiexec: a path, or a name on PATH")]
    return []


class LocalCluster(Cluster):
    def _executor(self, name: str) -> submitit.LocalExecutor:
        ex = submitit.LocalExecutor(folder=self.run_dir.submitit / name)
        ex.update_parameters(timeout_min=self.cfg.cluster.job_timeout_min)
        return ex

    def _submit(self, name: str, fn: Any, *args: Any) -> Component:
        job = self._executor(name).submit(fn, *args)
        return self.track(SubmititComponent(name, job))

    def start_router(self) -> Component:
        return self._submit("router", router_process.serve, str(self.run_dir.root), self.owner)

    def start_replica(self, group: str, index: int) -> Component:
        name = process_name(group, index)
        nodes = replica_nodes(self.cfg, group)
        if nodes == 1:
            return self._submit(name, replica.serve, str(self.run_dir.root), group, index, self.owner)
        # A replica wider than a node: one task per node rank, meeting only at a master address on
        # loopback, as the nodes of a Slurm job meet at their first node's.
        ex = self._executor(name)
        ex.update_parameters(tasks_per_node=nodes)
        job = ex.submit(node_task, str(self.run_dir.root), group, index, self.owner, nodes)
        return self.track(SubmititComponent(name, job))

    def start_ranks(self, n: int, first_step: int = 0) -> Component:
        cmd = [find_mpiexec(self.cfg.cluster.mpiexec), "-n", str(n), sys.executable, "-u", "-m",
               "toolkit.rollout.worker", str(self.run_dir.root), "--first-step", str(first_step),
               "--owner", self.owner.arg]
        proc = popen_logged(cmd, self.run_dir.ranks_out, start_new_session=True, env=local_mpi_env(os.environ))
        return self.track(ProcessGroupComponent("ranks", proc))


def local_mpi_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` for an mpiexec that starts every rank on this machine. Inside a Slurm job (an ``srun --pty``
    shell, a hydra-submitit point) MPICH's mpiexec would start them through a nested srun, which waits
    for good for CPUs the job's step holds: its launcher is ``fork`` and its hosts this one instead
    (a user's own ``HYDRA_LAUNCHER`` / ``HYDRA_RMK`` stay; other MPIs read neither)."""
    return {"HYDRA_LAUNCHER": "fork", "HYDRA_RMK": "user", **env}
