"""sbatch scripts that run a whole rollout inside one allocation (``cluster=allocation``).

:func:`render_sbatch` is the one place such a script is written: a pure function of the config and
the overrides it was composed from. The allocation is sized from the same layout the backend uses
(:func:`toolkit.cluster.allocation.plan_allocation`); inside it ``launch`` starts the router, the
replicas and the ranks as srun steps. The scripts in ``slurm/`` are renderings of :data:`TEMPLATES`
(a test keeps them equal)::

    python -m toolkit.cluster.sbatch groups.throughput.replicas=8 > my.sbatch   # any config
    python -m toolkit.cluster.sbatch --write-templates                          # refresh slurm/*.sbatch
    sbatch slurm/rollout.sbatch steps=10 tail.threshold=0.9                     # run it
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from toolkit.cluster.allocation import Plan, plan_allocation
from toolkit.config import Config, SlurmClusterConfig

ROOT = Path(__file__).resolve().parents[2]
SLURM_DIR = ROOT / "slurm"

# slurm/<name>.sbatch -> the overrides it is rendered from.
TEMPLATES: dict[str, list[str]] = {
    "rollout": [],
    # vLLM on 8-GPU nodes: throughput replicas of tensor parallel 2 packed 4 to a node, and a tail replica
    # of tensor parallel 8 x pipeline parallel 2 = 16 GPUs across two nodes (cluster.gpus_per_node places
    # them); the model comes on the sbatch line (engine.model=/shared/models/...).
    "rollout-multinode": [
        "engine=vllm", "engine.tensor_parallel_size=2", "groups.tail.engine.tensor_parallel_size=8",
        "+groups.tail.engine.pipeline_parallel_size=2", "cluster.gpus_per_node=8", "cluster.replica.cpus=16",
        "cluster.replica.mem=128G", "groups.throughput.replicas=8", "ranks=8", "cluster.ranks_per_node=8",
        "cluster.rank_mem=4G", "cluster.router_cpus=4", "cluster.router_mem=8G", "cluster.job_timeout_min=240",
    ],
}


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
    python = c.python or "python"
    launch = shlex.join([python, "-m", "toolkit.launch", "cluster=allocation", *overrides])
    # The run dir must be the same at every start of the job: by default it is named after the job
    # (a hydra.run.dir among the arguments comes later on the command line and wins).
    run_dir = '"hydra.run.dir=outputs/${SLURM_JOB_NAME}-${SLURM_JOB_ID}"'
    lines = [
        "#!/bin/bash",
        f"# {name}: a whole rollout inside one allocation; router, replicas and ranks run as srun steps.",
        "# Rendered by toolkit/cluster/sbatch.py; do not edit, re-render after changing replicas or",
        "# resources (the allocation is sized from them):",
        f"#   {shlex.join(['python', '-m', 'toolkit.cluster.sbatch', *overrides])} > {name}.sbatch",
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


def compose(overrides: list[str]) -> Config:
    """The config ``launch`` would run inside the allocation for these overrides."""
    from toolkit.config import compose_config
    from toolkit.validation import validate

    cfg = compose_config(["cluster=allocation", *overrides])
    validate(cfg)
    return cfg


def render_template(name: str) -> str:
    return render_sbatch(compose(TEMPLATES[name]), TEMPLATES[name], name)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m toolkit.cluster.sbatch",
                                description="Render an sbatch script that runs the config inside one allocation.")
    p.add_argument("overrides", nargs="*", help="config overrides, as for python -m toolkit.launch")
    p.add_argument("--name", default="rollout", help="the script's name (in its comments)")
    p.add_argument("--write-templates", action="store_true", help="rewrite slurm/*.sbatch from TEMPLATES")
    args = p.parse_args(argv)
    if args.write_templates:
        for name in TEMPLATES:
            (SLURM_DIR / f"{name}.sbatch").write_text(render_template(name))
            print(f"wrote {SLURM_DIR / name}.sbatch")
        return 0
    sys.stdout.write(render_sbatch(compose(args.overrides), args.overrides, args.name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
