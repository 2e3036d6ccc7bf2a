"""``python -m toolkit.launch.sbatch [overrides]``: an sbatch script that runs the config inside one
allocation (:func:`toolkit.cluster.sbatch.render_sbatch`), and the scripts in ``slurm/``::

    python -m toolkit.launch.sbatch groups.throughput.replicas=8 > my.sbatch   # any config
    python -m toolkit.launch.sbatch --write-templates                          # refresh slurm/*.sbatch
    sbatch slurm/rollout.sbatch steps=10 tail.threshold=0.9                    # run it
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from toolkit.cluster.sbatch import render_sbatch
from toolkit.config import Config, compose_config
from toolkit.core.errors import ConfigError, FieldError, ToolkitError
from toolkit.launch.composition import check_overrides
from toolkit.launch.validation import validate

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


def compose(overrides: list[str]) -> Config:
    """The config ``launch`` would run inside the allocation for these overrides."""
    cfg = compose_config(["cluster=allocation", *overrides])
    validate(cfg)
    return cfg


def render_template(name: str) -> str:
    return render_sbatch(compose(TEMPLATES[name]), TEMPLATES[name], name)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m toolkit.launch.sbatch",
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
    try:
        chosen = [o for o in args.overrides if o.startswith("cluster=")]
        if any(o != "cluster=allocation" for o in chosen):
            raise ConfigError([FieldError("cluster", chosen[-1].partition("=")[2], "allocation (the script runs the "
                                          "config inside one allocation; cluster=slurm submits from a login node)")])
        check_overrides(["cluster=allocation", *args.overrides])
        cfg = compose(args.overrides)
    except ToolkitError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(render_sbatch(cfg, args.overrides, args.name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
