"""Fixtures of the cluster tier: run dirs for the real Slurm and the tiny model (a router with one vLLM
replica: vllm_routed/conftest.py). Whether Slurm or vLLM is there is checked by the markers
(tests/conftest.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.slurm import SHARED, our_jobs


@pytest.fixture
def slurm_run(request: pytest.FixtureRequest) -> Iterator[tuple[Path, str]]:
    """(a fresh dir on shared storage, a unique job name); the dir is removed afterwards and the
    test fails if any Slurm job of the run is still queued."""
    job = "t" + uuid.uuid4().hex[:8]
    d = SHARED / f"{request.node.name[:40]}-{job}"
    d.mkdir(parents=True)
    yield d, job
    try:
        left = our_jobs(job)
        if left:
            subprocess.run(["scancel", *[j for j, _ in left]], timeout=30)
        assert not left, f"jobs of the run still queued after it ended: {left}"
    finally:
        if os.environ.get("TOOLKIT_KEEP_RUNS") != "1":
            shutil.rmtree(d, ignore_errors=True)
            try:
                SHARED.rmdir()
            except OSError:
                pass


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny model as ``model=tiny`` builds it (into ``cache``), another checkpoint, a LoRA adapter:
    built once for the session (tests copy what they change)."""
    from toolkit.model.tiny import build_all, ensure_tiny

    root = tmp_path_factory.mktemp("tiny")
    built = build_all(root / "models")
    return {**built, "cache": root / "cache", "tiny": ensure_tiny(root / "cache")}
