"""``cluster=allocation``: inside one sbatch allocation (``slurm/*.sbatch``), the router, every
replica and the rollout ranks run as ``srun`` steps that split the allocation's nodes.

:func:`plan_allocation` is the layout, a pure function of the config: the router and the ranks on the
first node(s), CPU replicas beside them, GPU replicas packed first-fit onto nodes by
``cluster.gpus_per_node``, a replica wider than a node on whole nodes of its own. The sbatch renderer
(``toolkit/cluster/sbatch.py``) sizes the allocation from the same plan, and the backend places each
step with ``srun --nodelist``. Steps get exactly what they ask for (``--exact``), so they run side
by side. Teardown signals each step with ``scancel --signal=TERM JOB.STEP`` so components shut down
cleanly (a plain scancel of a step, or SIGTERM to srun itself, SIGKILLs the tasks).
"""

from __future__ import annotations

import logging
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from toolkit.cluster.base import Cluster, Component
from toolkit.cluster.local import ProcessGroupComponent
from toolkit.cluster.slurm import cache_dir, cache_env
from toolkit.config import Config, SlurmClusterConfig, replica_resources
from toolkit.core.errors import ComponentFailed
from toolkit.core.lifecycle import ProcessRef, popen_logged
from toolkit.core.names import process_name
from toolkit.core.rundir import RunDir
from toolkit.core.slurmctl import hostnames, need, scancel, step_ids

logger = logging.getLogger(__name__)

LAUNCHER_MEM_MB = 512
"""Memory kept on the first node for ``launch`` itself (the batch step)."""


def mem_mb(mem: str) -> int:
    """sbatch memory (``512M``, ``4G``, ``2048``) in megabytes."""
    m = re.fullmatch(r"([0-9]+)([KMGT]?)", str(mem))
    if m is None:
        raise ValueError(f"not an sbatch memory size: {mem!r}")
    scale = {"K": 1 / 1024, "": 1, "M": 1, "G": 1024, "T": 1024 * 1024}[m.group(2)]
    return max(1, math.ceil(int(m.group(1)) * scale))


@dataclass
class Step:
    """One srun step of the plan."""

    name: str
    nodes: list[int]
    """Indices into the allocation's node list."""
    tasks: int
    cpus: int
    """CPUs per task."""
    mem_mb: int
    """Memory per node."""
    gpus: int = 0
    """GPUs per node."""


@dataclass
class Plan:
    nodes: int
    router: Step
    ranks: Step
    replicas: dict[tuple[str, int], Step] = field(default_factory=dict)
    gpus_per_node: int = 0

    def steps(self) -> list[Step]:
        return [self.router, *self.replicas.values(), self.ranks]

    def node_cpus(self) -> list[int]:
        cpus = [0] * self.nodes
        for s in self.steps():
            per_node = math.ceil(s.tasks / len(s.nodes))
            for n in s.nodes:
                cpus[n] += per_node * s.cpus
        return cpus

    def node_mem_mb(self) -> list[int]:
        mem = [0] * self.nodes
        mem[0] += LAUNCHER_MEM_MB
        for s in self.steps():
            for n in s.nodes:
                mem[n] += s.mem_mb
        return mem


def plan_allocation(cfg: Config) -> Plan:
    c = cfg.cluster
    assert isinstance(c, SlurmClusterConfig)
    per_node = c.ranks_per_node or cfg.ranks
    rank_nodes = list(range(math.ceil(cfg.ranks / per_node)))
    ranks = Step("ranks", rank_nodes, cfg.ranks, c.rank_cpus, mem_mb(c.rank_mem) * min(per_node, cfg.ranks))
    router = Step("router", [0], 1, c.router_cpus, mem_mb(c.router_mem))
    free: list[int] = [c.gpus_per_node] * len(rank_nodes)  # free GPUs per node
    replicas: dict[tuple[str, int], Step] = {}
    for group, gcfg in cfg.groups.items():
        res = replica_resources(cfg, group)
        for i in range(gcfg.replicas):
            if res.gpus == 0 and res.nodes == 1:
                nodes = [0]  # a CPU engine (sim) beside the router
            elif res.nodes == 1 and (fit := [n for n, f in enumerate(free) if f >= res.gpus]):
                nodes = [fit[0]]
            else:
                # Whole new nodes; without cluster.gpus_per_node a GPU replica gets nodes to itself.
                nodes = list(range(len(free), len(free) + res.nodes))
                free += [c.gpus_per_node] * res.nodes
            for n in nodes:
                free[n] -= res.gpus
            replicas[(group, i)] = Step(process_name(group, i), nodes, len(nodes), res.cpus, mem_mb(res.mem),
                                        res.gpus)
    return Plan(len(free), router, ranks, replicas, max([c.gpus_per_node] + [s.gpus for s in replicas.values()]))


# ---- the backend ---------------------------------------------------------------------------
class SrunStep(ProcessGroupComponent):
    """An ``srun`` process (in its own session) and the job step it created."""

    def __init__(self, name: str, proc: subprocess.Popen[bytes], job_id: str, step_name: str) -> None:
        super().__init__(name, proc)
        self.job_id = job_id
        self.step_name = step_name

    def state(self) -> str:
        code = self.proc.poll()
        return "RUNNING (srun step)" if code is None else f"exited {code}"

    def _step_ids(self) -> list[str]:
        return step_ids(self.job_id, self.step_name)

    def cancel(self) -> None:
        steps = self._step_ids()
        if steps:
            scancel(steps, signal="TERM")  # a plain scancel of a step is SIGKILL: no clean shutdown
        elif self.alive():
            self.proc.send_signal(signal.SIGTERM)  # no step yet: srun is still waiting for resources

    def kill(self) -> None:
        scancel(self._step_ids(), signal="KILL")
        self._signal_group(signal.SIGKILL)
        self.proc.wait(timeout=10)


GPU_INPUTS = ("SLURM_GPUS", "SLURM_TRES_PER_", "SLURM_GRES", "SLURM_CPUS_PER_GPU", "SLURM_MEM_PER_GPU")
"""The job's GPU requests, which sbatch exports and srun reads as its own (``SLURM_GPUS_PER_NODE`` is
``--gpus-per-node``): a CPU step would take every GPU of its node, and the replicas there wait for good."""


def step_env(env: Mapping[str, str]) -> dict[str, str]:
    """The environment of the allocation's srun steps: the job's, without what would size a step as the
    job (its tasks per node, its GPUs: each step asks for its own)."""
    return {k: v for k, v in env.items() if k != "SLURM_NTASKS_PER_NODE" and not k.startswith(GPU_INPUTS)}


def allocation_problems(cfg: Config, env: Mapping[str, str]) -> list[str]:
    """Why ``cfg`` cannot run in the allocation ``env`` describes (none: it can), each as where it must run
    instead. The sbatch line may carry overrides the rendered ``#SBATCH`` lines were not made for: a plan
    that needs more nodes, CPUs, memory or GPUs a node than the job holds would wait for its steps for good."""
    job, nodelist = env.get("SLURM_JOB_ID"), env.get("SLURM_JOB_NODELIST")
    if not job or not nodelist:
        return ["inside an sbatch allocation (sbatch slurm/rollout.sbatch); from a login node: cluster=slurm"]
    plan = plan_allocation(cfg)
    nodes = env.get("SLURM_JOB_NUM_NODES", "")
    held = {"node(s)": int(nodes) if nodes.isdigit() else len(hostnames(nodelist))}
    need = {"node(s)": plan.nodes}
    for what, var, want in (("CPUs a node", "SLURM_CPUS_ON_NODE", max(plan.node_cpus())),
                            ("MB of memory a node", "SLURM_MEM_PER_NODE", max(plan.node_mem_mb())),
                            ("GPUs a node", "SLURM_GPUS_ON_NODE", plan.gpus_per_node)):
        if env.get(var, "").isdigit():  # (a job without --mem, or without GPUs, does not say)
            held[what], need[what] = int(env[var]), want
    return [f"in an allocation of {need[what]} {what} for this config, not job {job}'s {held[what]} "
            f"(python -m toolkit.launch.sbatch renders one for it)" for what in need if need[what] > held[what]]


class AllocationCluster(Cluster):
    def __init__(self, cfg: Config, run_dir: RunDir, owner: ProcessRef) -> None:
        super().__init__(cfg, run_dir, owner)
        assert isinstance(cfg.cluster, SlurmClusterConfig)
        self.c: SlurmClusterConfig = cfg.cluster
        why = allocation_problems(cfg, os.environ)
        if why:
            raise ComponentFailed(f"cluster=allocation runs {'; '.join(why)}")
        self.job_id = os.environ["SLURM_JOB_ID"]
        self.hosts = hostnames(os.environ["SLURM_JOB_NODELIST"])
        self.plan = plan_allocation(cfg)
        self.python = shlex.split(self.c.python) if self.c.python else [sys.executable]  # (a container's command)
        self.env = step_env(os.environ)
        self.env.update(cache_env(cache_dir(cfg, run_dir)))

    def _srun(self, step: Step, name: str, args: list[str], log: str, extra: list[str] | None = None) -> Component:
        hosts = ",".join(self.hosts[n] for n in step.nodes)
        cmd = [need("srun"), "--exact", f"--job-name={name}", f"--nodes={len(step.nodes)}", f"--nodelist={hosts}",
               f"--ntasks={step.tasks}", f"--cpus-per-task={step.cpus}", f"--mem={step.mem_mb}M",
               "--kill-on-bad-exit=1", *(extra or [])]
        if step.gpus:
            cmd.append(f"--gpus-per-node={step.gpus}")
        cmd += [*self.python, "-u", *args]
        proc = popen_logged(cmd, self.run_dir.logs / log, env=self.env, start_new_session=True)
        return self.track(SrunStep(name, proc, self.job_id, name))

    def start_router(self) -> Component:
        return self._srun(self.plan.router, "router", ["-m", "toolkit.router", str(self.run_dir.root)], "router.out")

    def start_replica(self, group: str, index: int) -> Component:
        step = self.plan.replicas[(group, index)]
        return self._srun(step, step.name, ["-m", "toolkit.cluster.slurm", "replica", str(self.run_dir.root), group,
                                            str(index)], f"{step.name}.out", extra=["--ntasks-per-node=1"])

    def max_replicas(self, group: str) -> int | None:
        return sum(1 for g, _ in self.plan.replicas if g == group)  # the allocation was sized for these

    def start_ranks(self, n: int, first_step: int = 0) -> Component:
        return self._srun(self.plan.ranks, "ranks", ["-m", "toolkit.rollout.worker", str(self.run_dir.root),
                                                     "--first-step", str(first_step)],
                          "ranks.out", extra=[f"--mpi={self.c.mpi}"])

    def stop_all(self, grace_s: float = 5.0, sweep: bool = True) -> list[ProcessRef]:
        """Its own job steps only (``sweep`` has nothing more to reach: no pid file sweep here)."""
        for c in self.components:
            if c.alive():
                c.cancel()
        # Slurm's KillWait turns SIGTERM into SIGKILL; srun exits once its step has ended.
        deadline = time.monotonic() + max(30.0, 4 * grace_s)
        while time.monotonic() < deadline and any(c.alive() for c in self.components):
            time.sleep(0.1)
        for c in self.components:
            if c.alive():
                logger.warning("%s did not stop; killing its step", c.name)
                c.kill()
        return [r for c in self.components for r in c.refs() if r.alive()]

