"""sbatch scripts: stored renderings (tests/helpers/data/sbatch/), slurm/*.sbatch kept equal to their
rendering, and the allocation layout they are sized from."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from toolkit.cluster.allocation import mem_mb, plan_allocation
from toolkit.cluster.sbatch import render_sbatch
from toolkit.launch.sbatch import SLURM_DIR, TEMPLATES, compose, render_template
from toolkit.launch.sbatch import main as sbatch_main

DATA = Path(__file__).resolve().parents[1] / "helpers" / "data" / "sbatch"
# Regenerate the stored files after a deliberate change: TOOLKIT_UPDATE_STORED=1 pytest tests/unit/test_sbatch.py
UPDATE = os.environ.get("TOOLKIT_UPDATE_STORED") == "1"

CASES: dict[str, list[str]] = {
    "default": [],
    "multinode": TEMPLATES["rollout-multinode"],
    "site": [
        "cluster.partition=gpu", "cluster.account=rl-team", "cluster.qos=high", "cluster.constraint=h100",
        "cluster.extra_sbatch=['--reservation=rl','--exclusive']",
        "cluster.setup=['module load cuda/12.4','source $HOME/venv/bin/activate']",
        "cluster.python=/opt/venv/bin/python", "cluster.gpus_per_node=4", "cluster.replica.gpus=1",
        "job=sweep-a", "steps=20", "tail.threshold=0.9",
    ],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_rendering_matches_the_stored_file(case: str) -> None:
    text = render_sbatch(compose(CASES[case]), CASES[case], case)
    path = DATA / f"{case}.sbatch"
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert text == path.read_text(), f"rendering of {case} changed; if on purpose: TOOLKIT_UPDATE_STORED=1"


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_slurm_templates_are_their_rendering(name: str) -> None:
    assert (SLURM_DIR / f"{name}.sbatch").read_text() == render_template(name), (
        f"slurm/{name}.sbatch is stale: python -m toolkit.launch.sbatch --write-templates")


def test_the_cli_prints_the_same_rendering(capsys: pytest.CaptureFixture[str]) -> None:
    assert sbatch_main([*CASES["site"], "--name", "site"]) == 0  # python -m toolkit.launch.sbatch ...
    assert capsys.readouterr().out == (DATA / "site.sbatch").read_text()


def test_the_cli_lists_config_errors_as_launch_does(capsys: pytest.CaptureFixture[str]) -> None:
    """Each error of the command line (not a traceback), exit 2; another cluster than the allocation's is one."""
    assert sbatch_main(["tail.threshold=1.5", "groups.tail.replicas=0", "steps=abc"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: invalid configuration") and "steps = 'abc'" in err
    assert sbatch_main(["tail.threshold=1.5", "groups.tail.replicas=0"]) == 2
    err = capsys.readouterr().err
    assert "tail.threshold = 1.5" in err and "groups.tail.replicas = 0" in err
    assert sbatch_main(["cluster=slurm"]) == 2 and "cluster = 'slurm': allocation" in capsys.readouterr().err


def test_a_python_of_several_words_runs_as_a_command(capsys: pytest.CaptureFixture[str]) -> None:
    """``cluster.python`` as container users set it: its words, not one word the shell cannot find."""
    assert sbatch_main(["cluster.python=apptainer exec /shared/img.sif python"]) == 0
    out = capsys.readouterr().out
    assert "\nexec apptainer exec /shared/img.sif python -m toolkit.launch cluster=allocation " in out


def test_layout_packs_gpus_and_gives_wide_replicas_whole_nodes() -> None:
    plan = plan_allocation(compose(TEMPLATES["rollout-multinode"]))
    assert plan.nodes == 4
    thr = [s for (g, _), s in plan.replicas.items() if g == "throughput"]
    assert [s.nodes for s in thr] == [[0]] * 4 + [[1]] * 4  # 2 GPUs each, 4 per 8-GPU node
    tail = plan.replicas[("tail", 0)]
    assert tail.nodes == [2, 3] and tail.tasks == 2 and tail.gpus == 8  # one task per node
    assert plan.router.nodes == [0] and plan.ranks.nodes == [0] and plan.ranks.tasks == 8
    gpus = [0] * plan.nodes
    for s in plan.replicas.values():
        for n in s.nodes:
            gpus[n] += s.gpus
    assert gpus == [8, 8, 8, 8]


def test_cpu_layout_fits_one_node_and_sizes_the_allocation() -> None:
    plan = plan_allocation(compose([]))
    assert plan.nodes == 1 and plan.gpus_per_node == 0
    # router 1 + 3 replicas x 1 + 2 ranks x 1 CPUs; memory of every step plus launch's own.
    assert plan.node_cpus() == [6]
    assert plan.node_mem_mb() == [512 + 3 * 1024 + 2 * 512 + 512]
    assert mem_mb("2G") == 2048 and mem_mb("512M") == 512 and mem_mb("100") == 100


def test_the_steps_do_not_inherit_the_jobs_gpu_requests() -> None:
    """sbatch exports ``SLURM_GPUS_PER_NODE`` and srun reads it as ``--gpus-per-node``: the router's step would
    take every GPU of its node. GPU steps ask for theirs."""
    from toolkit.cluster.allocation import step_env

    job = {"SLURM_JOB_ID": "7", "SLURM_GPUS_PER_NODE": "8", "SLURM_TRES_PER_TASK": "gres/gpu:1", "SLURM_GPUS": "16",
           "SLURM_NTASKS_PER_NODE": "1", "SLURM_CPUS_PER_GPU": "4", "PATH": "/bin"}
    assert step_env(job) == {"SLURM_JOB_ID": "7", "PATH": "/bin"}
