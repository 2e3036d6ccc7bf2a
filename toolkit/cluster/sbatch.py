"""sbatch scripts that run a whole rollout inside one allocation (``cluster=allocation``).

:func:`render_sbatch` is the one place such a script is written: a pure function of the config and
the overrides it was composed from. The allocation is sized from the same layout the backend uses
(:func:`toolkit.cluster.allocation.plan_allocation`); inside it ``launch`` starts the router, the
replicas and the ranks as srun steps. The scripts in ``slurm/`` are renderings of :data:`TEMPLATES`
(``toolkit/launch/sbatch.py``, which a test keeps equal to them).
"""

from __future__ import annotations

import shlex

from toolkit.cluster.allocation import Plan, plan_allocation
from toolkit.config import Config, SlurmClusterConfig


def _layout(plan: Plan) -> list[str]:
    lines = []
    for n in range(plan.nodes):
        items = []
        for s in plan.steps():
            if n not in s.nodes:
                continue
            tasks = s.tasks // len(s.nodes) if s.name != "ranks" else sum(
                1 for r in range(s.tasks) if s.nodes[r * len(s.nodes) // s.tasks] == n)
            what = s.name + (f" x{tasks}" if tasks > 1 else "")
            if len(s.nodes) > 1:
                what += f" (node {s.nodes.index(n) + 1}/{len(s.nodes)})"
            items.append(what + (f" [{s.gpus} GPU]" if s.gpus else ""))
        lines.append(f"#   node {n}: " + ", ".join(items))
    return lines


def render_sbatch(cfg: Config, overrides: list[str], name: str = "rollout") -> str:
    """The sbatch script that runs ``cfg`` (composed from ``cluster=allocation`` + ``overrides``)."""
    c = cfg.cluster
    assert isinstance(c, SlurmClusterConfig) and c.type == "allocation", "render a cluster=allocation config"
    plan = plan_allocation(cfg)
    cpus, mem = plan.node_cpus(), plan.node_mem_mb()
    opts = [f"--job-name={cfg.job}"]
    for key in ("partition", "account", "qos", "constraint"):
        if getattr(c, key):
            opts.append(f"--{key}={getattr(c, key)}")
    opts += [f"--time={c.job_timeout_min}", f"--nodes={plan.nodes}", "--ntasks-per-node=1",
             f"--cpus-per-task={max(cpus)}", f"--mem={max(mem)}M"]
    if plan.gpus_per_node:
        opts.append(f"--gpus-per-node={plan.gpus_per_node}")
    # Requeued (preemption, scontrol requeue, or launch itself at the USR1 that comes signal_grace_s
    # before the time limit), the job starts again and resumes its run.
    opts += ["--output=slurm-%x-%j.out", "--open-mode=append", "--requeue", f"--signal=B:USR1@{c.signal_grace_s}", *c.extra_sbatch]
    python = shlex.split(c.python) if c.python else ["python"]  # (a container's command: words, each quoted)
    launch = shlex.join([*python, "-m", "toolkit.launch", "cluster=allocation", *overrides])
    # The run dir must be the same at every start of the job: by default it is named after the job
    # (a hydra.run.dir among the arguments comes later on the command line and wins).
    run_dir = '"hydra.run.dir=outputs/${SLURM_JOB_NAME}-${SLURM_JOB_ID}"'
    lines = [
        "#!/bin/bash",
        f"# {name}: a whole rollout inside one allocation; router, replicas and ranks run as srun steps.",
        "# Rendered by toolkit/launch/sbatch.py; do not edit, re-render after changing replicas or",
        "# resources (the allocation is sized from them):",
        f"#   {shlex.join(['python', '-m', 'toolkit.launch.sbatch', *overrides])} > {name}.sbatch",
        "# Run it (more overrides may follow; hydra.run.dir must be on a shared file system):",
        f"#   sbatch {name}.sbatch steps=10 tail.threshold=0.9"
        + (" engine.model=/shared/models/<model>" if cfg.engine.type == "vllm" else ""),
        f"# When Slurm requeues it (preemption; USR1 {c.signal_grace_s}s before the time limit, when launch",
        "# finishes or abandons its step and requeues the job) it resumes where it stopped.",
        "#",
        *[f"#SBATCH {o}" for o in opts],
        "#",
        "# Layout (toolkit.cluster.allocation.plan_allocation):",
        *_layout(plan),
        "set -euo pipefail",
    ]
    if c.setup:
        lines += ["", "# setup (cluster.setup)", *c.setup]
    lines += [
        "",
        "# A restarted (requeued) job continues its run.",
        "resume=()",
        'if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then resume=(resume=true); fi',
        f'exec {launch} {run_dir} "$@" ${{resume[@]+"${{resume[@]}}"}}',
        "",
    ]
    return "\n".join(lines)
